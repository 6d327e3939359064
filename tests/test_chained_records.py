"""The chained design's repeated calls (a prepared call: store.namecache.Batch) keep their
plan and take their last op's record again once it was reaped (records.ChainedOp.again;
Chained.again_direct inlines it),
instead of a copy of the plan's record per call: one process, so every sum is the value
itself, as numpy has it. A priority that changes makes a new plan for it; an array that
changes takes the full path (a new prepared call). A repeat at its kept plan's priority is
one function from the store to the push (Chained.again_direct, Job.again_direct). Where the op before a call is not
DONE yet but its burst's walk closed its link, the ops caught up: the design tries fusing
again (Chained._push)."""
import collections
import types

import mxnet as mx
import numpy as np
import pytest

import mpi_kvstore
from mpi_kvstore.designs import chained
from mpi_kvstore.engine import layout

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


def test_a_repeated_call_takes_its_records_again_and_sums_right(monkeypatch):
    taken = collections.Counter()   # Chained.again_direct's answers: True, the one-function path
    again = chained.Chained.again_direct

    def counted(self, prepared, models, priority, pending):
        done = again(self, prepared, models, priority, pending)
        taken[done] += 1
        return done
    monkeypatch.setattr(chained.Chained, 'again_direct', counted)
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
        # from the third call a key's repeats are Chained.again_direct's (the second keeps the plan)
        assert taken == {True: KEYS * (STEPS - 2)}, taken
        assert _kept(kv, 0).sigs == [kv._calls.pushpull[0].models[0].numbered_sig(0)]

        plan = _kept(kv, 0).plan
        _step(kv, xs, STEPS, priority=5)      # another priority: full path, then a new plan
        _step(kv, xs, STEPS + 1, priority=5)
        _step(kv, xs, STEPS + 2, priority=5)
        kept = _kept(kv, 0)
        assert kept.priority == 5 and kept.plan is not plan
        assert taken[False] == KEYS   # the first repeat at 5 declined: a new plan kept

        xs[0] = mx.nd.zeros((N,))             # another array: the full path, prepared anew
        for step in range(STEPS + 3, STEPS + 6):
            _step(kv, xs, step, priority=5)
        assert _kept(kv, 0).op.arrays[0] is xs[0]
    finally:
        kv.close()


class _Op:
    """What Chained._push reads and writes of an op (records.ChainedOp)."""

    def __init__(self, done=False, next_=0, leads=1):
        self.record = np.zeros(layout.HEADER, dtype=np.int64)
        self.words = memoryview(self.record)   # as ChainedOp.words
        self.record[layout.NEXT], self.record[layout.LEADS] = next_, leads
        self.record[layout.STATE] = layout.DONE if done else layout.PENDING
        self.param, self.address, self._address, self.follow = None, 0, id(self), None

    def pushed_from(self, thread, priority, after=None):
        self.record[layout.PUSHER], self.record[layout.PRIORITY] = thread, priority

    def let_go(self):
        self.record[layout.STARTED] = 0


def _pushing(monkeypatch, prev, probing):
    """A chained design's _push state after ``prev`` (pending unless done), and the pushes
    it makes, by kind."""
    pushes = []
    monkeypatch.setattr(chained.engine, 'push_op', lambda *a: pushes.append('chained'))
    monkeypatch.setattr(chained.engine, 'inline_push',
                        lambda *a: lambda: pushes.append('follow') or 0)
    design = object.__new__(chained.Chained)
    design._inflight = collections.deque([prev])
    design._tail, design._probing, design._inline_max = prev, probing, -1
    design._chained_fn = design._follow_fn = None
    plan = types.SimpleNamespace(leads=True, nbytes=16384, handles=None, follow_handles=None)
    design._push(_Op(), plan, [], 0, b'x')
    return design, pushes


def test_a_closed_walk_means_the_ops_caught_up(monkeypatch):
    # prev not DONE yet (its engine completion woke the caller's wait first) but its walk
    # closed its link: no walk takes this call, so the design fuses the next ones again
    design, pushes = _pushing(monkeypatch, _Op(next_=layout.CLOSED), probing=False)
    assert design._probing and pushes == ['chained']
    # a walk still open, after a busy call: no fusing until the ops catch up
    design, pushes = _pushing(monkeypatch, _Op(), probing=False)
    assert not design._probing and pushes == ['chained']
    # a walk still open while probing: a follow op is tried first (here it finds its
    # arrays busy: STARTED stays 0), then the chained op
    design, pushes = _pushing(monkeypatch, _Op(), probing=True)
    assert not design._probing and pushes == ['follow', 'chained']
    # prev DONE: caught up
    design, pushes = _pushing(monkeypatch, _Op(done=True), probing=False)
    assert design._probing and pushes == ['chained']
