"""Horovod-style helpers: collectives on arrays and objects, broadcast_parameters
(also after an inference forward, and for deferred initialisation), DistributedTrainer.

usage: kv_helpers.py DESIGN
"""
import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import mpi_kvstore

from common import RANK, SIZE, close, design_arg, done, expect_raises, same_on_all_ranks

kv = mpi_kvstore.create('dist_mpi', design=design_arg())
RANKSUM = SIZE * (SIZE + 1) / 2


def check_array_collectives():
    x = mx.nd.full((5, 3), RANK + 1)
    close(mpi_kvstore.allreduce(x, store=kv).asnumpy(), RANKSUM, 'allreduce')
    close(x.asnumpy(), RANK + 1, 'allreduce leaves its input')
    close(mpi_kvstore.allreduce(x, average=True, store=kv).asnumpy(), RANKSUM / SIZE, 'mean')
    mpi_kvstore.allreduce_(x, store=kv)
    close(x.asnumpy(), RANKSUM, 'allreduce_ in place')
    y = mx.nd.full((4,), 10 * RANK, dtype='int32')
    close(mpi_kvstore.broadcast(y, root=SIZE - 1, store=kv).asnumpy(), 10 * (SIZE - 1), 'bcast')
    parts = mx.nd.full((RANK + 1, 2), RANK)             # first dimension differs per rank
    gathered = mpi_kvstore.allgather(parts, store=kv).asnumpy()
    expected = np.concatenate([np.full((r + 1, 2), r) for r in range(SIZE)])
    close(gathered, expected, 'allgather')
    # alike shapes: the engine op (MPI_Allgatherv of whole rows)
    rows = np.arange(3 * 4, dtype=np.float32).reshape(3, 4) + 100 * RANK
    gathered = mpi_kvstore.allgather(mx.nd.array(rows), store=kv).asnumpy()
    close(gathered, np.concatenate([rows - 100 * RANK + 100 * r for r in range(SIZE)]),
          'allgather of alike shapes')
    # reducescatter: numpy's sum, cut along axis 0 by array_split (uneven: 2 * SIZE + 1 rows)
    def tensor_of(r):
        return np.cos(np.arange((2 * SIZE + 1) * 3) + r).reshape(2 * SIZE + 1, 3)
    total = sum(tensor_of(r) for r in range(SIZE))
    mine = np.array_split(total, SIZE)[RANK]
    part = mpi_kvstore.reducescatter(mx.nd.array(tensor_of(RANK)), store=kv)
    assert part.shape == mine.shape, (part.shape, mine.shape)
    close(part.asnumpy(), mine, 'reducescatter')
    close(mpi_kvstore.reducescatter(mx.nd.array(tensor_of(RANK)), average=True,
                                    store=kv).asnumpy(), mine / SIZE, 'reducescatter mean')
    if SIZE > 1:   # MXNet's legacy shapes read a 0 as unknown: no (0, 2) array at one rank
        expect_raises(ValueError, mpi_kvstore.reducescatter, mx.nd.ones((SIZE - 1, 2)),
                      store=kv, contains='at least one row a rank')


def check_objects():
    got = mpi_kvstore.broadcast_object({'rank': RANK, 'list': [1, 2]}, root=0, store=kv)
    assert got == {'rank': 0, 'list': [1, 2]}, got
    assert mpi_kvstore.allgather_object(RANK * 3, store=kv) == [r * 3 for r in range(SIZE)]
    assert mpi_kvstore.rank() == RANK and mpi_kvstore.size() == SIZE
    assert 0 <= mpi_kvstore.local_rank() < mpi_kvstore.local_size() <= SIZE


def check_sub_communicator():
    """A store on half the ranks: rank() and size() are its communicator's, and the helpers
    sum over its ranks only."""
    from mpi4py import MPI
    sub = MPI.COMM_WORLD.Split(RANK % 2, RANK)
    half = mpi_kvstore.create('dist_mpi', comm=sub, design=design_arg())
    assert mpi_kvstore.rank(half) == sub.Get_rank(), (mpi_kvstore.rank(half), sub.Get_rank())
    assert mpi_kvstore.size(half) == sub.Get_size()
    x = mx.nd.full((3,), RANK + 1)
    mpi_kvstore.allreduce_(x, store=half)
    close(x.asnumpy(), sum(r + 1 for r in range(SIZE) if r % 2 == RANK % 2), 'sub-store sum')
    expect_raises(ValueError, mpi_kvstore.broadcast_, x, root=sub.Get_size(), store=half,
                  contains='root must be a rank of this %d-process store' % sub.Get_size())
    half.close()
    sub.Free()


def conv_net():
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(8, 3, in_channels=3), gluon.nn.Flatten(),
            gluon.nn.Dense(4, in_units=8 * 6 * 6))
    return net


def check_broadcast_after_inference_forward():
    """An inference forward leaves conv weights in an MKLDNN layout."""
    mx.random.seed(RANK)
    net = conv_net()
    net.initialize()
    net(mx.nd.zeros((1, 3, 8, 8)))
    mpi_kvstore.broadcast_parameters(net.collect_params(), store=kv)
    kv.wait()
    for name, p in net.collect_params().items():
        same_on_all_ranks(p.data().asnumpy(), name + ' after inference forward')


def check_deferred_initialisation():
    """Shapes unknown until the first forward: broadcast before that forward uses them."""
    mx.random.seed(100 + RANK)
    net = gluon.nn.Dense(3)                  # in_units deferred
    net.initialize()
    mpi_kvstore.broadcast_parameters(net.collect_params(), store=kv)
    out = net(mx.nd.ones((2, 5))).asnumpy()  # same input everywhere: same output iff same weights
    same_on_all_ranks(out, 'first forward output of a deferred layer')
    same_on_all_ranks(net.weight.data().asnumpy(), 'deferred weight')


def check_distributed_trainer(group_bytes):
    """Training with DistributedTrainer equals one process training on every rank's batch
    (sums differ only in their order of addition). group_bytes: the default (one group
    for this small net), 256 (a group per gradient, pushed last layer first), 0 (one)."""
    mx.random.seed(RANK)                      # different starts: the trainer must broadcast
    net = conv_net()
    net.initialize()
    trainer = mpi_kvstore.DistributedTrainer(net.collect_params(), 'sgd',
                                             {'learning_rate': 0.1}, store=kv,
                                             **({} if group_bytes is None else
                                                {'group_bytes': group_bytes}))
    start = [p.data().asnumpy() for p in net.collect_params().values()]
    reference = conv_net()
    reference.initialize()
    for p, value in zip(reference.collect_params().values(), start):
        p.set_data(mx.nd.array(value))
    alone = gluon.Trainer(reference.collect_params(), 'sgd', {'learning_rate': 0.1},
                          kvstore=None)
    loss_fn = gluon.loss.L2Loss()
    for step in range(3):
        data = mx.nd.full((2, 3, 8, 8), RANK + step)
        with autograd.record():
            loss = loss_fn(net(data), mx.nd.zeros((2, 4)))
        loss.backward()
        trainer.step(2 * SIZE)
        every = mx.nd.concat(*[mx.nd.full((2, 3, 8, 8), r + step) for r in range(SIZE)], dim=0)
        with autograd.record():
            loss = loss_fn(reference(every), mx.nd.zeros((2 * SIZE, 4)))
        loss.backward()
        alone.step(2 * SIZE)
    # the store's batched updater ran every step after the first (which makes the states)
    assert trainer._updaters[0].planned == 2, trainer._updaters[0].planned
    for (name, p), q in zip(net.collect_params().items(), reference.collect_params().values()):
        got = p.data().asnumpy()
        same_on_all_ranks(got, name + ' after DistributedTrainer steps')
        np.testing.assert_allclose(got, q.data().asnumpy(), rtol=1e-5, atol=1e-6,
                                   err_msg='%s: DistributedTrainer(group_bytes=%s) against one '
                                           'process on the global batch' % (name, group_bytes))


check_array_collectives()
check_objects()
check_sub_communicator()
check_broadcast_after_inference_forward()
check_deferred_initialisation()
for group_bytes in (None, 256, 0):
    check_distributed_trainer(group_bytes)
kv.wait()
done('kv_helpers[%s]' % design_arg())
