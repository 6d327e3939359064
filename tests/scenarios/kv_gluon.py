"""Gluon training of a small convolutional net through the store.

Each rank trains on its shard of a global batch; the parameters must be equal
on every rank and equal (float32 tolerance) to one process trained on the
whole batch without any store. Convolutions run through MKLDNN on the CPU wheel.

usage: kv_gluon.py DESIGN
"""
import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import mpi_kvstore

from common import (
    RANK,
    SIZE,
    check_state_shares,
    close,
    design_arg,
    done,
    same_on_all_ranks,
    summary,
)

DESIGN = design_arg()
PER_RANK, STEPS = 4, 4


def make_net():
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(8, 3, padding=1, in_channels=3, activation='relu'),
            gluon.nn.MaxPool2D(2),
            gluon.nn.Conv2D(16, 3, padding=1, in_channels=8, activation='relu'),
            gluon.nn.Flatten(),
            gluon.nn.Dense(10, in_units=16 * 8 * 8))
    mx.random.seed(1234)
    net.initialize(mx.init.Xavier())
    return net


def global_batch(step):
    rng = np.random.RandomState(100 + step)
    data = rng.uniform(-1, 1, size=(PER_RANK * SIZE, 3, 16, 16)).astype(np.float32)
    label = rng.randint(0, 10, size=(PER_RANK * SIZE,)).astype(np.float32)
    return mx.nd.array(data), mx.nd.array(label)


def train(net, trainer, shard):
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    for step in range(STEPS):
        data, label = global_batch(step)
        if shard:
            data = data[RANK * PER_RANK:(RANK + 1) * PER_RANK]
            label = label[RANK * PER_RANK:(RANK + 1) * PER_RANK]
        with autograd.record():
            loss = loss_fn(net(data), label)
        loss.backward()
        trainer.step(PER_RANK * SIZE)        # sums over ranks: divide by the global batch
    # Names differ between net instances (conv0_, conv2_...); their order does not.
    return [p.data().asnumpy() for p in net.collect_params().values()]


def reference():
    net = make_net()
    trainer = gluon.Trainer(net.collect_params(), 'sgd',
                            {'learning_rate': 0.5, 'momentum': 0.9, 'wd': 1e-4}, kvstore=None)
    return train(net, trainer, shard=False)


def distributed(update_on_kvstore):
    net = make_net()
    # Rank-dependent weights: the store's initial broadcast must fix them.
    for p in net.collect_params().values():
        p.set_data(p.data() + RANK)
    kv = mpi_kvstore.create('dist_mpi', design=DESIGN, fusion_threshold=64 << 10)
    mpi_kvstore.broadcast_parameters(net.collect_params(), store=kv)
    trainer = gluon.Trainer(net.collect_params(), 'sgd',
                            {'learning_rate': 0.5, 'momentum': 0.9, 'wd': 1e-4}, kvstore=kv,
                            update_on_kvstore=update_on_kvstore)
    params = train(net, trainer, shard=True)
    assert trainer._update_on_kvstore == update_on_kvstore
    kv.wait()
    if update_on_kvstore:
        assert check_state_shares(kv) == len(params), 'one optimizer state a parameter'

    return params


def main():
    ref = reference()
    for update_on_kvstore in (False, True):
        params = distributed(update_on_kvstore)
        for i, value in enumerate(params):
            what = 'parameter %d (update_on_kvstore=%s)' % (i, update_on_kvstore)
            same_on_all_ranks(value, what)
            close(value, ref[i], what + ' vs single process', rtol=1e-4, atol=1e-5)
    done('kv_gluon[%s]' % DESIGN, reference=[summary(value) for value in ref])


main()
