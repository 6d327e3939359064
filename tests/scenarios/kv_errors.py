"""Bad input gets a clear exception that names the problem; no hang, no wrong sum.

usage: kv_errors.py DESIGN
"""
import os

import mxnet as mx
import numpy as np

import mpi_kvstore

from common import RANK, SIZE, close, design_arg, done, expect_raises

DESIGN = design_arg()


def local_errors(kv):
    """Caught on the calling rank before anything is sent."""
    kv.init('k', mx.nd.zeros((4,)))
    expect_raises(KeyError, kv.pull, 'nope', out=mx.nd.zeros((4,)), contains="'nope'")
    expect_raises(mpi_kvstore.UnknownKeyError, kv.pull, 17, out=mx.nd.zeros((4,)),
                  contains='has no value')
    expect_raises(TypeError, kv.pushpull, 'k', mx.nd.zeros((4,)), priority='high',
                  contains="priority must be an int, not 'high'")
    expect_raises(TypeError, kv.pushpull, 'k', mx.nd.zeros((4,)), priority=1.5,
                  contains='priority must be an int')
    expect_raises(ValueError, kv.pushpull, 'k', mx.nd.zeros((4,)), out=mx.nd.zeros((5,)),
                  contains='shape (5,)')
    expect_raises(ValueError, kv.pushpull, 'k', mx.nd.zeros((4,)),
                  out=mx.nd.zeros((4,), dtype='float64'), contains='float64')
    expect_raises(ValueError, kv.pushpull, 'k', mx.nd.zeros((3,)), contains='key has shape (4,)')
    expect_raises(ValueError, kv.pushpull, ['n1', 'n1'], [mx.nd.zeros((3,)), mx.nd.zeros((2,))],
                  contains='more than once')
    expect_raises(KeyError, kv.pull, 'n1', out=mx.nd.zeros((3,)), contains="'n1'")
    # one array or one key twice in a call: the engine cannot list an array twice (it hung)
    x = mx.nd.ones((3,))
    expect_raises(ValueError, kv.pushpull, ['t1', 't2'], [x, x], contains='output of keys')
    expect_raises(ValueError, kv.push, ['t1', 't1'], [x, x], contains='more than once')
    expect_raises(ValueError, kv.pushpull, 't1', x, out=[x, x], contains='given twice')
    expect_raises(TypeError, kv.pushpull, 't0', mx.nd.array(np.array(3.0, dtype='float32')),
                  contains='0-d array')
    kv.pushpull(['t1', 't2'], [x, mx.nd.ones((3,))])        # nothing above registered them
    close(x.asnumpy(), SIZE, 'keys after rejected repeats')
    expect_raises(ValueError, kv.pushpull, 'k', [mx.nd.zeros((4,)), mx.nd.zeros((2,))],
                  contains='differ between devices')
    expect_raises(TypeError, kv.pushpull, 'k', mx.nd.zeros((4,), dtype='bool'),
                  contains='dtype bool')
    expect_raises(TypeError, kv.pushpull, ['k', 3], [mx.nd.zeros((4,))] * 2, contains='mixed')
    expect_raises(ValueError, kv.pushpull, ['k', 'k'], [mx.nd.zeros((4,))],
                  contains='one entry per key')
    expect_raises(TypeError, kv.pushpull, 'k', 'not an array', contains='NDArray')
    expect_raises(ValueError, kv.init, 'k', mx.nd.zeros((4,)), contains='already initialised')
    expect_raises(ValueError, kv.broadcast, 'k', mx.nd.zeros((4,)), root=SIZE,
                  contains='root')


def config_errors():
    err = expect_raises(mpi_kvstore.ConfigError, mpi_kvstore.create, 'dist_mpi',
                        design='hierarchical')
    assert 'hierarchical' in str(err) and 'funneled' in str(err), err
    os.environ['MPI_KVSTORE_DESIGN'] = 'bogus'
    err = expect_raises(mpi_kvstore.ConfigError, mx.kv.create, 'dist_mpi')
    assert 'MPI_KVSTORE_DESIGN' in str(err), err
    del os.environ['MPI_KVSTORE_DESIGN']
    os.environ['MPI_KVSTORE_FUSION_THRESHOLD'] = 'lots'
    expect_raises(mpi_kvstore.ConfigError, mpi_kvstore.create, contains='MPI_KVSTORE_FUSION')
    del os.environ['MPI_KVSTORE_FUSION_THRESHOLD']
    expect_raises(ValueError, mpi_kvstore.create, 'dist_sync', contains='dist_mpi')


def call_then_wait(kv, call):
    """The error may come from the call (NaiveEngine runs ops inside it) or the wait."""
    def both(*args, **kwargs):
        call(*args, **kwargs)
        kv.wait()
    both.__name__ = call.__name__ + '+wait'
    return both


def rank_mismatch(kv):
    """Shapes that differ between ranks: every rank raises, none hangs, nothing is summed."""
    if SIZE == 1:
        return
    shape = (8,) if RANK == 0 else (9,)
    value = mx.nd.ones(shape) * (RANK + 1)
    expect_raises(mpi_kvstore.RankMismatchError, call_then_wait(kv, kv.broadcast),
                  'per-rank-shape', value, out=value, contains='per-rank-shape')
    # the same key at one position, different keys at the next: caught, not mis-summed
    kv.init(['x', 'y'], [mx.nd.zeros((6,)), mx.nd.zeros((6,))])
    kv.wait()
    a = mx.nd.ones((6,)) * (RANK + 1)
    expect_raises(mpi_kvstore.RankMismatchError, call_then_wait(kv, kv.pushpull),
                  'x' if RANK == 0 else 'y', a, contains='ranks disagree')
    assert np.isnan(a.asnumpy()).all(), 'rank %d: a mismatched output is not poisoned: %s' % (
        RANK, a.asnumpy())
    # the store still works afterwards
    b = mx.nd.ones((6,)) * (RANK + 1)
    kv.pushpull('x', b)
    close(b.asnumpy(), SIZE * (SIZE + 1) / 2, 'store usable after a mismatch')


def deferred_error_next_call(kv):
    """An error inside an engine op surfaces on the user's thread at the next call."""
    if SIZE == 1:
        return
    kv.init(['z0', 'z1'], [mx.nd.zeros((3,)), mx.nd.zeros((3,))])
    kv.wait()
    value = mx.nd.ones((3,))
    if os.environ.get('MXNET_ENGINE_TYPE') == 'NaiveEngine' or DESIGN == 'blocking':
        # ops run inside the call: the error comes out of the call itself
        expect_raises(mpi_kvstore.RankMismatchError, kv.pushpull, 'z%d' % (RANK % 2), value)
        return
    kv.pushpull('z%d' % (RANK % 2), value)
    if DESIGN == 'chained':
        mx.nd.waitall()             # the engine op finished; the store was not asked
    else:
        # the op wrote the user's array only: MXNet's own wait raises the error
        expect_raises(mx.base.MXNetError, mx.nd.waitall, contains='ranks disagree')
    err = expect_raises(mpi_kvstore.RankMismatchError, kv.pull, 'z0', out=mx.nd.zeros((3,)))
    assert 'collective #' in str(err), err
    assert np.isnan(value.asnumpy()).all(), value


def main():
    kv = mpi_kvstore.create('dist_mpi', design=DESIGN)
    local_errors(kv)
    config_errors()
    rank_mismatch(kv)
    deferred_error_next_call(kv)
    kv.wait()
    done('kv_errors[%s]' % DESIGN)


main()
