"""The one-function path of out-of-place allreduces (store/collectives.Collectives.again_copy):
hvd.allreduce and mpi_kvstore.allreduce (functional) called again on the very same input.

usage: kv_copy.py DESIGN

Each case is a name called 3 times on one input with new values: every result, a new
NDArray, is checked against numpy (and still holds its sum after the later calls), and the
input is left as it was. The debug counter 'again' says 'copy' from the second call of a name
on; the first call of a name, and a call with another input array, another shape, dtype,
context, op or scale factor, takes the full path (counted: fastpath 'miss') and sums right.
A repeated call on one rank that meets a call of another shape on the other ranks fails on
every rank with RankMismatchError naming both shapes; the name's path goes on after it.
"""
import mxnet as mx
import numpy as np

import mpi_kvstore
import mpi_kvstore.horovod as hvd
from mpi_kvstore import debug

from common import RANK, SIZE, close, design_arg, done, expect_raises

DESIGN = design_arg()
FACTOR = SIZE * (SIZE + 1) // 2      # sum over ranks of (rank + 1)

kv = mpi_kvstore.create('dist_mpi', design=DESIGN, autotune='0')
hvd.init(design=DESIGN, autotune='0')
store = hvd.global_process_set._store


def values(shape, dtype, step):
    return (np.arange(int(np.prod(shape))).reshape(shape) % 7 + step).astype(dtype)


def calls(case, call, array, mean=False, scale=1.0, steps=3):
    """``call(array)`` ``steps`` times with new values -> [debug 'again' counts of each]."""
    counts, kept = [], []
    dtype = np.dtype(array.dtype)
    for step in range(steps):
        mine = values(array.shape, dtype, step) * (RANK + 1)
        array[:] = mine
        before = debug.snapshot()
        out = call(array)
        kept.append((out, step))
        out.wait_to_read()
        counts.append(debug.since(before, 'again'))
        close(array.asnumpy(), mine, '%s %d: the input left as it was' % (case, step))
    for out, step in kept:     # each result its own array, holding its own sum
        total = values(array.shape, np.float64, step) * FACTOR * scale
        if mean:
            total = total / SIZE
        if dtype.kind != 'f':
            total = total.astype(dtype)
        assert out.shape == array.shape and np.dtype(out.dtype) == dtype, (out.shape, out.dtype)
        close(out.asnumpy(), total, '%s %d' % (case, step))
    return counts


def hvd_sum(name):
    return lambda a: hvd.allreduce(a, name=name, op=hvd.Sum)


def fallback():
    said = {}
    t = mx.nd.zeros((16,))
    said['sum'] = calls('sum', hvd_sum('c'), t)
    said['average'] = calls('average', lambda a: hvd.allreduce(a, name='c'), t, mean=True)
    said['array'] = calls('array', hvd_sum('c'), mx.nd.zeros((16,)))
    said['back'] = calls('back', hvd_sum('c'), t, steps=1)
    said['shape'] = calls('shape', hvd_sum('c'), mx.nd.zeros((3, 5)))
    said['dtype'] = calls('dtype', hvd_sum('c'), mx.nd.zeros((16,), dtype='float64'))
    said['context'] = calls('context', hvd_sum('c'), mx.nd.zeros((16,), ctx=mx.cpu(1)))
    said['int average'] = calls('int average', lambda a: hvd.allreduce(a, name='i'),
                                mx.nd.zeros((16,), dtype='int32'), mean=True)
    said['postscale'] = calls('postscale', lambda a: hvd.allreduce(
        a, name='c', op=hvd.Sum, postscale_factor=2.0), t, scale=2.0)
    f = mx.nd.zeros((9,), dtype='float64')
    said['functional'] = calls('functional', lambda a: mpi_kvstore.allreduce(
        a, name='f', store=kv), f)
    said['functional mean'] = calls('functional mean', lambda a: mpi_kvstore.allreduce(
        a, average=True, name='f', store=kv), f, mean=True)
    return said


def mismatch():
    """Rank 0 repeats its prepared call of 'm'; the others call 'm' with another shape."""
    mine = mx.nd.ones((16,))
    calls('mismatch warm-up', hvd_sum('m'), mine, steps=2)
    other = mine if RANK == 0 else mx.nd.ones((16 + RANK,))
    before = debug.snapshot()

    def call_and_wait():   # the call itself raises where the design is synchronous (blocking)
        hvd.allreduce(other, name='m', op=hvd.Sum)
        store.wait()
    err = expect_raises(mpi_kvstore.RankMismatchError, call_and_wait)
    seen = debug.since(before, 'again')
    after = calls('after the mismatch', hvd_sum('m'), mine, steps=2)
    return str(err), seen, after


said = fallback()
message, seen, after = mismatch()
done('kv_copy[%s]' % DESIGN, fallback=said, mismatch=message, mismatch_again=seen, after=after)
hvd.shutdown()
kv.close()
