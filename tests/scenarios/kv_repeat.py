"""Repeated rounds whose data goes beside the agreement (designs/repeat.py).

usage: kv_repeat.py DESIGN [MAX_EXAMPLES]

steps     Hypothesis draws a step of 1-8 small tensors (1 to 4096 elements, float32, float64,
          int32, int64 or float16), each reduced by kv.pushpull of its key or by
          hvd.allreduce_ (Sum, or Average for float dtypes), cut in 1-3 bursts issued back
          to back, each waited for before the next (a repeating pattern of rounds), and runs
          it 4 times, new values each time (rank r contributes (r + 1) * (base + step)):
          every step's sums are checked against numpy, whether its rounds were bet on or not.
bursts    Steps of 3 bursts, each one list pushpull (one round): mixed shapes of float32; a
          float64 then float32 ones; 20 x 16 KB. From the third step on every round wins
          ('warm'); a step whose middle burst has another key and shape loses that bet ('changed').
counters  Lone pushpulls of one key, each waited for: the third and later calls run with
          the agreement ('won'); a call of another shape, and one of another dtype, in an
          armed round falls back to an ordinary round ('lost') and sums right.
mismatch  An armed round in which the ranks' calls differ in shape: every rank raises
          RankMismatchError naming each rank's shape; then a fresh key sums right.
"""
import sys
import zlib

import mxnet as mx
import numpy as np
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import mpi_kvstore
import mpi_kvstore.horovod as hvd

from common import RANK, SIZE, WORLD, close, design_arg, done, report

DESIGN = design_arg()
MAX_EXAMPLES = int(sys.argv[2]) if len(sys.argv) > 2 else 15
FACTOR = SIZE * (SIZE + 1) // 2      # sum over ranks of (rank + 1)
STEPS = 4

kv = mpi_kvstore.create('dist_mpi', design=DESIGN, autotune='0')
hvd.init(design=DESIGN, autotune='0')
tensor = st.tuples(st.sampled_from((1, 7, 256, 4096)),
                   st.sampled_from(('float32', 'float64', 'int32', 'int64', 'float16')),
                   st.sampled_from(('pushpull', 'hvd')))
EXAMPLES = iter(range(1 << 30))


def stats():
    """The bets of kv's design so far, or None for a design that does not negotiate."""
    repeat = getattr(kv._job.design, 'repeat', None)
    return None if repeat is None else dict(repeat.stats)


@settings(derandomize=True, database=None, deadline=None, max_examples=MAX_EXAMPLES,
          phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck),
          print_blob=False)
@given(st.lists(tensor, min_size=1, max_size=8), st.lists(st.integers(1, 4), min_size=1,
                                                          max_size=3))
def test_steps(program, cuts):
    example = next(EXAMPLES)
    digest = WORLD.allgather(zlib.crc32(repr((program, cuts)).encode()))
    assert len(set(digest)) == 1, 'ranks drew different steps: %s' % digest
    arrays = [mx.nd.zeros((count,), dtype=dtype) for count, dtype, _ in program]
    for step in range(STEPS):
        wanted = []
        for i, (count, dtype, api) in enumerate(program):
            base = (np.arange(count) + i + step) % 5
            arrays[i][:] = (base * (RANK + 1)).astype(dtype)
            average = api == 'hvd' and dtype in ('float32', 'float64', 'float16')
            wanted.append(base * (FACTOR / SIZE if average else FACTOR))
        at = 0
        for c, cut in enumerate(cuts):   # a burst, waited for before the next
            burst = range(at, len(program) if c == len(cuts) - 1 else min(at + cut, len(program)))
            for i in burst:
                _, dtype, api = program[i]
                name = 's%d.%d' % (example, i)
                if api == 'pushpull':
                    kv.pushpull(name, arrays[i])
                else:
                    average = dtype in ('float32', 'float64', 'float16')
                    hvd.allreduce_(arrays[i], name=name, op=hvd.Average if average else hvd.Sum)
            for i in burst:
                arrays[i].wait_to_read()
            at = burst.stop
        for i, (array, want) in enumerate(zip(arrays, wanted)):
            dtype = program[i][1]
            close(array.asnumpy(), want, 'step %d.%d tensor %d (%s)' % (example, step, i, dtype),
                  rtol=1e-3 if dtype == 'float16' else 1e-6, atol=0)


def lone(key, shape, dtype, value):
    x = mx.nd.full(shape, (RANK + 1) * value, dtype=dtype)
    kv.pushpull(key, x)
    close(x.asnumpy(), FACTOR * value, 'lone pushpull of %s %s %s' % (key, shape, dtype))


def counters():
    """{case: bets won and lost} of lone calls: repeated, then another shape, another dtype."""
    found = {}
    kv._barrier()    # not a betting round: no bet is armed from before
    before = stats()
    for i in range(5):
        lone('lone', (64,), 'float32', i + 1)
    found['repeated'] = _since(before)
    before = stats()
    lone('lone_shape', (65,), 'float32', 2)
    found['shape'] = _since(before)
    before = stats()
    for i in range(3):
        lone('lone', (64,), 'float32', i + 7)
    found['again'] = _since(before)
    before = stats()
    lone('lone_dtype', (64,), 'float64', 3)
    found['dtype'] = _since(before)
    return found


def _since(before):
    now = stats()
    return None if now is None else {k: now[k] - before[k] for k in now}


def bursts():
    """{case: bets won and lost} of steps of 3 bursts, each one list pushpull: warm, after
    two steps that learn the pattern, then a step whose middle burst has another key and shape."""
    shapes = [[('a%d' % i, (n,), 'float32') for i, n in enumerate((64, 1000, 7, 4096, 3))],
              [('b0', (5,), 'float64')] + [('b%d' % i, (256,), 'float32') for i in (1, 2, 3)],
              [('c%d' % i, (4096,), 'float32') for i in range(20)]]     # 320 KB
    changed = [shapes[0], [('b0x', (6,), 'float64')] + shapes[1][1:], shapes[2]]
    found = {}

    def step(bursts, value):
        for burst in bursts:
            keys = [key for key, _, _ in burst]
            xs = [mx.nd.full(shape, (RANK + 1) * value, dtype=dtype) for _, shape, dtype in burst]
            kv.pushpull(keys, xs)
            for x, (key, shape, dtype) in zip(xs, burst):
                close(x.asnumpy(), FACTOR * value, 'burst %s %s %s' % (key, shape, dtype))
    kv._barrier()
    for i in range(2):
        step(shapes, i + 1)
    before = stats()
    for i in range(4):
        step(shapes, i + 3)
    found['warm'] = _since(before)
    before = stats()
    step(changed, 9)
    found['changed'] = _since(before)
    return found


def mismatch():
    """An armed round whose calls differ in shape between ranks -> what was raised."""
    for i in range(3):
        lone('armed', (4,), 'float32', i + 1)
    odd = mx.nd.ones((4 + RANK,)) * (RANK + 1)
    said = None
    try:
        kv.pushpull('odd', odd)
        kv.wait()
    except mpi_kvstore.RankMismatchError as err:
        said = str(err)
    lone('after_odd', (3,), 'float32', 1)
    return said


test_steps()
kv.wait()
found = counters()
found_bursts = bursts()
said = mismatch()
report('kv_repeat_info', counters=found, bursts=found_bursts, mismatch=said, bets=stats())
done('kv_repeat[%s]' % DESIGN)
hvd.shutdown()
kv.close()
