"""Uneven data: rank r has BASE + r batches, calls kv.join() when it runs out.

Sums cover the shards that exist; weights end identical on every rank and equal
to one process that trains on the shards that exist at each step.

usage: kv_join.py DESIGN MODE   (MODE: direct, trainer, trainer_on_kv, distributed, module)
"""
import sys

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import mpi_kvstore

from common import RANK, SIZE, close, design_arg, done, expect_raises, same_on_all_ranks, summary

DESIGN = design_arg()
MODE = sys.argv[2] if len(sys.argv) > 2 else 'direct'
BASE, PER_RANK = 2, 4
STEPS = BASE + SIZE - 1           # the last rank has the most batches


def has_data(rank, step):
    return step < BASE + rank


def direct(kv):
    """pushpull on keys nobody initialised, single and grouped, and a broadcast."""
    for step in range(STEPS):
        if not has_data(RANK, step):
            break
        one = mx.nd.ones((5,)) * (RANK + 1 + step)
        pair = [mx.nd.ones((3, 2)) * (RANK + 1), mx.nd.arange(4) + RANK]
        kv.pushpull('g', one)
        kv.pushpull(['a', 'b'], pair, priority=-step)
        got = mx.nd.zeros((2,))
        kv.broadcast('bc', mx.nd.ones((2,)) * (RANK + step), out=got, root=SIZE - 1)
        active = [r for r in range(SIZE) if has_data(r, step)]
        close(one.asnumpy(), sum(r + 1 + step for r in active), 'step %d sum' % step)
        close(pair[0].asnumpy(), sum(r + 1 for r in active), 'step %d fused a' % step)
        close(pair[1].asnumpy(), sum(np.arange(4) + r for r in active), 'step %d fused b' % step)
        close(got.asnumpy(), SIZE - 1 + step, 'step %d broadcast from the last rank' % step)
        if RANK == SIZE - 1 and SIZE > 1 and step == STEPS - 1:
            # rank 0 has joined: it cannot send, and cannot mirror a Python collective
            expect_raises(mpi_kvstore.JoinError, lambda: kv.broadcast(
                'bc', mx.nd.ones((2,)), out=mx.nd.zeros((2,)), root=0) or kv.wait(),
                contains='called join()')
            expect_raises(mpi_kvstore.JoinError, mpi_kvstore.broadcast_object, 1, store=kv)
    last = kv.join()
    assert last == SIZE - 1, 'rank %d: join returned %d, expected %d' % (RANK, last, SIZE - 1)
    again = mx.nd.ones((5,)) * (RANK + 1)           # the store goes on after a join
    kv.pushpull('g', again)
    close(again.asnumpy(), SIZE * (SIZE + 1) / 2, 'pushpull after join')
    assert kv.join() == SIZE - 1, 'a join with nothing left returns the highest rank'


def make_net():
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(4, 3, padding=1, in_channels=3, activation='relu'),
            gluon.nn.Flatten(), gluon.nn.Dense(5, in_units=4 * 8 * 8))
    mx.random.seed(42)
    net.initialize(mx.init.Xavier())
    return net


def batch(step, ranks):
    rng = np.random.RandomState(step)
    data = rng.uniform(-1, 1, (PER_RANK * SIZE, 3, 8, 8)).astype(np.float32)
    label = rng.randint(0, 5, (PER_RANK * SIZE,)).astype(np.float32)
    rows = np.concatenate([np.arange(r * PER_RANK, (r + 1) * PER_RANK) for r in ranks])
    return mx.nd.array(data[rows]), mx.nd.array(label[rows])


def train(net, trainer, kv):
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    for step in range(STEPS):
        ranks = [r for r in range(SIZE) if has_data(r, step)] if kv is None else [RANK]
        if kv is not None and not has_data(RANK, step):
            break
        data, label = batch(step, ranks)
        with autograd.record():
            loss = loss_fn(net(data), label)
        loss.backward()
        trainer.step(PER_RANK * SIZE)
    if kv is not None:
        assert kv.join() == SIZE - 1
    return [p.data().asnumpy() for p in net.collect_params().values()]


def gluon_mode(kv):
    opt = ('sgd', {'learning_rate': 0.5, 'momentum': 0.9})
    ref_net = make_net()
    ref = train(ref_net, gluon.Trainer(ref_net.collect_params(), *opt, kvstore=None), None)
    net = make_net()
    if MODE == 'distributed':
        trainer = mpi_kvstore.DistributedTrainer(net.collect_params(), *opt, store=kv)
    else:
        trainer = gluon.Trainer(net.collect_params(), *opt, kvstore=kv,
                                update_on_kvstore=MODE == 'trainer_on_kv')
    return ref, train(net, trainer, kv)


def symbol():
    data = mx.sym.Variable('data')
    net = mx.sym.Convolution(data, num_filter=4, kernel=(3, 3), pad=(1, 1), name='conv')
    net = mx.sym.FullyConnected(mx.sym.Flatten(mx.sym.relu(net)), num_hidden=5, name='fc')
    # label -1 adds nothing to the gradient: the reference's stand-in for a missing shard
    return mx.sym.SoftmaxOutput(net, name='softmax', use_ignore=True, ignore_label=-1)


def module_data(reference):
    datas, labels = [], []
    for step in range(STEPS):
        for r in (range(SIZE) if reference else [RANK]):
            if not reference and not has_data(r, step):
                continue
            data, label = batch(step, [r])
            if not has_data(r, step):
                label = label * 0 - 1
            datas.append(data.asnumpy())
            labels.append(label.asnumpy())
    return np.concatenate(datas), np.concatenate(labels)


def module_mode(kv):
    def fit(batch_size, store, callback=None):
        data, label = module_data(store is None)
        mod = mx.mod.Module(symbol(), context=mx.cpu())
        mx.random.seed(5)
        mod.fit(mx.io.NDArrayIter(data, label, batch_size=batch_size), num_epoch=2,
                kvstore=store, optimizer='sgd', initializer=mx.init.Xavier(),
                optimizer_params={'learning_rate': 0.2, 'momentum': 0.9},
                epoch_end_callback=callback)
        return [v.asnumpy() for _, v in sorted(mod.get_params()[0].items())]

    lasts = []
    got = fit(PER_RANK, kv, lambda *args: lasts.append(kv.join()))
    assert lasts == [SIZE - 1] * 2, lasts
    return fit(PER_RANK * SIZE, None), got


def main():
    kv = mpi_kvstore.create('dist_mpi', design=DESIGN)
    reference = []      # the one-process run's parameters, [shape, sum] each
    if MODE == 'direct':
        direct(kv)
    else:
        ref, got = (module_mode if MODE == 'module' else gluon_mode)(kv)
        reference = [summary(want) for want in ref]
        for i, (want, have) in enumerate(zip(ref, got)):
            same_on_all_ranks(have, 'parameter %d after join' % i)
            close(have, want, 'parameter %d vs one process' % i, rtol=1e-4, atol=1e-5)
    kv.wait()
    done('kv_join[%s, %s]' % (DESIGN, MODE), reference=reference)


main()
