"""The rest of the store contract: a sub-communicator, and the optimizer in the store
with its states saved and loaded. Expected values are computed with numpy from (rank, size).

usage: kv_contract.py DESIGN
"""
import os
import tempfile

import mxnet as mx
import numpy as np

import mpi_kvstore

from common import RANK, SIZE, WORLD, close, design_arg, done, expect_raises

DESIGN = design_arg()
LR, MOMENTUM = 0.1, 0.9


def check_sub_communicator():
    """comm= spans only its group: even and odd ranks sum separately."""
    color = RANK % 2
    sub = WORLD.Split(color, RANK)
    group = [r for r in range(SIZE) if r % 2 == color]
    with mpi_kvstore.create('dist_mpi', comm=sub, design=DESIGN) as kv:
        assert kv.rank == group.index(RANK) and kv.num_workers == len(group), (kv.rank, group)
        kv.init('g', mx.nd.full((6,), 100 + RANK))        # the group's first rank wins
        out = mx.nd.zeros((6,))
        kv.pull('g', out=out)
        close(out.asnumpy(), 100 + group[0], 'init on a sub-communicator')
        val = mx.nd.full((6,), RANK + 1)
        kv.pushpull('g', val)
        close(val.asnumpy(), sum(r + 1 for r in group), 'pushpull sums over the group only')
    # Leaving the with-block closed the store: it refuses work, clearly.
    expect_raises(mpi_kvstore.MPIKVStoreError, kv.pushpull, 'g', val, contains='closed')
    sub.Free()                                            # the store used its own duplicate


def numpy_momentum_sgd(weight, grads):
    """MXNet's SGD with momentum: mom = m * mom - lr * grad; weight += mom."""
    mom = np.zeros_like(weight)
    for grad in grads:
        mom = MOMENTUM * mom - LR * grad
        weight = weight + mom
    return weight


def grad_of(step):
    """Rank r pushes (r + 1) * (step + 1); the store sees the sum over ranks."""
    return np.full((3, 2), (RANK + 1) * (step + 1), dtype=np.float32)


def push_steps(kv, steps):
    for step in steps:
        kv.push(7, mx.nd.array(grad_of(step)))
    out = mx.nd.zeros((3, 2))
    kv.pull(7, out=out)
    return out.asnumpy()


def optimizer_store():
    kv = mpi_kvstore.create('dist_mpi', design=DESIGN)
    assert kv.is_capable('optimizer') and type(kv).is_capable('optimizer')
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=LR, momentum=MOMENTUM, rescale_grad=1.0))
    kv.init(7, mx.nd.ones((3, 2)))
    return kv


def check_optimizer_and_states(path):
    """The optimizer runs on the summed gradient, the same on every rank; its momentum
    survives save_optimizer_states / load_optimizer_states into a fresh store."""
    summed = [sum((r + 1) * (s + 1) for r in range(SIZE)) * np.ones((3, 2)) for s in range(4)]
    kv = optimizer_store()
    close(push_steps(kv, [0, 1]), numpy_momentum_sgd(np.ones((3, 2)), summed[:2]),
          'weights after two pushes through the optimizer')
    kv.save_optimizer_states(path)
    weights = push_steps(kv, [])
    kv.close()

    fresh = optimizer_store()
    fresh.broadcast(7, mx.nd.array(weights), out=mx.nd.zeros((3, 2)))   # resume the weights
    fresh.load_optimizer_states(path)
    close(push_steps(fresh, [2, 3]), numpy_momentum_sgd(np.ones((3, 2)), summed),
          'weights after resuming from saved optimizer states')
    fresh.close()


def main():
    check_sub_communicator()
    # Each rank its own file: ranks may not share a file system.
    with tempfile.TemporaryDirectory() as tmp:
        check_optimizer_and_states(os.path.join(tmp, 'states.rank%d' % RANK))
    done('kv_contract[%s]' % DESIGN)


main()
