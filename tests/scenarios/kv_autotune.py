"""autotune under mpiexec: ranks of different local timings switch at the same round to the
same values, with every sum exact before, during and after the switches.

For each design given (funneled, concurrent), one store with autotune on, and
fusion_threshold and credit_bytes set by argument (so they must stay). Each rank's step sleeps a time of its
own (rank-dependent), plus a penalty on the last rank while partition_bytes is 0, so the
search has a known answer: pieces.
Every step pushpulls keys of which one is cut into pieces by partition_bytes=1M,
and every result equals numpy's sum of what each rank contributed (small integers in
float32: exact in any order). Then: every rank holds the same switches (round and values),
none of them touched what was set, the last one before settling, some steps ran before
the first and after the last; the tune table's schedule holds the choice, and a store made
next from that table, without autotune, starts from it. Last, ranks that join after
different numbers of steps: sums over the active ranks, no hang, the same switches.

usage: kv_autotune.py TABLE_PATH DESIGN [DESIGN ...]
"""
import json
import logging
import sys
import time

import mxnet as mx
import numpy as np

import mpi_kvstore
from mpi_kvstore.comm import tuning

from common import RANK, SIZE, WORLD, done

TABLE = sys.argv[1]
DESIGNS = sys.argv[2:] or ['funneled']
KEYS = {'a': 300007, 'b': 1000, 'c': 7001}   # elements: 'a' (1.2 MB) is cut by 1M pieces
PENALTY = 0.1    # seconds: above a busy 2-core VM's noise in the median step

logging.basicConfig(level=logging.INFO, stream=sys.stdout, format='%(message)s')


def data(rank, step, key):
    """Small integers in float32, cheap to make: their sums are exact in any order."""
    return ((np.arange(KEYS[key]) * (rank + 1) + step) % 101 - 50).astype(np.float32)


def expected(step, key):
    return sum(data(r, step, key).astype(np.float64) for r in range(SIZE)).astype(np.float32)


def step_cost(values):
    """This rank's compute, by the values in use: rank-dependent, and slow on the last
    rank while partition_bytes is 0, so the search has a known answer on every rank."""
    return 0.002 * (RANK + 1) + (PENALTY if RANK == SIZE - 1 and
                                 values['partition_bytes'] == 0 else 0.0)


def run(kv, step):
    for i, key in enumerate(KEYS):
        out = mx.nd.zeros(KEYS[key])
        kv.pushpull(key, mx.nd.array(data(RANK, step, key)), out=out, priority=-i)
        got = out.asnumpy()
        if not np.array_equal(got, expected(step, key)):
            raise AssertionError('rank %d: step %d key %s: got %s, expected %s'
                                 % (RANK, step, key, got[:4], expected(step, key)[:4]))


def tune(design):
    kv = mpi_kvstore.create('dist_mpi', design=design, autotune=True, autotune_steps=1,
                            fusion_threshold='1M', credit_bytes='2M', tune_table=TABLE)
    state = kv.autotune_state
    assert state.free == ('partition_bytes', 'progress_sleep_us'), state.free
    step, settled_at, first_switch = 0, None, None
    while step < state.bound + 5 and (settled_at is None or step < settled_at + 3):
        time.sleep(step_cost(state.values))
        run(kv, step)
        state = kv.autotune_state
        if first_switch is None and state.switches:
            first_switch = step
        if settled_at is None and not state.active:
            settled_at = step
        step += 1
    kv.close()
    state = kv.autotune_state
    if RANK == 0:
        print('kv_autotune[%s]: settled at step %d of %d (bound %d), first switch at step %d'
              % (design, settled_at, step, state.bound, first_switch), flush=True)
    assert settled_at is not None, 'rank %d: not settled in %d steps' % (RANK, step)
    assert first_switch is not None and first_switch > 0, first_switch   # sums before it too
    switches = WORLD.allgather(state.switches)
    assert all(s == switches[0] for s in switches), switches
    assert all(set(values) <= set(state.free) for _, values in state.switches), state.switches
    chosen = WORLD.allgather(state.values)
    assert all(c == chosen[0] for c in chosen), chosen
    assert state.values['partition_bytes'] > 0, state.values
    assert (state.values['fusion_threshold'], state.values['credit_bytes']) == (1 << 20, 2 << 20)
    return state.values, state.free


def next_run(design, current, free):
    with open(TABLE) as fh:
        schedule = json.load(fh)['schedule']
    assert schedule == {k: current[k] for k in free}, (schedule, current)
    kv = mpi_kvstore.create('dist_mpi', design=design, tune_table=TABLE)
    assert {k: getattr(kv.config, k) for k in free} == schedule, kv.config
    run(kv, 0)
    kv.close()


def join(design):
    """Rank r steps 6 + 3r times, then joins: the checks go on with joined ranks in them
    (a joined rank measures no steps, so no sample completes meanwhile), the sums cover the
    active ranks, and after the join every rank steps and tunes on, still alike."""
    kv = mpi_kvstore.create('dist_mpi', design=design, autotune=True, autotune_steps=1)
    for step in range(6 + 3 * RANK):
        active = [r for r in range(SIZE) if step < 6 + 3 * r]
        out = mx.nd.zeros(KEYS['c'])
        kv.pushpull('c', mx.nd.array(data(RANK, step, 'c')), out=out)
        want = sum(data(r, step, 'c').astype(np.float64) for r in active).astype(np.float32)
        assert np.array_equal(out.asnumpy(), want), (RANK, step, kv.autotune_state)
    assert kv.join() == SIZE - 1
    for step in range(3):
        run(kv, 100 + step)
    kv.close()
    switches = WORLD.allgather(kv.autotune_state.switches)
    assert all(s == switches[0] for s in switches), switches
    if RANK == 0:
        print('kv_autotune[%s]: join: %d switches, at rounds %s'
              % (design, len(switches[0]), [r for r, _ in switches[0]]), flush=True)


def main():
    if RANK == 0:
        with open(TABLE, 'w') as fh:
            json.dump(tuning.Table([1024], ['mpi'], SIZE).to_json(), fh)
    WORLD.Barrier()
    for design in DESIGNS:
        current, free = tune(design)
        WORLD.Barrier()
        next_run(design, current, free)
        join(design)
        done('kv_autotune[%s]' % design)


main()
