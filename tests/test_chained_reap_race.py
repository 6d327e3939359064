"""Chained.reap on one thread (the stall inspector's, or a waiter's) while the user's thread
repeats a prepared call: the reaper marks an op reaped (records.ChainedOp.forget), and from
then on the user's thread may take that op's record again for its next call
(Chained._kept_op, ChainedOp.again: new requests, the record copied from the plan). The
reaper must have read what it needs of the op (its requests, its FUSED word) before: else
it marks the new call's requests done before they ran (the caller reads its array
unreduced) and never the old ones (a wait on them never ends). The interleaving is forced
here: the user's thread takes the op again right after forget, where a thread switch may
come."""
import collections
import threading
import types

import numpy as np
import pytest

from mpi_kvstore.designs import chained
from mpi_kvstore.engine import layout, records

pytestmark = pytest.mark.unit


class _RacedOp(records.ChainedOp):
    """A ChainedOp (no engine op behind it) whose ``forget`` runs ``then`` right after it
    marked the op reaped: the user's thread coming in there."""

    __slots__ = ('then',)

    def forget(self):
        super().forget()
        then, self.then = self.then, None
        if then is not None:
            then()


def _no_python(op):   # no hand-over comes: nothing runs
    return None


def _req():
    return types.SimpleNamespace(_done=False)


def test_a_reaped_op_taken_again_meanwhile_finishes_its_own_requests():
    plan = types.SimpleNamespace(record=np.zeros(layout.HEADER, dtype=np.int64))
    plan.words = memoryview(plan.record)
    op = object.__new__(_RacedOp)
    op.record = plan.record.copy()
    op.words = memoryview(op.record)
    op.record[layout.STATE] = layout.DONE
    op.record[layout.FUSED] = 3         # it led a round of 3 (itself and 2 absorbed)
    op._address = op.record.ctypes.data
    op.record[layout.SELF] = op._address
    op.arrays, op.keep, op._spans, op._on_python, op.param = [], None, [], _no_python, None
    old = [_req(), _req()]
    op.reqs, op.reaped = old, False

    design = object.__new__(chained.Chained)
    design._inflight = collections.deque([op])
    design._reap_lock = threading.Lock()
    kept = chained._Kept(plan, 0, 'allreduce')
    kept.op = op
    prepared = types.SimpleNamespace(arrays=[])
    new = [_req(), _req()]
    taken = []
    op.then = lambda: taken.append(design._kept_op(kept, prepared, new))
    counted = []
    real_count = chained.debug.count
    chained.debug.count = lambda *a: counted.append(a)
    try:
        design.reap()
    finally:
        chained.debug.count = real_count
        records._state.fallbacks.pop(op._address, None)
    assert taken == [op] and op.reqs is new   # the user's thread took the record again
    assert [r._done for r in old] == [True, True]    # the reaped op's requests finished
    assert [r._done for r in new] == [False, False]  # not the call that has not run yet
    assert ('fuse', 'led', 1) in counted and ('fuse', 'absorbed', 2) in counted
