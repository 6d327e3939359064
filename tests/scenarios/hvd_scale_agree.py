"""Horovod's gradient_predivide_factor folded into the reduction, and scale factors that
ranks must agree on as given (horovod.ops._fold, comm.collective.factor_sig), on every design.

usage: hvd_scale_agree.py DESIGN

1. hvd.DistributedTrainer with gradient_predivide_factor 4 (num_groups 0) and 3 (num_groups
   2), uncompressed float32: the weights after 3 steps equal one plain gluon.Trainer's on
   every rank's batch together, with no engine op of its own for the factor (debug counter
   hvd 'scale_op'); with Compression.fp16 the prescale stays an op a gradient a step (it
   guards the float16 sum), and the weights are still right.
2. hvd.DistributedOptimizer with gradient_predivide_factor 3: updates of one index and of a
   list of indices (the updater's aggregated call), float32 and float16 weights, equal plain
   SGD on the mean gradient in numpy; 'scale_op' 0 for float32, one a float16 gradient.
3. Ranks that split one product differently, (prescale, postscale) (2, 1) on rank 0 and
   (1, 2) on the others, and ranks that give an int32 tensor different prescales (2 and 3),
   fail with RankMismatchError on every rank, by hvd.allreduce_, hvd.allreduce and
   hvd.grouped_allreduce_ (of one tensor), naming both ranks' factors; the name sums right
   after.
"""
import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import mpi_kvstore
import mpi_kvstore.horovod as hvd
from mpi_kvstore import debug

from common import RANK, SIZE, close, design_arg, done, expect_raises, same_on_all_ranks

DESIGN = design_arg()
hvd.init(design=DESIGN, autotune='0')
store = hvd.global_process_set._store

LOCAL, STEPS = 4, 3
rng = np.random.RandomState(11)
X = rng.uniform(-1, 1, size=(STEPS, SIZE * LOCAL, 6)).astype('float32')
Y = rng.randint(0, 3, size=(STEPS, SIZE * LOCAL)).astype('float32')
OPT = {'learning_rate': 0.5, 'momentum': 0.9, 'wd': 1e-3}


def scale_ops(fn, *args, **kwargs):
    """The engine ops of their own that scaled something (debug 'hvd': 'scale_op') while
    fn ran, once the store is idle."""
    before = debug.snapshot()
    fn(*args, **kwargs)
    store.wait()
    return debug.since(before, 'hvd').get('scale_op', 0)


def mine(batch):
    return batch[RANK * LOCAL:(RANK + 1) * LOCAL]


def make_net(start=None):
    mx.random.seed(3)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(5, activation='tanh', in_units=6), gluon.nn.Dense(3, in_units=5))
    net.initialize(mx.init.Xavier())
    if start is not None:
        for (_, p), value in zip(sorted(net.collect_params().items()), start):
            p.set_data(mx.nd.array(value))
    return net


def values(net):
    return [p.data().asnumpy() for _, p in sorted(net.collect_params().items())]


def train(net, trainer, rows, batch_size):
    """STEPS steps; the scale ops they made."""
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    ops = 0
    for step in range(STEPS):
        with autograd.record():
            loss = loss_fn(net(mx.nd.array(rows(X[step]))), mx.nd.array(rows(Y[step])))
        loss.backward()
        ops += scale_ops(trainer.step, batch_size)
    return ops


def trainers():
    """Per case [scale ops of the 3 steps, gradients a step, what rescale_grad holds]."""
    found = []
    for compression, predivide, groups, tol in ((hvd.Compression.none, 4.0, 0, 1e-5),
                                                (hvd.Compression.none, 3.0, 2, 1e-5),
                                                (hvd.Compression.fp16, 2.0, 0, 2e-2)):
        start = values(make_net())
        net = make_net(start)
        trainer = hvd.DistributedTrainer(net.collect_params(), 'sgd', OPT, compression,
                                         predivide, 'p%d.%s' % (groups, compression.name),
                                         groups)
        ops = train(net, trainer, mine, LOCAL)
        ref = make_net(start)
        train(ref, gluon.Trainer(ref.collect_params(), 'sgd', OPT, kvstore=None),
              lambda batch: batch, SIZE * LOCAL)
        what = 'trainer %s predivide=%g num_groups=%d' % (compression.name, predivide, groups)
        for i, (got, want) in enumerate(zip(values(net), values(ref))):
            same_on_all_ranks(got, '%s %d' % (what, i))
            close(got, want, '%s %d' % (what, i), rtol=tol, atol=tol)
        # rescale_grad times the whole batch: 1 where the factor cancelled, else predivide
        found.append([ops, len(start), trainer._optimizer.rescale_grad * LOCAL * SIZE])
    return found


def grad_of(rank, index, step, dtype):
    return ((rank + 1) * np.linspace(-1, 1, 12) + index - step).astype(dtype)


def optimizer():
    """DistributedOptimizer(SGD, predivide 3): [scale ops of float32 updates, of float16
    updates]; weights checked against plain SGD on the mean gradient."""
    opt = hvd.DistributedOptimizer(mx.optimizer.SGD(learning_rate=0.5, rescale_grad=1.0),
                                   gradient_predivide_factor=3.0)
    updater = mx.optimizer.get_updater(opt)
    dtypes = ('float32', 'float32', 'float32', 'float16')
    weights = [mx.nd.ones((12,), dtype=d) for d in dtypes]
    want = [np.ones(12) for _ in dtypes]
    ops = {'float32': 0, 'float16': 0}
    for step in range(STEPS):
        grads = [mx.nd.array(grad_of(RANK, i, step, d), dtype=d) for i, d in enumerate(dtypes)]
        # indices 0-1 aggregated (a list, as the updater passes them), 2 and 3 alone
        ops['float32'] += scale_ops(updater, [0, 1], grads[:2], weights[:2])
        ops['float32'] += scale_ops(updater, 2, grads[2], weights[2])
        ops['float16'] += scale_ops(updater, 3, grads[3], weights[3])
        for i, d in enumerate(dtypes):
            mean = np.mean([grad_of(r, i, step, d).astype(np.float64) for r in range(SIZE)],
                           axis=0)
            want[i] = want[i] - 0.5 * mean
            tol = 1e-2 if d == 'float16' else 1e-5
            close(weights[i].asnumpy(), want[i], 'optimizer %d step %d' % (i, step),
                  rtol=tol, atol=tol)
    return [ops['float32'], ops['float16']]


def call_and_wait(call, xs, split):
    call(xs, *split)
    store.wait()


def mismatches():
    """Per way of calling: the RankMismatchError's message; the name right after."""
    said = {}
    ways = {
        'split allreduce_': lambda xs, pre, post: [hvd.allreduce_(
            xs[0], name='s', op=hvd.Sum, prescale_factor=pre, postscale_factor=post)],
        'split allreduce': lambda xs, pre, post: [hvd.allreduce(
            xs[0], name='c', op=hvd.Sum, prescale_factor=pre, postscale_factor=post)],
        'split grouped': lambda xs, pre, post: hvd.grouped_allreduce_(
            xs, name='g', op=hvd.Sum, prescale_factor=pre, postscale_factor=post),
    }
    for what, call in ways.items():
        # grouped: one tensor. A grouped call of two that mismatches leaves the chained
        # design's ranks out of step after it (as on main before the factors' split)
        xs = [mx.nd.ones((16,))]
        for _ in range(2):   # prepared under the rank's own split before it meets the other's
            call(xs, 1.0, 2.0)
            for x in xs:
                x[:] = 1.0
        store.wait()
        split = (2.0, 1.0) if RANK == 0 else (1.0, 2.0)

        # a synchronous design (blocking) raises in the call itself
        said[what] = str(expect_raises(mpi_kvstore.RankMismatchError, call_and_wait,
                                       call, xs, split))
        for step in range(2):
            for x in xs:
                x[:] = RANK + step
            outs = call(xs, 1.0, 2.0)
            for i, out in enumerate(outs):
                close(out.asnumpy(), 2.0 * sum(r + step for r in range(SIZE)),
                      '%s %d after the mismatch %d' % (what, i, step))
    x = mx.nd.ones((16,), dtype='int32')
    for _ in range(2):
        hvd.allreduce_(x, name='i', op=hvd.Sum, prescale_factor=2.0)
        x[:] = 1
    store.wait()

    def int_prescale():
        hvd.allreduce_(x, name='i', op=hvd.Sum, prescale_factor=2.0 if RANK == 0 else 3.0)
        store.wait()
    said['int prescale'] = str(expect_raises(mpi_kvstore.RankMismatchError, int_prescale))
    for step in range(2):
        x[:] = RANK + step
        hvd.allreduce_(x, name='i', op=hvd.Sum, prescale_factor=2.0)
        close(x.asnumpy(), 2.0 * sum(r + step for r in range(SIZE)),
              'int prescale after the mismatch %d' % step)
    return said


done('hvd_scale_agree[%s]' % DESIGN, trainers=trainers(), optimizer=optimizer(),
     mismatch=mismatches())
hvd.shutdown()
