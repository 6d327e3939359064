"""Repeated hvd.allreduce (out of place) and unnamed hvd.allreduce_ on their one-function
paths (store/collectives.py: again_copy with the prepared call moved to each new copy,
Prepared.move_to; again_unnamed, whose records are found by the tensor).

usage: hvd_unnamed.py DESIGN

- unnamed: three tensors (two shapes, two dtypes) called without a name in turn for 4 rounds,
  new values each round: every sum as numpy's; from the second round every call is counted
  'again': 'unnamed'.
- burst: 4 inputs, each called out of place 12 times in one burst under its name before any
  wait: every result (a new array each call) holds its own sum; 'again': 'copy' 4 x 11.
  On the chained design the store's plan cache does not grow after the first repeats.
- change: one name given an input of another shape, then another dtype, then the first
  again: each right, each a fallback (fastpath 'miss').
- failures: a repeated out-of-place call (rank 0) meeting another shape (rank 1) fails on
  every rank naming both shapes, on the array the caller holds; an unnamed repeated call
  meeting another shape fails the same way; each path's next call sums right.
"""
import mxnet as mx
import numpy as np

import mpi_kvstore
import mpi_kvstore.horovod as hvd
from mpi_kvstore import debug

from common import RANK, SIZE, close, design_arg, done, expect_raises

DESIGN = design_arg()
FACTOR = SIZE * (SIZE + 1) // 2      # sum over ranks of (rank + 1)

hvd.init(design=DESIGN, autotune='0')
store = hvd.global_process_set._store


def values(shape, dtype, step):
    return ((np.arange(int(np.prod(shape))).reshape(shape) % 7 + step) * (RANK + 1)).astype(dtype)


def total(shape, dtype, step):
    return ((np.arange(int(np.prod(shape))).reshape(shape) % 7 + step) * FACTOR).astype(dtype)


def unnamed():
    tensors = [mx.nd.zeros((16,)), mx.nd.zeros((3, 5)), mx.nd.zeros((16,), dtype='float64')]
    counts = []
    for step in range(4):
        before = debug.snapshot()
        for t in tensors:
            t[:] = values(t.shape, t.dtype, step)
            hvd.allreduce_(t, op=hvd.Sum)
        for i, t in enumerate(tensors):
            close(t.asnumpy(), total(t.shape, t.dtype, step), 'unnamed %d step %d' % (i, step))
        counts.append(debug.since(before, 'again'))
    return counts


def burst():
    inputs = [mx.nd.array(values((64,), 'float32', i)) for i in range(4)]
    design = store._job.design
    plans = []
    outs = []
    before = debug.snapshot()
    for call in range(12):
        for i, x in enumerate(inputs):
            outs.append((hvd.allreduce(x, name='b%d' % i, op=hvd.Sum), i))
        if call in (2, 11) and hasattr(design, '_plans'):
            plans.append(len(design._plans))
    for out, i in outs:
        close(out.asnumpy(), total((64,), 'float32', i), 'burst input %d' % i)
    for i, x in enumerate(inputs):
        close(x.asnumpy(), values((64,), 'float32', i), 'burst input %d left as it was' % i)
    return debug.since(before, 'again'), plans


def change():
    seen = []
    for step, (shape, dtype) in enumerate([((16,), 'float32'), ((4, 4), 'float32'),
                                           ((16,), 'float64'), ((16,), 'float32')]):
        x = mx.nd.array(values(shape, dtype, step), dtype=dtype)
        before = debug.snapshot()
        out = hvd.allreduce(x, name='x', op=hvd.Sum)
        close(out.asnumpy(), total(shape, dtype, step), 'change %d' % step)
        assert np.dtype(out.dtype) == np.dtype(dtype) and out.shape == shape
        seen.append(debug.since(before, 'fastpath'))
    return seen


def failing(call, name):
    """Rank 0 repeats ``call`` on its array; rank 1 meets it with another shape: the error
    on the array the caller holds (or raised by the call where the design is synchronous),
    then the next call right. -> (message, what reading the caller's array raised (nothing
where the call raised), counts of the next two calls)."""
    mine = mx.nd.zeros((16,))
    for step in range(2):   # warm-up: the repeat's path prepared
        mine[:] = values((16,), 'float32', step)
        close(call(mine).asnumpy(), total((16,), 'float32', step), '%s warm-up' % name)
    other = mine if RANK == 0 else mx.nd.ones((16 + RANK,))

    read = []

    def call_and_read():   # the call itself raises where the design is synchronous (blocking)
        out = call(other)
        try:   # the error is on the array the caller holds: raised, or its poison
            got = out.asnumpy()
            read.append(bool(np.isnan(got).all()) and 'poisoned')
        except mx.base.MXNetError as err:
            read.append(str(err))
        store.wait()
    err = expect_raises(mpi_kvstore.RankMismatchError, call_and_read)
    after = []
    for step in range(2):
        mine[:] = values((16,), 'float32', step + 5)
        before = debug.snapshot()
        out = call(mine)
        close(out.asnumpy(), total((16,), 'float32', step + 5), '%s after %d' % (name, step))
        after.append(debug.since(before, 'again'))
    return str(err), read, after


counts = unnamed()
copies, plans = burst()
changed = change()
copy_said, copy_read, copy_after = failing(lambda a: hvd.allreduce(a, name='m', op=hvd.Sum), 'copy')
unnamed_said, unnamed_read, unnamed_after = failing(lambda a: hvd.allreduce_(a, op=hvd.Sum), 'unnamed')
done('hvd_unnamed[%s]' % DESIGN, unnamed=counts, copies=copies, plans=plans, changed=changed,
     copy_said=copy_said, copy_read=copy_read, copy_after=copy_after,
     unnamed_said=unnamed_said, unnamed_read=unnamed_read, unnamed_after=unnamed_after)
hvd.shutdown()
