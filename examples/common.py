"""What the examples share: arguments, data shards, the Gluon loop, progress and metrics.

Every rank runs the same code. Rank r reads a contiguous 1/size slice of the data,
all ranks the same number of batches (collectives must match one for one), and only
rank 0 prints. The store SUMS gradients over ranks, so the Gluon loop normalises by
the global batch (batch_size * num_workers).
"""
import argparse
import logging
import os
import pickle
import time

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import mpi_kvstore

# Every rank's libmxnet would announce its MKLDNN graph pass; only rank 0 should talk.
os.environ.setdefault('MXNET_SUBGRAPH_VERBOSE', '0')

CIFAR_MEAN = np.array([0.4914, 0.4822, 0.4465], np.float32).reshape(1, 3, 1, 1)
CIFAR_STD = np.array([0.2470, 0.2435, 0.2616], np.float32).reshape(1, 3, 1, 1)
IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], np.float32).reshape(1, 3, 1, 1)
IMAGENET_STD = np.array([0.229, 0.224, 0.225], np.float32).reshape(1, 3, 1, 1)


# -- arguments and setup --------------------------------------------------------------
def parser(description, batch_size, lr, epochs=1):
    """The flags every example takes; each script adds its own."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument('--design', default='auto', choices=mpi_kvstore.DESIGNS + ('auto',),
                   help='mpi_kvstore scheduling design (default: %(default)s)')
    p.add_argument('--steps', type=int, default=0,
                   help='max steps per epoch, also caps evaluation batches; 0 = full epoch')
    p.add_argument('--epochs', type=int, default=epochs)
    p.add_argument('--batch-size', type=int, default=batch_size, help='per rank')
    p.add_argument('--lr', type=float, default=lr)
    p.add_argument('--momentum', type=float, default=0.9)
    p.add_argument('--wd', type=float, default=1e-4)
    p.add_argument('--seed', type=int, default=42,
                   help='model init seed (the same on every rank)')
    p.add_argument('--log-interval', type=int, default=10,
                   help='steps between progress-bar metric updates')
    return p


def setup(args):
    """Create the store, seed every rank alike, quiet every rank but 0."""
    kv = mpi_kvstore.create('dist_mpi', design=args.design)
    logging.basicConfig(level=logging.INFO if kv.rank == 0 else logging.WARNING,
                        format='%(message)s')
    # The same seed everywhere gives the same initial weights; the data differs by shard.
    mx.random.seed(args.seed)
    np.random.seed(args.seed)
    return kv


def say(kv, message):
    if kv.rank == 0:
        print(message, flush=True)


def banner(kv, name, args, steps, model):
    say(kv, '%s: %d rank(s), design %s, model %s, batch %d per rank (%d global), '
        '%d steps/epoch, %d epoch(s)' % (name, kv.num_workers, args.design, model,
                                         args.batch_size, args.batch_size * kv.num_workers,
                                         steps, args.epochs))


# -- data -------------------------------------------------------------------------------
def shard(array, rank, size):
    """Rank's contiguous slice; every rank gets len // size items (the rest is dropped)."""
    per = len(array) // size
    return array[rank * per:(rank + 1) * per]


def count_batches(n, batch_size, steps):
    count = n // batch_size
    return min(count, steps) if steps > 0 else count


def load_cifar10(folder):
    """CIFAR-10 python batches -> (train_x, train_y, test_x, test_y), uint8 NCHW images."""
    def load(names):
        xs, ys = [], []
        for name in names:
            with open(os.path.join(folder, name), 'rb') as f:
                batch = pickle.load(f, encoding='bytes')
            xs.append(np.asarray(batch[b'data'], np.uint8).reshape(-1, 3, 32, 32))
            ys.append(np.asarray(batch[b'labels'], np.int64))
        return np.concatenate(xs), np.concatenate(ys)
    train = load(['data_batch_%d' % i for i in range(1, 6)])
    return train + load(['test_batch'])


def class_templates(classes, seed, grid=4):
    """One coarse colour pattern per class; seeded, so every rank draws the same classes."""
    return np.random.default_rng(seed).uniform(-1, 1, (classes, 3, grid, grid)).astype(np.float32)


def render(templates, labels, size, rng, noise=1.0):
    """uint8 NCHW images: the label's pattern, upsampled, with contrast, brightness, noise.

    Per pixel the noise is as strong as the pattern, so a net has to pool to see the class.
    """
    scale = size // templates.shape[-1]
    base = templates[labels].repeat(scale, axis=2).repeat(scale, axis=3)
    n = len(labels)
    contrast = rng.uniform(0.6, 1.4, (n, 1, 1, 1)).astype(np.float32)
    brightness = rng.uniform(-0.3, 0.3, (n, 1, 1, 1)).astype(np.float32)
    pixels = base * contrast + brightness + noise * rng.standard_normal(base.shape, np.float32)
    return np.clip(127.5 + 60 * pixels, 0, 255).astype(np.uint8)


def synthetic_dataset(n_train, n_test, classes=10, size=32, seed=0):
    """A learnable stand-in for CIFAR-10: the same data set on every rank, for any size."""
    templates = class_templates(classes, seed)
    out = []
    for split, n in ((1, n_train), (2, n_test)):
        rng = np.random.default_rng([seed, split])
        labels = rng.integers(0, classes, n)
        out += [render(templates, labels, size, rng), labels]
    return tuple(out)


def to_float(images, mean, std):
    return (images.astype(np.float32) / 255 - mean) / std


class ArrayBatches:
    """One rank's batches over in-memory uint8 images, reshuffled every epoch."""

    def __init__(self, images, labels, batch_size, steps, seed, mean, std, augment=False):
        self.images, self.labels, self.batch_size = images, labels, batch_size
        self.mean, self.std, self.augment, self.seed = mean, std, augment, seed
        self.count = count_batches(len(labels), batch_size, steps)

    def __len__(self):
        return self.count

    def epoch(self, epoch, rank):
        rng = np.random.default_rng([self.seed, rank, epoch])
        order = rng.permutation(len(self.labels))
        for i in range(self.count):
            idx = np.sort(order[i * self.batch_size:(i + 1) * self.batch_size])
            x = to_float(self.images[idx], self.mean, self.std)
            if self.augment:
                flip = rng.random(len(idx)) < 0.5
                x[flip] = x[flip, :, :, ::-1]
            yield mx.nd.array(x), mx.nd.array(self.labels[idx], dtype=np.float32)


# -- metrics and progress -------------------------------------------------------------------
class Meter:
    """Loss and accuracy sums kept as NDArrays, so updating them never blocks the loop."""

    def __init__(self):
        self.loss, self.correct, self.count = mx.nd.zeros(1), mx.nd.zeros(1), 0

    def update(self, loss, output, label):
        self.loss += loss.sum()
        self.correct += (output.argmax(axis=1) == label).sum()
        self.count += label.shape[0]

    def totals(self):
        return [self.loss.asscalar(), self.correct.asscalar(), self.count]

    def postfix(self):
        loss, correct, count = self.totals()
        return {'loss': '%.4f' % (loss / max(count, 1)), 'acc': '%.3f' % (correct / max(count, 1))}


def global_sum(kv, values):
    """Sum a few numbers over ranks, in collective order on the store's own communicator."""
    local = np.asarray(values, np.float64)
    return np.asarray(kv.collectives.run(lambda comm: comm.allreduce(local), name='metrics'))


class Throughput:
    """Global images/s over one epoch, with waitall so queued engine work is counted.

    The first step is left out (graph building, MKLDNN primitives, the store's first
    collectives) unless it is the only one.
    """

    def __init__(self, images_per_step):
        mx.nd.waitall()
        self.images_per_step, self.steps = images_per_step, 0
        self.start = self.after_first = time.perf_counter()

    def step(self):
        self.steps += 1
        if self.steps == 1:
            mx.nd.waitall()
            self.after_first = time.perf_counter()

    def rate(self):
        mx.nd.waitall()
        now = time.perf_counter()
        if self.steps > 1:
            return (self.steps - 1) * self.images_per_step / (now - self.after_first)
        if self.steps == 1:
            return self.images_per_step / (now - self.start)
        return float('nan')


class _PlainProgress:
    """What rank 0 shows when tqdm is not installed: one line per metrics update."""

    def __init__(self, total, desc):
        self.total, self.desc, self.done = total, desc, 0

    def update(self, n=1):
        self.done += n

    def set_postfix(self, info):
        extra = ' '.join('%s=%s' % item for item in info.items())
        print('%s: step %d/%d %s' % (self.desc, self.done, self.total, extra), flush=True)

    def close(self):
        pass


class _NoProgress(_PlainProgress):
    def set_postfix(self, info):
        pass


def progress(kv, total, desc):
    """Rank 0's bar; its running loss and accuracy are rank 0's own (the summary is global)."""
    if kv.rank != 0:
        return _NoProgress(total, desc)
    try:
        from tqdm import tqdm
    except ImportError:
        return _PlainProgress(total, desc)
    return tqdm(total=total, desc=desc, unit='step', leave=False)


def report(kv, epoch, epochs, train, val, rate, seconds):
    """Rank 0 prints the epoch's metrics summed over all ranks."""
    sums = global_sum(kv, train.totals() + (val.totals() if val else []))
    parts = ['loss=%.4f' % (sums[0] / sums[2]), 'acc=%.4f' % (sums[1] / sums[2])]
    if val:
        parts += ['val_loss=%.4f' % (sums[3] / sums[5]), 'val_acc=%.4f' % (sums[4] / sums[5])]
    parts += ['images/s=%.1f' % rate, 'time=%.1fs' % seconds]
    say(kv, 'epoch %d/%d: %s' % (epoch + 1, epochs, ' '.join(parts)))


# -- the Gluon loop -----------------------------------------------------------------------------
def init_net(net, kv, sample_shape):
    """Initialise every parameter now, with rank 0's values on every rank.

    The Trainer would broadcast only inside its first step(), after a forward already
    ran on each rank's own initial weights. broadcast_parameters comes before the first
    forward: it broadcasts each deferred parameter as soon as its data exists, while the
    data is still in MXNet's default layout (an inference forward may leave conv
    weights in an MKLDNN layout, which in-place collectives cannot read).
    """
    net.initialize(mx.init.Xavier(rnd_type='gaussian', factor_type='in', magnitude=2))
    mpi_kvstore.broadcast_parameters(net.collect_params(), store=kv)
    net(mx.nd.zeros((1,) + tuple(sample_shape)))  # ends deferred init, the same on every rank
    # Not static_alloc: in MXNet 1.9.1 a static CachedOp writes BatchNorm's running
    # statistics without ordering later engine reads after them, so the Trainer's
    # first-step broadcast of those statistics would race with the backward pass.
    net.hybridize()


def make_trainer(net, kv, args):
    return gluon.Trainer(net.collect_params(), 'sgd',
                         {'learning_rate': args.lr, 'momentum': args.momentum, 'wd': args.wd},
                         kvstore=kv)


def train_epoch(net, trainer, batches, kv, epoch, args):
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    meter, speed = Meter(), Throughput(batches.batch_size * kv.num_workers)
    bar = progress(kv, len(batches), 'epoch %d/%d' % (epoch + 1, args.epochs))
    previous = None
    for step, (x, y) in enumerate(batches.epoch(epoch, kv.rank)):
        with autograd.record():
            out = net(x)
            loss = loss_fn(out, y)
        loss.backward()
        # The store sums gradients over ranks: normalise by the global batch.
        trainer.step(batches.batch_size * kv.num_workers)
        meter.update(loss, out, y)
        # At most one step in flight, so Python cannot queue a whole epoch into the engine.
        if previous is not None:
            previous.wait_to_read()
        previous = loss
        speed.step()
        bar.update(1)
        if (step + 1) % args.log_interval == 0 or step + 1 == len(batches):
            bar.set_postfix(meter.postfix())
    rate = speed.rate()
    bar.close()
    return meter, rate


def evaluate(net, batches, kv, epoch):
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    meter = Meter()
    for x, y in batches.epoch(epoch, kv.rank):
        out = net(x)
        meter.update(loss_fn(out, y), out, y)
    return meter


def fit_gluon(net, kv, args, train, val=None):
    """Train for args.epochs; rank 0 prints one summary line per epoch."""
    trainer = make_trainer(net, kv, args)
    for epoch in range(args.epochs):
        start = time.perf_counter()
        train_meter, rate = train_epoch(net, trainer, train, kv, epoch, args)
        val_meter = evaluate(net, val, kv, epoch) if val is not None else None
        report(kv, epoch, args.epochs, train_meter, val_meter, rate,
               time.perf_counter() - start)
    kv.wait()
