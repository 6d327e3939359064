"""Bursts of small collectives: many calls issued back to back, then one wait.

usage: kv_burst.py DESIGN [MAX_EXAMPLES]

sums      Hypothesis draws bursts of 1-24 tensors (sizes 1 to 40,000 elements, float32,
          float64, float16 or int32, priorities -3..3), each issued by one of: kv.pushpull of
          its key, a kv.pushpull of a list of keys (the tensor and its neighbour), the Horovod
          API (hvd.allreduce_ with op=Sum), or hvd.grouped_allreduce_ (op=Average, float
          tensors). Every rank issues the same calls in the same order (the collective order
          is the call order), but the data becomes ready in an order of the rank's own: a
          rank-chosen subset of the tensors is written by an engine op that waits for a slow
          matrix product first, so each rank finds its tensors ready in another order. Each
          result is checked against numpy: rank r contributes (r + 1) * base, base small
          integers, so every dtype sums exactly. Every rank draws the same bursts
          (derandomize, no database, no shrinking) and compares a hash of each first.
mismatch  A burst of 6 pushpulls whose last call has shape (4 + rank,): every rank raises
          RankMismatchError naming each rank's shape, the other calls of the burst, in flight
          with it, sum right, and the store then sums a fresh key. The last: an error is
          raised at the next call or wait, so a mismatch earlier in a burst would stop each
          rank at another call of it.
counters  The fast paths say they ran (mpi_kvstore.debug): a repeated pushpull on the same
          arrays hits the call cache; a repeated hvd.allreduce_ of a name reuses its
          signature ('named': 'hit'), a new shape or dtype under that name makes it again
          ('miss'), the same tensor twice in one grouped call stages the second through a
          copy ('staged'), and a tensor with a view of it in one grouped call runs both in
          place, one after the other; each result is checked.
idle      After the bursts, the design's negotiation thread (funneled, concurrent) uses no
          CPU: its clock ticks over one second of an idle store.
"""
import os
import sys
import threading
import time
import zlib

import mxnet as mx
import numpy as np
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import mpi_kvstore
import mpi_kvstore.horovod as hvd
from mpi_kvstore import debug

from common import RANK, SIZE, WORLD, close, design_arg, done, report

DESIGN = design_arg()
MAX_EXAMPLES = int(sys.argv[2]) if len(sys.argv) > 2 else 25
DTYPES = ('float32', 'float64', 'float16', 'int32')
SIZES = (1, 7, 256, 4096, 40000)
APIS = ('pushpull', 'pushpull_list', 'hvd', 'hvd_grouped')
FACTOR = SIZE * (SIZE + 1) // 2      # sum over ranks of (rank + 1)

kv = mpi_kvstore.create('dist_mpi', design=DESIGN, autotune='0')
hvd.init(design=DESIGN, autotune='0')
SLOW = mx.nd.ones((300, 300))


def base_of(index, count, dtype):
    """Tensor ``index``'s base values: small integers, exact in every dtype."""
    return ((np.arange(count) + index) % 7).astype(dtype)


tensor = st.tuples(st.sampled_from(SIZES), st.sampled_from(DTYPES), st.integers(-3, 3),
                   st.sampled_from(APIS))
EXAMPLES = iter(range(1 << 30))


def agree(program):
    """Every rank drew the same burst."""
    digest = zlib.crc32(repr(program).encode())
    every = WORLD.allgather(digest)
    assert len(set(every)) == 1, 'ranks drew different bursts: %s' % every


def late_order(example, count):
    """This rank's tensors that become ready late: a subset of its own."""
    rng = np.random.RandomState(1000 * example + RANK)
    return set(rng.choice(count, size=count // 2, replace=False).tolist())


@settings(derandomize=True, database=None, deadline=None, max_examples=MAX_EXAMPLES,
          phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck),
          print_blob=False)
@given(st.lists(tensor, min_size=1, max_size=24))
def test_bursts(program):
    example = next(EXAMPLES)
    agree(program)
    late = late_order(example, len(program))
    slow = mx.nd.dot(SLOW, SLOW)   # an engine op the late tensors wait for
    calls, i = [], 0       # (api, indices of the tensors it reduces)
    while i < len(program):
        api = program[i][3]
        if api == 'pushpull_list' and i + 1 < len(program):
            calls.append((api, [i, i + 1]))
            i += 2
        else:
            calls.append(('pushpull' if api == 'pushpull_list' else api, [i]))
            i += 1
    arrays, wanted = [None] * len(program), [None] * len(program)
    for api, indices in calls:
        for i in indices:
            count, dtype = program[i][:2]
            base = base_of(i, count, dtype)
            array = mx.nd.array(base * (RANK + 1), dtype=dtype)
            if i in late:
                zero = (slow[0:1, 0] * 0).astype(dtype)
                mx.nd.broadcast_add(array, zero, out=array)
            arrays[i] = array
            average = api == 'hvd_grouped' and dtype != 'int32'
            wanted[i] = base.astype(np.float64) * (FACTOR / SIZE if average else FACTOR)
    for api, indices in calls:
        keys = ['b%d.%d' % (example, i) for i in indices]
        priority, dtype = program[indices[0]][2], program[indices[0]][1]
        if api == 'pushpull_list':
            kv.pushpull(keys, [arrays[i] for i in indices], priority=priority)
        elif api == 'pushpull':
            kv.pushpull(keys[0], arrays[indices[0]], priority=priority)
        elif api == 'hvd':
            hvd.allreduce_(arrays[indices[0]], name=keys[0], op=hvd.Sum)
        else:
            op = hvd.Sum if dtype == 'int32' else hvd.Average
            hvd.grouped_allreduce_([arrays[indices[0]]], name=keys[0], op=op)
    for i, (array, want) in enumerate(zip(arrays, wanted)):
        dtype = program[i][1]
        close(array.asnumpy(), want, 'burst %d tensor %d (%s, %s)' % (example, i, program[i][3],
                                                                      dtype),
              rtol=1e-3 if dtype == 'float16' else 1e-6, atol=0)


def mismatch():
    """The last call of a burst of 6 differs in shape between ranks. -> what was raised."""
    arrays = [mx.nd.ones((4 + (RANK if i == 5 else 0),)) * (RANK + 1) for i in range(6)]
    said = None
    try:
        for i, array in enumerate(arrays):
            kv.pushpull('m%d' % i, array)   # the blocking design raises at the call
        kv.wait()
    except mpi_kvstore.RankMismatchError as err:
        said = str(err)
    for i, array in enumerate(arrays[:5]):
        close(array.asnumpy(), FACTOR, 'mismatch burst, call %d' % i)
    fresh = mx.nd.ones((3,)) * (RANK + 1)
    kv.pushpull('after_mismatch', fresh)
    close(fresh.asnumpy(), FACTOR, 'a fresh key after the mismatch')
    return said


def counters():
    """Which paths repeated calls take, and that each still sums right."""
    x = mx.nd.ones((64,)) * (RANK + 1)
    kv.pushpull('repeat', x)
    before = debug.snapshot()
    for _ in range(3):
        kv.pushpull('repeat', x)
    kv.wait()
    close(x.asnumpy(), FACTOR * SIZE ** 3, 'pushpull repeated on the same array')
    cache = debug.since(before, 'call_cache')

    named = {}
    t = mx.nd.ones((32,)) * (RANK + 1)
    hvd.allreduce_(t, name='n', op=hvd.Sum)
    before = debug.snapshot()
    hvd.allreduce_(t, name='n', op=hvd.Sum)
    t.wait_to_read()
    named['same'] = debug.since(before, 'named')
    close(t.asnumpy(), FACTOR * SIZE, 'hvd.allreduce_ repeated')
    for case, other in (('shape', mx.nd.ones((33,))), ('dtype', mx.nd.ones((32,), dtype='float64'))):
        other *= RANK + 1
        before = debug.snapshot()
        hvd.allreduce_(other, name='n', op=hvd.Sum)
        other.wait_to_read()
        named[case] = debug.since(before, 'named')
        close(other.asnumpy(), FACTOR, 'hvd.allreduce_ of name n with another ' + case)
    twice = mx.nd.ones((8,)) * (RANK + 1)
    before = debug.snapshot()
    hvd.grouped_allreduce_([twice, twice], name='twice', op=hvd.Sum)
    twice.wait_to_read()
    named['twice'] = debug.since(before, 'named')
    # the staged copy is taken before the collective runs: both sum the rank's own values
    close(twice.asnumpy(), FACTOR, 'the same tensor twice in one grouped call')
    # a tensor and a view of it in one grouped call: the view's op runs after the tensor's
    views = mx.nd.ones((4,)) * (RANK + 1)
    before = debug.snapshot()
    hvd.grouped_allreduce_([views, views[0:2]], name='views', op=hvd.Sum)
    views.wait_to_read()
    named['views'] = debug.since(before, 'named')
    close(views.asnumpy(), [FACTOR * SIZE] * 2 + [FACTOR] * 2,
          'a tensor and a view of it in one grouped call')
    return cache, named


def idle_ticks():
    """Clock ticks the negotiation threads (the store's and hvd's) used over one second of
    idle stores, or None where the design has no such thread."""
    threads = [t for t in threading.enumerate() if t.name == 'mpi_kvstore-' + DESIGN]
    if not threads:
        return None

    def ticks():
        total = 0
        for thread in threads:
            with open('/proc/self/task/%d/stat' % thread.native_id) as fh:
                fields = fh.read().rsplit(')', 1)[1].split()
            total += int(fields[11]) + int(fields[12])   # utime, stime
        return total
    kv.wait()
    time.sleep(0.2)
    start = ticks()
    time.sleep(1.0)
    return ticks() - start


test_bursts()
kv.wait()
said = mismatch()
cache, named = counters()
hvd_ticks = idle_ticks()
report('kv_burst_info', mismatch=said, cache=cache, named=named, idle_ticks=hvd_ticks,
       hz=os.sysconf('SC_CLK_TCK'))
done('kv_burst[%s]' % DESIGN)
hvd.shutdown()
kv.close()
