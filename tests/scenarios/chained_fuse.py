"""The chained design fuses a burst (designs/chained.py, engine/fuse.py).

usage: chained_fuse.py [MAX_EXAMPLES]

Each case holds the first array of each store's part of the burst (kv's and hvd's, which
has a store of its own) with an engine op that waits until every call of the burst was
made, so that store's first op is pending while the rest are pushed, on every rank,
whatever the machine's timing: the counters then say exactly what each op did
(mpi_kvstore.debug, kind 'fuse').

sums      Hypothesis draws bursts of 2-70 tensors (1 to 5,000 elements, float32, float64,
          int32 or int64, priorities -3..3), each issued as kv.pushpull of its key or
          hvd.allreduce_ (op=Sum). Each result is checked against numpy (rank r contributes
          (r + 1) * base, base small integers, exact in every dtype); in each store, the
          first op runs the first FUSE_OPS calls, the next the next FUSE_OPS, and so on:
          'absorbed' and 'led' count exactly that; every call but the first is 'linked'
          (one engine op, pushed without the chain).
busy      The same burst whose arrays are all written by held engine ops: none is free when
          its call is made, so no op runs another (the second call finds its arrays 'busy',
          and no later call is linked until the ops catch up; nothing absorbed), and every
          sum is right.
busy0     The same, held so on rank 0 only: rank 0 counts 'busy' once, the others link their
          9 calls, every round runs one call (the MIN), and every sum is right.
mismatch  A held burst of 7 pushpulls whose fourth has shape (4 + rank,): the wait raises
          RankMismatchError on every rank naming every rank's shape; the three before it ran
          fused, as did the three after it, and they sum right, as does a fresh key after.
"""
import sys
import zlib

import mxnet as mx
import numpy as np
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

import mpi_kvstore
import mpi_kvstore.horovod as hvd
from mpi_kvstore import debug
from mpi_kvstore.engine.layout import FUSE_OPS

from common import RANK, SIZE, WORLD, Held, close, done, report

MAX_EXAMPLES = int(sys.argv[1]) if len(sys.argv) > 1 else 15
DTYPES = ('float32', 'float64', 'int32', 'int64')
SIZES = (1, 7, 256, 5000)
FACTOR = SIZE * (SIZE + 1) // 2      # sum over ranks of (rank + 1)

kv = mpi_kvstore.create('dist_mpi', design='chained', autotune='0')
hvd.init(design='chained', autotune='0')
EXAMPLES = iter(range(1 << 30))


def base_of(index, count, dtype):
    return ((np.arange(count) + index) % 7).astype(dtype)


def issue(calls, arrays, tag):
    for i, ((_, _, priority, api), array) in enumerate(zip(calls, arrays)):
        if api == 'pushpull':
            kv.pushpull('%s%d' % (tag, i), array, priority=priority)
        else:
            hvd.allreduce_(array, name='%s%d' % (tag, i), op=hvd.Sum, priority=priority)


def wait_all():
    kv.wait()
    hvd.store().wait()


def burst(calls, tag, hold_all=False):
    """Issue ``calls`` held as the module says; -> the 'fuse' counters it moved."""
    arrays = []
    for i, (count, dtype, _, _) in enumerate(calls):
        arrays.append(mx.nd.array(base_of(i, count, dtype) * (RANK + 1), dtype=dtype))
    for i, (_, _, _, api) in enumerate(calls):   # keys and names known: the burst alone
        if api == 'pushpull':
            kv.init('%s%d' % (tag, i), mx.nd.zeros(arrays[i].shape, dtype=arrays[i].dtype))
    mx.nd.waitall()
    wait_all()
    firsts = [next(a for a, c in zip(arrays, calls) if c[3] == api)
              for api in sorted({c[3] for c in calls})]
    held = Held(arrays if hold_all else firsts)
    before = debug.snapshot()
    issue(calls, arrays, tag)
    held.release()
    wait_all()      # each store counts an op when it learns it is done
    for array in arrays:
        array.wait_to_read()
    fused = debug.since(before, 'fuse')
    for i, ((count, dtype, _, api), array) in enumerate(zip(calls, arrays)):
        close(array.asnumpy(), base_of(i, count, dtype).astype(np.float64) * FACTOR,
              '%s %d %s %s x%d' % (tag, i, api, dtype, count))
    return fused


def expected_counts(calls):
    counts = [sum(c[3] == api for c in calls) for api in ('pushpull', 'hvd')]
    runs = [min(FUSE_OPS, n - start) for n in counts for start in range(0, n, FUSE_OPS)]
    found = {'absorbed': sum(r - 1 for r in runs), 'led': sum(r > 1 for r in runs),
             'linked': sum(max(n - 1, 0) for n in counts)}
    return {k: v for k, v in found.items() if v}


tensor = st.tuples(st.sampled_from(SIZES), st.sampled_from(DTYPES), st.integers(-3, 3),
                   st.sampled_from(('pushpull', 'hvd')))
SEEN = []


@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
          phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
@given(st.lists(tensor, min_size=2, max_size=70))
@example([(256, 'float32', -(i % 4), 'hvd' if i % 3 == 0 else 'pushpull') for i in range(70)])
@example([(5000, 'float64', 0, 'pushpull')] * 40)    # runs of 32 cut at fusion_threshold
def sums(calls):
    example = next(EXAMPLES)
    every = WORLD.allgather(zlib.crc32(repr(calls).encode()))
    assert len(set(every)) == 1, 'ranks drew different bursts: %s' % every
    fused = burst(calls, 'b%d_' % example)
    assert fused == expected_counts(calls), (len(calls), fused)
    SEEN.append(len(calls))


def busy():
    calls = [(256, 'float32', 0, 'pushpull')] * 10
    return burst(calls, 'busy', hold_all=True)


def busy_on_rank0():
    """Busy on rank 0 only: its calls go as chained ops while the others link theirs into
    a walk; each round then runs one call (MIN), and the rounds line up."""
    calls = [(256, 'float32', 0, 'pushpull')] * 10
    return burst(calls, 'busy0', hold_all=RANK == 0)


def mismatch():
    arrays = [mx.nd.ones((4 + (RANK if i == 3 else 0),)) * (RANK + 1) for i in range(7)]
    mx.nd.waitall()
    kv.wait()
    held = Held(arrays[:1])
    before = debug.snapshot()
    for i, array in enumerate(arrays):
        kv.pushpull('m%d' % i, array)
    held.release()
    said = None
    try:
        kv.wait()
    except mpi_kvstore.RankMismatchError as err:
        said = str(err)
    fused = debug.since(before, 'fuse')
    for i, array in enumerate(arrays):
        if i != 3:
            close(array.asnumpy(), FACTOR, 'mismatch burst %d' % i)
    fresh = mx.nd.ones((3,)) * (RANK + 1)
    kv.pushpull('after_mismatch', fresh)
    close(fresh.asnumpy(), FACTOR, 'a fresh key after the mismatch')
    return said, fused


sums()
kv.wait()
busy_counts = busy()
busy0_counts = busy_on_rank0()
said, mismatch_counts = mismatch()
report('chained_fuse_info', seen=SEEN, busy=busy_counts, busy0=busy0_counts, mismatch=said,
       mismatch_counts=mismatch_counts)
done('chained_fuse')
hvd.shutdown()
kv.close()
