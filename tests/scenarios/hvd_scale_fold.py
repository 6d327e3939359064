"""Horovod's scale factors and Average folded into the reduction (horovod.ops._fold): the
result is postscale * op(prescale * x) as numpy computes it, with no engine op of its own for
float32 and float64 (debug counter ``hvd``: 'scale_op'), on every design.

usage: hvd_scale_fold.py DESIGN

Each dtype (float32, float64, int32, int64, float16) goes through Sum and Average with
prescale and postscale factors, 3 calls a case on the same arrays with new values, the same
name for every case (so a changed factor meets the name's prepared call): hvd.allreduce_,
hvd.allreduce (its input left as it was), hvd.grouped_allreduce_ of one tensor of each dtype,
and hvd.grouped_allreduce; hvd.allreduce_ without a name. An integer's prescale truncates
each element before the sum and its Average and postscale truncate the float64 product
after it (as Horovod's, and this store's before); a float16 prescale stays an op (it
guards the sum against overflow). Ranks that give different factors under one name fail
on every rank with RankMismatchError, as Horovod's "Mismatched prescale and/or postscale
factors"; the name goes on after it.
"""
import mxnet as mx
import numpy as np

import mpi_kvstore
import mpi_kvstore.horovod as hvd
from mpi_kvstore import debug

from common import RANK, SIZE, close, design_arg, done, expect_raises

DESIGN = design_arg()
hvd.init(design=DESIGN, autotune='0')
store = hvd.global_process_set._store

DTYPES = ('float32', 'float64', 'int32', 'int64', 'float16')
# (op, prescale, postscale); Sum without factors first, so a name is prepared before a change
CASES = ((hvd.Sum, 1.0, 1.0), (hvd.Average, 1.0, 1.0), (hvd.Sum, 0.5, 1.0),
         (hvd.Sum, 1.0, 3.0), (hvd.Average, 0.5, 3.0), (hvd.Average, 2.0, 0.25),
         (hvd.Sum, 3.0, 0.5), (hvd.Average, 1.0, 0.5), (hvd.Sum, 1.0, 1.0))
COUNT = 1000
STEPS = 3


def values(rank, i, step, dtype):
    """Rank ``rank``'s values of tensor ``i`` at ``step``: small integers, negative too (so
    truncation towards zero and a floor differ)."""
    return ((rank + 1) * (np.arange(COUNT) % 7 - 3) + i + step).astype(dtype)


def want(dtype, case, i, step):
    """Horovod's result in numpy: postscale * op(prescale * x); an integer's prescale
    truncated per element, its Average and postscale truncated after the sum."""
    op, pre, post = case
    xs = [values(r, i, step, dtype).astype(np.float64) for r in range(SIZE)]
    if np.dtype(dtype).kind == 'f':
        total = sum(pre * x for x in xs)
        return total / SIZE * post if op == hvd.Average else total * post
    total = sum(np.trunc(pre * x) for x in xs)
    factor = post / SIZE if op == hvd.Average else post
    return np.trunc(total * factor) if factor != 1.0 else total


def tolerance(dtype):
    return {'float16': (1e-2, 1e-2), 'float32': (1e-5, 1e-5)}.get(dtype, (1e-9, 1e-9))


def check(actual, expected, what, step, rtol, atol):
    """close() on the last step (the test reads what it recorded), the same check unrecorded
    on the others: one report line holds it all."""
    if step == STEPS - 1:
        close(actual, expected, what, rtol=rtol, atol=atol)
    elif not np.allclose(np.asarray(actual, dtype=np.float64), expected, rtol=rtol, atol=atol):
        raise AssertionError('rank %d: %s: got %s, expected %s'
                             % (RANK, what, np.asarray(actual).ravel()[:6],
                                np.asarray(expected).ravel()[:6]))


def counted(fn, *args, **kwargs):
    """fn(*args, **kwargs)'s result, and the debug counters it moved, {(kind, name): runs},
    once the store is idle."""
    before = debug.snapshot()
    out = fn(*args, **kwargs)
    store.wait()
    return out, {(kind, name): runs for kind in debug.KINDS
                 for name, runs in debug.since(before, kind).items()}


def in_place():
    """hvd.allreduce_ and hvd.allreduce of each dtype: {dtype: [per case [scale ops,
    fastpath hits of steps 2-3, again 'copy' of steps 2-3]]}."""
    seen = {}
    for i, dtype in enumerate(DTYPES):
        x = mx.nd.zeros((COUNT,), dtype=dtype)
        source = mx.nd.zeros((COUNT,), dtype=dtype)
        found = seen[dtype] = []
        for c, case in enumerate(CASES):
            op, pre, post = case
            ops = hits = copies = 0
            for step in range(STEPS):
                x[:] = values(RANK, i, step, dtype)
                source[:] = values(RANK, i, step, dtype)
                _, said = counted(hvd.allreduce_, x, name='a.' + dtype, op=op,
                                  prescale_factor=pre, postscale_factor=post)
                what = 'allreduce_ %s case %d step %d' % (dtype, c, step)
                rtol, atol = tolerance(dtype)
                check(x.asnumpy(), want(dtype, case, i, step), what, step, rtol, atol)
                ops += said.get(('hvd', 'scale_op'), 0)
                hits += said.get(('fastpath', 'hit'), 0) if step else 0
                out, said = counted(hvd.allreduce, source, name='c.' + dtype, op=op,
                                    prescale_factor=pre, postscale_factor=post)
                check(out.asnumpy(), want(dtype, case, i, step), 'allreduce ' + what[11:], step,
                      rtol, atol)
                assert np.array_equal(source.asnumpy(), values(RANK, i, step, dtype)), what
                ops += said.get(('hvd', 'scale_op'), 0)
                copies += said.get(('again', 'copy'), 0) if step else 0
            found.append([ops, hits, copies])
    return seen


def grouped():
    """hvd.grouped_allreduce_ and hvd.grouped_allreduce of a tensor of each dtype: per case
    [scale ops, again 'group' of steps 2-3]."""
    xs = [mx.nd.zeros((COUNT,), dtype=dtype) for dtype in DTYPES]
    found = []
    for c, case in enumerate(CASES):
        op, pre, post = case
        ops = groups = 0
        for step in range(STEPS):
            for i, (x, dtype) in enumerate(zip(xs, DTYPES)):
                x[:] = values(RANK, i, step, dtype)
            inputs = [x.copy() for x in xs]
            _, said = counted(hvd.grouped_allreduce_, xs, name='g', op=op,
                              prescale_factor=pre, postscale_factor=post)
            ops += said.get(('hvd', 'scale_op'), 0)
            groups += said.get(('again', 'group'), 0) if step else 0
            outs = hvd.grouped_allreduce(inputs, name='h', op=op, prescale_factor=pre,
                                         postscale_factor=post)
            for i, (x, out, dtype) in enumerate(zip(xs, outs, DTYPES)):
                rtol, atol = tolerance(dtype)
                what = 'grouped %s case %d step %d' % (dtype, c, step)
                check(x.asnumpy(), want(dtype, case, i, step), what + ' in place', step, rtol,
                      atol)
                check(out.asnumpy(), want(dtype, case, i, step), what, -1, rtol, atol)
                assert np.array_equal(inputs[i].asnumpy(), values(RANK, i, step, dtype)), what
        found.append([ops, groups])
    return found


def unnamed():
    """hvd.allreduce_ without a name, Average with both factors, 3 calls on one array: again
    'unnamed' (the record found by the tensor, keyed by the factors) from the second."""
    x = mx.nd.zeros((COUNT,))
    case, hits = (hvd.Average, 0.5, 3.0), 0
    for step in range(STEPS):
        x[:] = values(RANK, 0, step, 'float32')
        _, said = counted(hvd.allreduce_, x, prescale_factor=0.5, postscale_factor=3.0)
        check(x.asnumpy(), want('float32', case, 0, step), 'unnamed step %d' % step, step,
              1e-5, 1e-5)
        hits += said.get(('again', 'unnamed'), 0)
    return hits


def mismatch():
    """Rank 0 scales by 2, the others by 3, under one prepared name: RankMismatchError on
    every rank; then the name sums right again."""
    x = mx.nd.ones((16,))
    for _ in range(2):
        hvd.allreduce_(x, name='m', op=hvd.Sum)
    store.wait()

    def call_and_wait():   # the call itself raises where the design is synchronous (blocking)
        hvd.allreduce_(x, name='m', op=hvd.Sum, postscale_factor=2.0 if RANK == 0 else 3.0)
        store.wait()
    err = expect_raises(mpi_kvstore.RankMismatchError, call_and_wait)
    for step in range(2):
        x[:] = RANK + step
        hvd.allreduce_(x, name='m', op=hvd.Sum, postscale_factor=2.0)
        close(x.asnumpy(), 2.0 * sum(r + step for r in range(SIZE)),
              'after the mismatch %d' % step)
    return str(err)


single = in_place()
groups = grouped()
unnamed_hits = unnamed()
said = mismatch()
done('hvd_scale_fold[%s]' % DESIGN, single=single, groups=groups, unnamed=unnamed_hits,
     mismatch=said)
hvd.shutdown()
