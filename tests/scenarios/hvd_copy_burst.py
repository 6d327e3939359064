"""Bursts of repeated out-of-place allreduces (hvd.allreduce, functional.allreduce), whose
repeats copy their input at the push (store/collectives.py again_copy, engine.records.CopyNow)
so that on the chained design the burst fuses as an in-place one does.

usage: hvd_copy_burst.py DESIGN

- burst: 3 rounds; in each, 6 inputs (float32 16 KB, float64, int32, a 2-d float32 through
  functional.allreduce) called out of place 8 times each in one burst, mixed with in-place
  hvd.allreduce_ calls of 2 other arrays, before any wait; every result (its own array)
  holds the sum of the values its input had at the call (numpy), and every input is left as
  it was. One input is written by an engine op (``x += 1``) just before some calls: its copy
  waits for that write (no copy at the push) and still sums the new values.
  Counted: 'again' 'copy'.
- pure: 3 bursts of 60 out-of-place calls alone (16 KB inputs of their own): sums right,
  inputs unchanged; 'fuse' 'linked' counted (on chained the burst fuses: it was 0 when each
  call's copy was an MXNet op still pending when the call's collective was pushed).
- changed: in a burst, one name is given an input of another shape in the middle, then its
  first input again: every result right.
- failing: in a burst, rank 1 gives one repeated call another shape: every rank raises
  RankMismatchError naming both shapes, on the array the caller holds (its read raises or
  returns the poison; blocking raises in the call); the next burst sums right.
"""
import mxnet as mx
import numpy as np

import mpi_kvstore
import mpi_kvstore.horovod as hvd
from mpi_kvstore import debug, functional

from common import RANK, SIZE, close, design_arg, done, expect_raises

DESIGN = design_arg()
FACTOR = SIZE * (SIZE + 1) // 2      # sum over ranks of (rank + 1)

hvd.init(design=DESIGN, autotune='0')
store = hvd.global_process_set._store

SPECS = [((4096,), 'float32'), ((4096,), 'float32'), ((512,), 'float64'), ((300,), 'int32'),
         ((7, 9), 'float32'), ((1000,), 'float32')]
FUNCTIONAL = 4     # SPECS[4] goes through functional.allreduce
BUSY = 5           # SPECS[5] is written by an engine op before its calls


def values(shape, dtype, step):
    return ((np.arange(int(np.prod(shape))).reshape(shape) % 7 + step) * (RANK + 1)).astype(dtype)


def total(shape, dtype, step):
    return ((np.arange(int(np.prod(shape))).reshape(shape) % 7 + step) * FACTOR).astype(dtype)


def call(i, x):
    if i == FUNCTIONAL:
        return functional.allreduce(x, name='c%d' % i, store=store)
    return hvd.allreduce(x, name='c%d' % i, op=hvd.Sum)


def burst(rounds=3, calls=8):
    inputs = [mx.nd.array(values(shape, dtype, i), dtype=dtype)
              for i, (shape, dtype) in enumerate(SPECS)]
    inplace = [mx.nd.zeros((2048,)) for _ in range(2)]
    for i, x in enumerate(inputs):     # first calls: the full path, which keeps the records
        close(call(i, x).asnumpy(), total(x.shape, x.dtype, i), 'first call %d' % i)
    counts = []
    for r in range(rounds):
        before = debug.snapshot()
        outs, steps = [], {i: i for i in range(len(SPECS))}
        for k, t in enumerate(inplace):
            t[:] = values(t.shape, 'float32', r + k)
        for c in range(calls):
            for k, t in enumerate(inplace):   # each call sums the last one's sum again
                hvd.allreduce_(t, name='p%d' % k, op=hvd.Sum)
            for i, x in enumerate(inputs):
                if i == BUSY and c % 3 == 1:
                    x += RANK + 1      # an engine op: the next copy waits for it
                    steps[i] += 1
                outs.append((call(i, x), x.shape, SPECS[i][1], steps[i], 'input %d' % i))
        for out, shape, dtype, step, what in outs:
            assert out.shape == shape and np.dtype(out.dtype) == np.dtype(dtype), what
            close(out.asnumpy(), total(shape, dtype, step), 'round %d %s' % (r, what))
        for k, t in enumerate(inplace):
            close(t.asnumpy(), total(t.shape, 'float32', r + k) * SIZE ** (calls - 1),
                  'round %d in place %d' % (r, k))
        for i, x in enumerate(inputs):
            close(x.asnumpy(), values(x.shape, SPECS[i][1], steps[i]),
                  'round %d input %d left as it was' % (r, i))
        # the busy input starts each round from its first values again
        inputs[BUSY][:] = values(SPECS[BUSY][0], SPECS[BUSY][1], BUSY)
        seen = debug.since(before, 'again')
        seen.update({'linked': debug.since(before, 'fuse').get('linked', 0)})
        counts.append(seen)
    return counts


def pure(rounds=3, calls=60):
    """Bursts of out-of-place calls alone, each on an input of its own (16 KB): -> each
    round's 'fuse' 'linked' count (chained: the calls link behind the burst's leader)."""
    inputs = [mx.nd.array(values((4096,), 'float32', i)) for i in range(calls)]
    for i, x in enumerate(inputs):
        close(hvd.allreduce(x, name='u%d' % i, op=hvd.Sum).asnumpy(),
              total((4096,), 'float32', i), 'pure first call %d' % i)
    linked = []
    for r in range(rounds):
        before = debug.snapshot()
        outs = [hvd.allreduce(x, name='u%d' % i, op=hvd.Sum) for i, x in enumerate(inputs)]
        for i, out in enumerate(outs):
            close(out.asnumpy(), total((4096,), 'float32', i), 'pure round %d call %d' % (r, i))
        linked.append(debug.since(before, 'fuse').get('linked', 0))
    for i, x in enumerate(inputs):
        close(x.asnumpy(), values((4096,), 'float32', i), 'pure input %d left as it was' % i)
    return linked


def changed():
    x = mx.nd.array(values((4096,), 'float32', 1))
    other = mx.nd.array(values((8, 8), 'float32', 2))
    close(hvd.allreduce(x, name='s', op=hvd.Sum).asnumpy(), total((4096,), 'float32', 1), 's first')
    outs = []
    for c in range(10):
        given, step = (other, 2) if c in (4, 5) else (x, 1)
        outs.append((hvd.allreduce(given, name='s', op=hvd.Sum), given.shape, step, c))
    for out, shape, step, c in outs:
        assert out.shape == shape, (c, out.shape)
        close(out.asnumpy(), total(shape, 'float32', step), 'changed call %d' % c)
    close(x.asnumpy(), values((4096,), 'float32', 1), 'changed input left as it was')
    return len(outs)


def failing():
    mine = mx.nd.array(values((16,), 'float32', 0))
    for _ in range(2):   # warm-up: the repeat's path prepared
        close(hvd.allreduce(mine, name='f', op=hvd.Sum).asnumpy(), total((16,), 'float32', 0),
              'failing warm-up')
    other = mine if RANK == 0 else mx.nd.ones((16 + RANK,))
    read = []

    def burst_and_read():
        outs = [hvd.allreduce(mine, name='f', op=hvd.Sum) for _ in range(3)]
        out = hvd.allreduce(other, name='f', op=hvd.Sum)   # raises itself on blocking
        try:   # the error is on the array the caller holds: raised, or its poison
            got = out.asnumpy()
            read.append(bool(np.isnan(got).all()) and 'poisoned')
        except mx.base.MXNetError as err:
            read.append(str(err))
        for early in outs:   # the calls before it ran: right, or failed with it
            try:
                early.wait_to_read()
            except mx.base.MXNetError:
                pass
        store.wait()
    err = expect_raises(mpi_kvstore.RankMismatchError, burst_and_read)
    before = debug.snapshot()
    outs = [hvd.allreduce(mine, name='f', op=hvd.Sum) for _ in range(6)]
    for c, out in enumerate(outs):
        close(out.asnumpy(), total((16,), 'float32', 0), 'after the failure, call %d' % c)
    close(mine.asnumpy(), values((16,), 'float32', 0), 'failing input left as it was')
    return str(err), read, debug.since(before, 'again')


# the failure first: its log lines (every rank's) come out before rank 0's [result] line
said, read, after = failing()
counts = burst()
linked = pure()
changes = changed()
done('hvd_copy_burst[%s]' % DESIGN, counts=counts, linked=linked, changes=changes, said=said, read=read,
     after=after)
hvd.shutdown()
