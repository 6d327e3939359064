"""Train a small symbolic conv net with MXNet's Module API through mpi_kvstore.

    mpirun -n 2 python examples/train_module.py --steps 50 --epochs 2

Module.fit does the distributed work itself: it broadcasts rank 0's initial weights
through kv.init, runs the optimizer in the store, and, because kv.type contains
'dist' and '_sync', scales gradients by the global batch (batch_size * num_workers).
--data reads CIFAR-10's python batches from a folder; default: the synthetic set.
"""
import logging
import os
import sys
import time

import mxnet as mx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common

SYNTHETIC_TRAIN, SYNTHETIC_TEST = 10000, 2000


def conv_net(classes=10, width=32):
    """Three conv-BN-ReLU stages (the first two pooled), global pooling, a classifier."""
    x = mx.sym.Variable('data')
    for i, mult in enumerate((1, 2, 4)):
        x = mx.sym.Convolution(x, num_filter=width * mult, kernel=(3, 3), pad=(1, 1),
                               no_bias=True, name='conv%d' % i)
        x = mx.sym.BatchNorm(x, name='bn%d' % i)
        x = mx.sym.Activation(x, act_type='relu', name='relu%d' % i)
        if i < 2:
            x = mx.sym.Pooling(x, kernel=(2, 2), stride=(2, 2), pool_type='max', name='pool%d' % i)
    x = mx.sym.Pooling(x, global_pool=True, kernel=(1, 1), pool_type='avg', name='gap')
    x = mx.sym.FullyConnected(mx.sym.flatten(x), num_hidden=classes, name='fc')
    return mx.sym.SoftmaxOutput(x, name='softmax')


def shard_iter(images, labels, kv, args, train):
    """NDArrayIter over this rank's shard, cut to whole batches (and to --steps)."""
    images, labels = (common.shard(a, kv.rank, kv.num_workers) for a in (images, labels))
    n = common.count_batches(len(labels), args.batch_size, args.steps) * args.batch_size
    data = common.to_float(images[:n], common.CIFAR_MEAN, common.CIFAR_STD)
    return mx.io.NDArrayIter(data, labels[:n].astype('float32'), args.batch_size,
                             shuffle=train, label_name='softmax_label')


class Progress:
    """fit's callbacks: a progress bar, and per epoch a summary of all ranks' metrics.

    fit's own metrics are rank-local; the summary sums them over ranks through the store.
    """

    def __init__(self, kv, args, steps):
        self.kv, self.args, self.steps = kv, args, steps
        self.train_metric = mx.metric.create(['acc', 'ce'])
        self.rate = float('nan')
        self.start_epoch(0)

    def start_epoch(self, epoch):
        self.epoch_start = time.perf_counter()
        self.bar = common.progress(self.kv, self.steps, 'epoch %d/%d' % (epoch + 1,
                                                                         self.args.epochs))
        self.speed = common.Throughput(self.args.batch_size * self.kv.num_workers)

    def batch_end(self, param):
        self.speed.step()
        self.bar.update(1)
        if (param.nbatch + 1) % self.args.log_interval == 0 or param.nbatch + 1 == self.steps:
            self.bar.set_postfix({name: '%.4f' % value
                                 for name, value in param.eval_metric.get_name_value()})

    def epoch_end(self, epoch, symbol, arg_params, aux_params):
        self.rate = self.speed.rate()
        self.bar.close()

    def eval_end(self, param):
        sums = common.global_sum(self.kv, _sums(self.train_metric) + _sums(param.eval_metric))
        acc, ce, val_acc, val_ce = (s / n for s, n in zip(sums[0::2], sums[1::2]))
        common.say(self.kv, 'epoch %d/%d: loss=%.4f acc=%.4f val_loss=%.4f val_acc=%.4f '
                   'images/s=%.1f time=%.1fs' % (param.epoch + 1, self.args.epochs, ce, acc,
                                                 val_ce, val_acc, self.rate,
                                                 time.perf_counter() - self.epoch_start))
        if param.epoch + 1 < self.args.epochs:
            self.start_epoch(param.epoch + 1)


def _sums(composite):
    """[sum, count] per metric of a CompositeEvalMetric, in its order (acc, ce)."""
    out = []
    for metric in composite.metrics:
        out += [metric.sum_metric, metric.num_inst]
    return out


def parse_args():
    p = common.parser(__doc__.splitlines()[0], batch_size=32, lr=0.05)
    p.add_argument('--data', help='folder with CIFAR-10 python batches; default: synthetic')
    p.add_argument('--data-seed', type=int, default=0, help='seed of the synthetic set')
    p.add_argument('--width', type=int, default=32, help='first conv layer channels')
    return p.parse_args()


def main():
    args = parse_args()
    kv = common.setup(args)
    if args.data:
        train_x, train_y, test_x, test_y = common.load_cifar10(args.data)
    else:
        train_x, train_y, test_x, test_y = common.synthetic_dataset(
            SYNTHETIC_TRAIN, SYNTHETIC_TEST, seed=args.data_seed)
    train = shard_iter(train_x, train_y, kv, args, train=True)
    val = shard_iter(test_x, test_y, kv, args, train=False)
    steps = train.num_data // args.batch_size
    common.banner(kv, 'train_module', args, steps, 'conv_net')
    # Module logs rank-local metrics; the Progress summary is the global one.
    quiet = logging.getLogger('train_module.fit')
    quiet.setLevel(logging.WARNING)
    progress = Progress(kv, args, steps)
    mod = mx.mod.Module(conv_net(width=args.width), context=mx.cpu(), logger=quiet)
    mod.fit(train, eval_data=val, eval_metric=progress.train_metric, kvstore=kv,
            optimizer='sgd', optimizer_params={'learning_rate': args.lr,
                                               'momentum': args.momentum, 'wd': args.wd},
            initializer=mx.init.Xavier(rnd_type='gaussian', factor_type='in', magnitude=2),
            num_epoch=args.epochs, validation_metric=mx.metric.create(['acc', 'ce']),
            batch_end_callback=progress.batch_end, epoch_end_callback=progress.epoch_end,
            eval_end_callback=progress.eval_end)
    kv.wait()


if __name__ == '__main__':
    main()
