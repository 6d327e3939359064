"""The prepared path of repeated calls (store/exchange.Exchange.replay, the named
allreduce's in store/collectives.py; debug counter 'fastpath').

usage: kv_fastpath.py DESIGN [MAX_EXAMPLES]

bursts    Hypothesis draws a step of 1-10 tensors (1 to 4096 elements, float32, float64,
          float16, int32 or int64, priorities -2..2), each reduced by one of: kv.pushpull of
          its key in place, kv.pushpull into another array (out=), kv.pushpull of a list of
          two keys, hvd.allreduce_ (Sum), hvd.grouped_allreduce_ (Sum) of two tensors; the
          calls are issued back to back, then waited for. The step runs 4 times on the same
          arrays with new values (rank r contributes (r + 1) * base): every sum is checked
          against numpy, and every call of steps 2-4 took the prepared path.
fallback  After a repeated call took the prepared path ('hit'), another array, a dtype, a
          shape, a context (cpu(1)) or a priority takes the full path, sums right, and its
          own repeat is prepared again.
mismatch  A burst of prepared calls whose last differs on the ranks (rank 0 repeats its
          prepared call, the others call a key of shape (4 + rank,)): every rank raises
          RankMismatchError naming each rank's shape; the burst's other calls sum right, and
          the prepared calls go on summing right after it.
views     kv.pushpull of two keys whose arrays are an array and a view of it raises
          ValueError at once on every rank (one engine op cannot write one array twice:
          it would never run); two keys of two arrays sum right.
"""
import sys
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
MAX_EXAMPLES = int(sys.argv[2]) if len(sys.argv) > 2 else 12
FACTOR = SIZE * (SIZE + 1) // 2      # sum over ranks of (rank + 1)
STEPS = 4
APIS = ('pushpull', 'pushpull_out', 'pushpull_list', 'hvd', 'hvd_grouped')
# calls a tensor of each API makes a step (a list and a group hold two tensors, one call)
CALLS = {'pushpull': 1, 'pushpull_out': 1, 'pushpull_list': 1, 'hvd': 1, 'hvd_grouped': 2}

kv = mpi_kvstore.create('dist_mpi', design=DESIGN, autotune='0')
hvd.init(design=DESIGN, autotune='0')
tensor = st.tuples(st.sampled_from((1, 7, 256, 4096)),
                   st.sampled_from(('float32', 'float64', 'float16', 'int32', 'int64')),
                   st.sampled_from(APIS), st.integers(-2, 2))
EXAMPLES = iter(range(1 << 30))
HITS = []   # per example: [prepared calls seen, prepared calls expected]


def base_of(i, count, step):
    return (np.arange(count) + i + step) % 5


@settings(derandomize=True, database=None, deadline=None, max_examples=MAX_EXAMPLES,
          phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck),
          print_blob=False)
@given(st.lists(tensor, min_size=1, max_size=10))
def test_bursts(program):
    example = next(EXAMPLES)
    digest = WORLD.allgather(zlib.crc32(repr(program).encode()))
    assert len(set(digest)) == 1, 'ranks drew different steps: %s' % digest
    # each tensor: its arrays (two for a list or a group, an out for pushpull_out)
    arrays = [[mx.nd.zeros((count,), dtype=dtype)
               for _ in range(2 if api in ('pushpull_list', 'hvd_grouped') else 1)]
              for count, dtype, api, _ in program]
    outs = [mx.nd.zeros((count,), dtype=dtype) if api == 'pushpull_out' else None
            for count, dtype, api, _ in program]
    before = debug.snapshot()
    for step in range(STEPS):
        if step == 1:
            before = debug.snapshot()
        for i, (count, dtype, api, priority) in enumerate(program):
            for j, array in enumerate(arrays[i]):
                array[:] = (base_of(i + j, count, step) * (RANK + 1)).astype(dtype)
            key = 'b%d.%d' % (example, i)
            if api == 'pushpull':
                kv.pushpull(key, arrays[i][0], priority=priority)
            elif api == 'pushpull_out':
                kv.pushpull(key, arrays[i][0], out=outs[i], priority=priority)
            elif api == 'pushpull_list':
                kv.pushpull([key, key + 'x'], arrays[i], priority=priority)
            elif api == 'hvd':
                hvd.allreduce_(arrays[i][0], name=key, op=hvd.Sum)
            else:
                hvd.grouped_allreduce_(arrays[i], name=key, op=hvd.Sum)
        kv.wait()
        for i, (count, dtype, api, _) in enumerate(program):
            got = [outs[i]] if api == 'pushpull_out' else arrays[i]
            for j, array in enumerate(got):
                close(array.asnumpy(), base_of(i + j, count, step) * FACTOR,
                      'step %d.%d tensor %d.%d (%s, %s)' % (example, step, i, j, dtype, api),
                      rtol=1e-3 if dtype == 'float16' else 1e-6, atol=0)
            if api == 'pushpull_out':   # its input is left as it was
                close(arrays[i][0].asnumpy(), base_of(i, count, step) * (RANK + 1),
                      'step %d.%d input %d' % (example, step, i))
    hits = debug.since(before, 'fastpath')
    HITS.append([hits.get('hit', 0), hits.get('miss', 0),
                 (STEPS - 1) * sum(CALLS[api] for _, _, api, _ in program)])


def fastpath(fn):
    before = debug.snapshot()
    fn()
    kv.wait()
    return debug.since(before, 'fastpath')


def fallback():
    """{case: fastpath counters of the call}, each call's sum checked."""
    found = {}
    x = mx.nd.ones((64,)) * (RANK + 1)

    def pushpull(array, value, priority=0, key='f'):
        def call():
            array[:] = value * (RANK + 1)
            kv.pushpull(key, array, priority=priority)
        return call
    for i in range(3):
        found['kv %d' % i] = fastpath(pushpull(x, i + 1))
        close(x.asnumpy(), (i + 1) * FACTOR, 'kv repeat %d' % i)
    found['kv priority'] = fastpath(pushpull(x, 4, priority=-1))
    found['kv priority again'] = fastpath(pushpull(x, 5, priority=-1))
    close(x.asnumpy(), 5 * FACTOR, 'kv priority')
    other = mx.nd.zeros((64,))
    found['kv array'] = fastpath(pushpull(other, 6, priority=-1))
    close(other.asnumpy(), 6 * FACTOR, 'kv another array')
    found['kv array again'] = fastpath(pushpull(other, 7, priority=-1))
    close(other.asnumpy(), 7 * FACTOR, 'kv another array again')
    found['kv back'] = fastpath(pushpull(x, 8, priority=-1))   # the entry now holds other
    close(x.asnumpy(), 8 * FACTOR, 'kv back to the first array')
    on_cpu1 = mx.nd.zeros((64,), ctx=mx.cpu(1))
    found['kv context'] = fastpath(pushpull(on_cpu1, 9, key='f1'))
    found['kv context again'] = fastpath(pushpull(on_cpu1, 10, key='f1'))
    close(on_cpu1.asnumpy(), 10 * FACTOR, 'kv on cpu(1)')

    t = mx.nd.zeros((32,))

    def allreduce(array, value):
        def call():
            array[:] = value * (RANK + 1)
            hvd.allreduce_(array, name='n', op=hvd.Sum)
        return call
    for i in range(3):
        found['hvd %d' % i] = fastpath(allreduce(t, i + 1))
        close(t.asnumpy(), (i + 1) * FACTOR, 'hvd repeat %d' % i)
    for case, array in (('shape', mx.nd.zeros((33,))),
                        ('dtype', mx.nd.zeros((32,), dtype='float64')),
                        ('context', mx.nd.zeros((32,), ctx=mx.cpu(1)))):
        found['hvd ' + case] = fastpath(allreduce(array, 3))
        close(array.asnumpy(), 3 * FACTOR, 'hvd of name n with another ' + case)
        found['hvd %s again' % case] = fastpath(allreduce(array, 4))
        close(array.asnumpy(), 4 * FACTOR, 'hvd of name n with another %s again' % case)
    for case in ('hvd average', 'hvd average again'):   # op: Average, folded in the sum
        t[:] = RANK + 1
        found[case] = fastpath(lambda: hvd.allreduce_(t, name='n'))
        close(t.asnumpy(), FACTOR / SIZE, case)
    for case in ('hvd copy', 'hvd copy again'):   # the same input again: its copy path
        t[:] = RANK + 1
        copies = []

        def copy(into=copies):
            into.append(hvd.allreduce(t, name='n', op=hvd.Sum))
        found[case] = fastpath(copy)
        close(copies[0].asnumpy(), FACTOR, case)
        close(t.asnumpy(), RANK + 1, case + ': the input left as it was')
    return found


def mismatch():
    """A burst of prepared calls whose last differs on the ranks -> what was raised."""
    xs = [mx.nd.zeros((4,)) for _ in range(4)]

    def burst(value, odd):
        for i, x in enumerate(xs):
            x[:] = (RANK + 1) * (value + i)
        for i, x in enumerate(xs[:3]):
            kv.pushpull('m%d' % i, x)
        if not odd or RANK == 0:
            kv.pushpull('m3', xs[3])
        else:
            kv.pushpull('m_odd', mx.nd.ones((4 + RANK,)))
    for value in range(3):
        burst(value, False)
        kv.wait()
    said = None
    before = debug.snapshot()
    try:   # raised by the call itself where the design is synchronous (blocking)
        burst(5, True)
        kv.wait()
    except mpi_kvstore.RankMismatchError as err:
        said = str(err)
    hits = debug.since(before, 'fastpath')
    for i, x in enumerate(xs[:3]):
        close(x.asnumpy(), FACTOR * (5 + i), 'burst call %d beside the mismatch' % i)
    # (rank 0's m3 failed: its array holds the error; the others go on)
    for i, x in enumerate(xs[:3]):
        x[:] = (RANK + 1) * (7 + i)
        kv.pushpull('m%d' % i, x)
    kv.wait()
    for i, x in enumerate(xs[:3]):
        close(x.asnumpy(), FACTOR * (7 + i), 'prepared call %d after the mismatch' % i)
    return said, hits


def views():
    """kv.pushpull of an array and a view of it -> the error; two arrays sum right."""
    x, y = mx.nd.ones((8,)) * (RANK + 1), mx.nd.ones((8,)) * (RANK + 1)
    said = None
    try:
        kv.pushpull(['v1', 'v2'], [x, x[2:4]])
    except ValueError as err:
        said = str(err)
    kv.pushpull(['v1', 'v2'], [x, y])
    kv.wait()
    close(x.asnumpy(), FACTOR, 'v1 after the refused call')
    close(y.asnumpy(), FACTOR, 'v2 after the refused call')
    return said


test_bursts()
kv.wait()
found = fallback()
said, mismatch_hits = mismatch()
views_said = views()
report('kv_fastpath_info', hits=HITS, fallback=found, mismatch=said,
       mismatch_hits=mismatch_hits, views=views_said)
done('kv_fastpath[%s]' % DESIGN)
hvd.shutdown()
kv.close()
