"""Train a CIFAR-10 ResNet with Gluon across MPI ranks through mpi_kvstore.

    mpirun -n 2 python examples/train_cifar10.py --steps 100 --epochs 1
    mpirun -n 4 python examples/train_cifar10.py --data ~/cifar-10-batches-py --epochs 30

--data names a folder holding CIFAR-10's python batches (data_batch_1..5, test_batch);
without it the example trains on an embedded synthetic set of ten learnable classes,
so it runs anywhere and never downloads anything.
"""
import os
import sys

from mxnet.gluon.model_zoo import vision

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common
from cifar_resnet import resnet20

ZOO_MODELS = ('resnet18_v1', 'resnet34_v1', 'resnet18_v2', 'resnet34_v2')
SYNTHETIC_TRAIN, SYNTHETIC_TEST = 10000, 2000


def build_model(args):
    if args.model == 'resnet20':
        return resnet20(width=args.width)
    # thumbnail: a 3x3 stem without max-pooling, for 32x32 inputs.
    return vision.get_model(args.model, classes=10, thumbnail=True)


def load_data(args, kv):
    """This rank's train and test batches: real CIFAR-10 from --data, else synthetic."""
    if args.data:
        train_x, train_y, test_x, test_y = common.load_cifar10(args.data)
    else:
        train_x, train_y, test_x, test_y = common.synthetic_dataset(
            SYNTHETIC_TRAIN, SYNTHETIC_TEST, seed=args.data_seed)
    rank, size = kv.rank, kv.num_workers
    shard = [common.shard(a, rank, size) for a in (train_x, train_y, test_x, test_y)]
    stats = common.CIFAR_MEAN, common.CIFAR_STD
    train = common.ArrayBatches(shard[0], shard[1], args.batch_size, args.steps,
                                args.seed, *stats, augment=bool(args.data))
    test = common.ArrayBatches(shard[2], shard[3], args.batch_size, args.steps,
                               args.seed, *stats)
    return train, test


def parse_args():
    p = common.parser(__doc__.splitlines()[0], batch_size=32, lr=0.1)
    p.add_argument('--data', help='folder with CIFAR-10 python batches; default: synthetic')
    p.add_argument('--data-seed', type=int, default=0, help='seed of the synthetic set')
    p.add_argument('--model', default='resnet20', choices=('resnet20',) + ZOO_MODELS)
    p.add_argument('--width', type=int, default=16, help='resnet20 first-stage channels')
    return p.parse_args()


def main():
    args = parse_args()
    kv = common.setup(args)
    train, test = load_data(args, kv)
    common.banner(kv, 'train_cifar10', args, len(train), args.model)
    net = build_model(args)
    common.init_net(net, kv, (3, 32, 32))
    common.fit_gluon(net, kv, args, train, test)


if __name__ == '__main__':
    main()
