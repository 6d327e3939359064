"""The chained design's repeated calls (a prepared call: store.namecache.Batch) keep their
plan and take their last op's record again once it was reaped (records.ChainedOp.again),
instead of a copy of the plan's record per call: one process, so every sum is the value
itself, as numpy has it. A priority that changes makes a new plan for it; an array that
changes takes the full path (a new prepared call)."""
import mxnet as mx
import numpy as np
import pytest

import mpi_kvstore

pytestmark = pytest.mark.unit

KEYS, STEPS, N = 3, 8, 256


def _kept(kv, key):
    return kv._calls.pushpull[key].prepared.kept


def _step(kv, xs, step, priority=0):
    for k, x in enumerate(xs):
        x[:] = np.arange(N, dtype=np.float32) * (step + 1) + k
        kv.pushpull(k, x, priority=priority - k)
    kv.wait()
    for k, x in enumerate(xs):
        np.testing.assert_array_equal(x.asnumpy(), np.arange(N, dtype=np.float32) * (step + 1) + k)


def test_a_repeated_call_takes_its_records_again_and_sums_right():
    kv = mpi_kvstore.create('dist_mpi', design='chained', autotune='0')
    try:
        assert kv._job.design.name == 'chained' and kv._job.design._native
        xs = [mx.nd.zeros((N,)) for _ in range(KEYS)]
        records = {k: [] for k in range(KEYS)}
        for step in range(STEPS):
            _step(kv, xs, step)
            if step >= 2:   # prepared from the second call, one function from the third
                for k in range(KEYS):
                    kept = _kept(kv, k)
                    assert kept.priority == -k and kept.plan is not None
                    records[k].append(kept.op.address)
        for k, found in records.items():
            # the op and its spare, taken again step after step (each waited for and reaped)
            assert len(set(found)) <= 2 and len(found) == STEPS - 2, (k, found)

        plan = _kept(kv, 0).plan
        _step(kv, xs, STEPS, priority=5)      # another priority: full path, then a new plan
        _step(kv, xs, STEPS + 1, priority=5)
        _step(kv, xs, STEPS + 2, priority=5)
        kept = _kept(kv, 0)
        assert kept.priority == 5 and kept.plan is not plan

        xs[0] = mx.nd.zeros((N,))             # another array: the full path, prepared anew
        for step in range(STEPS + 3, STEPS + 6):
            _step(kv, xs, step, priority=5)
        assert _kept(kv, 0).op.arrays[0] is xs[0]
    finally:
        kv.close()
