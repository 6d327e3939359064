"""The allreduce contract: pushpull needs no init (KVStoreBase, Horovod, BytePS).

usage: kv_allreduce.py DESIGN
"""
import mxnet as mx

import mpi_kvstore

from common import RANK, SIZE, close, design_arg, done, expect_raises

DESIGN = design_arg()
RANK_SUM = SIZE * (SIZE + 1) / 2          # sum over ranks of (rank + 1)


def uninitialised_keys(kv):
    grad = mx.nd.ones((5, 3)) * (RANK + 1)
    kv.pushpull(3, grad)                                  # int key, in place
    close(grad.asnumpy(), RANK_SUM, 'pushpull(3, grad) on a fresh key')
    out = mx.nd.zeros((2, 2), dtype='float64')
    kv.pushpull('w', mx.nd.ones((2, 2), dtype='float64') * (RANK + 1), out=out)
    close(out.asnumpy(), RANK_SUM, "pushpull('w', grad, out=o) on a fresh key")
    devs = [mx.nd.ones((4,)) * (RANK + 1), mx.nd.ones((4,)) * 10]
    kv.pushpull(['d0', 'd1'], [devs, mx.nd.arange(4)])   # per-device list, then a key list
    close(devs[0].asnumpy(), RANK_SUM + 10 * SIZE, 'per-device values summed over devices')
    close(devs[1].asnumpy(), RANK_SUM + 10 * SIZE, 'every device gets the sum')
    ints = mx.nd.ones((7,), dtype='int32') * (RANK + 1)
    kv.pushpull('i', ints)
    close(ints.asnumpy(), RANK_SUM, 'int32 pushpull on a fresh key')


def first_use_fixes_the_shape(kv):
    expect_raises(ValueError, kv.pushpull, 3, mx.nd.ones((3, 5)), contains='key has shape (5, 3)')
    expect_raises(ValueError, kv.pushpull, 'w', mx.nd.ones((2, 2)), contains='float64')
    # the rejected calls changed nothing: the key still sums
    grad = mx.nd.ones((5, 3))
    kv.pushpull(3, grad)
    close(grad.asnumpy(), SIZE, 'the key after rejected calls')


def pull_needs_a_value(kv):
    expect_raises(mpi_kvstore.UnknownKeyError, kv.pull, 3, out=mx.nd.zeros((5, 3)),
                  contains='pushpull alone stores nothing')
    expect_raises(KeyError, kv.pull, 'never', out=mx.nd.zeros((1,)), contains="'never'")
    # push, as in MXNet's own stores, needs init first; the refusal sends nothing
    expect_raises(mpi_kvstore.UnknownKeyError, kv.push, 'p', mx.nd.ones((3,)),
                  contains="push: key 'p' has no value in the store: it has not been initialised")
    expect_raises(mpi_kvstore.UnknownKeyError, kv.push, ['w', 'p'],
                  [mx.nd.ones((2, 2), dtype='float64'), mx.nd.ones((3,))], contains="push: key 'w'")
    kv.init('p', mx.nd.zeros((3,)))                        # the store is still usable
    kv.push('p', mx.nd.ones((3,)) * (RANK + 1))           # push stores the sum
    got = mx.nd.zeros((3,))
    kv.pull('p', out=got)
    close(got.asnumpy(), RANK_SUM, 'pull after push of a fresh key')


def optimizer_needs_weights():
    kv = mpi_kvstore.create('dist_mpi', design=DESIGN)
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1))
    expect_raises(mpi_kvstore.UnknownKeyError, kv.pushpull, 'g', mx.nd.ones((2,)),
                  out=mx.nd.zeros((2,)), contains='has no weights in the store')
    weights = mx.nd.ones((2,))
    kv.init('g', weights)
    kv.pushpull('g', mx.nd.ones((2,)), out=weights)
    close(weights.asnumpy(), 1 - 0.1 * SIZE, 'SGD step in the store after init')
    kv.close()


def main():
    kv = mpi_kvstore.create('dist_mpi', design=DESIGN)
    uninitialised_keys(kv)
    first_use_fixes_the_shape(kv)
    pull_needs_a_value(kv)
    kv.wait()
    optimizer_needs_weights()
    done('kv_allreduce[%s]' % DESIGN)


main()
