"""Train an ImageNet ResNet-50 with Gluon across MPI ranks through mpi_kvstore.

    mpirun -n 2 python examples/train_imagenet.py --steps 10
    mpirun -n 8 python examples/train_imagenet.py --rec train.rec --val-rec val.rec --batch-size 64

--rec names an ImageNet RecordIO file (made with MXNet's im2rec); each rank reads its
part (part_index=rank, num_parts=size). Without it the example feeds synthetic
224x224 images of the right shape, generated on the fly; a synthetic epoch is as long
as an ImageNet one, so pass --steps. Nothing is downloaded.
"""
import os
import sys

import mxnet as mx
import numpy as np
from mxnet.gluon.model_zoo import vision

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common

IMAGE_SIZE = 224
SYNTHETIC_TRAIN, SYNTHETIC_VAL = 1281167, 50000  # ImageNet-1k's sizes, so epochs mean the same


class SyntheticBatches:
    """One rank's synthetic batches: coarse class patterns plus noise, drawn per batch."""

    def __init__(self, n_images, batch_size, steps, classes, seed, split):
        self.batch_size, self.seed, self.split = batch_size, seed, split
        self.templates = common.class_templates(classes, seed)
        self.count = common.count_batches(n_images, batch_size, steps)

    def __len__(self):
        return self.count

    def epoch(self, epoch, rank):
        rng = np.random.default_rng([self.seed, self.split, rank, epoch])
        for _ in range(self.count):
            labels = rng.integers(0, len(self.templates), self.batch_size)
            images = common.render(self.templates, labels, IMAGE_SIZE, rng)
            x = common.to_float(images, common.IMAGENET_MEAN, common.IMAGENET_STD)
            yield mx.nd.array(x), mx.nd.array(labels, dtype=np.float32)


class RecordBatches:
    """One rank's part of a RecordIO file, exactly `count` batches per epoch.

    Parts are cut by bytes, so ranks may hold a few records more or less; a rank
    that runs out starts its part again rather than skip a collective.
    """

    def __init__(self, path, batch_size, steps, kv, train):
        self.batch_size = batch_size
        self.iter = mx.io.ImageRecordIter(
            path_imgrec=path, data_shape=(3, IMAGE_SIZE, IMAGE_SIZE), batch_size=batch_size,
            shuffle=train, rand_crop=train, rand_mirror=train, resize=256,
            mean_r=123.68, mean_g=116.779, mean_b=103.939, std_r=58.393, std_g=57.12,
            std_b=57.375, part_index=kv.rank, num_parts=kv.num_workers,
            preprocess_threads=2, seed=kv.rank)
        per_rank = count_records(path) // kv.num_workers
        self.count = common.count_batches(per_rank, batch_size, steps)

    def __len__(self):
        return self.count

    def epoch(self, epoch, rank):
        self.iter.reset()
        for _ in range(self.count):
            try:
                batch = self.iter.next()
            except StopIteration:
                self.iter.reset()
                batch = self.iter.next()
            # The iterator hands out pinned memory; the net's weights live on cpu().
            yield batch.data[0].as_in_context(mx.cpu()), batch.label[0].as_in_context(mx.cpu())


def count_records(path):
    """Records in a .rec file: from its .idx beside it (one line each), else by reading it."""
    index = os.path.splitext(path)[0] + '.idx'
    if os.path.exists(index):
        with open(index) as f:
            return sum(1 for _ in f)
    reader, count = mx.recordio.MXRecordIO(path, 'r'), 0
    while reader.read() is not None:
        count += 1
    reader.close()
    return count


def load_data(args, kv):
    if args.rec:
        train = RecordBatches(args.rec, args.batch_size, args.steps, kv, train=True)
        val = (RecordBatches(args.val_rec, args.batch_size, args.steps, kv, train=False)
               if args.val_rec else None)
        return train, val
    train = SyntheticBatches(SYNTHETIC_TRAIN // kv.num_workers, args.batch_size, args.steps,
                             args.classes, args.seed, split=1)
    val = SyntheticBatches(SYNTHETIC_VAL // kv.num_workers, args.batch_size, args.steps,
                           args.classes, args.seed, split=2)
    return train, val


def parse_args():
    p = common.parser(__doc__.splitlines()[0], batch_size=8, lr=None)
    p.add_argument('--rec', help='ImageNet RecordIO training file; default: synthetic data')
    p.add_argument('--val-rec', help='RecordIO validation file (with --rec)')
    p.add_argument('--model', default='resnet50_v1', help='a Gluon model-zoo name')
    p.add_argument('--classes', type=int, default=1000)
    return p.parse_args()


def main():
    args = parse_args()
    kv = common.setup(args)
    if args.lr is None:
        # Goyal et al.'s linear scaling: 0.1 for a global batch of 256.
        args.lr = 0.1 * args.batch_size * kv.num_workers / 256
    train, val = load_data(args, kv)
    common.banner(kv, 'train_imagenet', args, len(train), args.model)
    net = vision.get_model(args.model, classes=args.classes)
    common.init_net(net, kv, (3, IMAGE_SIZE, IMAGE_SIZE))
    common.fit_gluon(net, kv, args, train, val)


if __name__ == '__main__':
    main()
