"""The chained design's one function for a repeated call (Chained.again_direct, called
straight by the store through Job.again_direct): scenarios/chained_direct.py at 2 ranks on
the defaults. hvd.allreduce_ by name and unnamed, kv.pushpull per key and out-of-place
hvd.allreduce, in held bursts of 24 tensors of three dtypes, sum as numpy does at every
step. From the third step a burst makes one push through Chained._push (its first call,
the ops before it done) and none through Job.again: the other 23 calls are linked into the
burst by the one function. A call on a replaced array (another shape, or for a key a new
array) takes the full path and sums right, goes the general way once, then is back on the
one function. Job.again_direct is the design's own. Plus the done requests of Job's
pending dropped at the head only (chained._drop_done)."""
import collections
import types

import pytest

from mpi_kvstore.designs import chained

from mpi_harness import result, run_mpi

N = 24
HITS = {'hit': N}


def _expected(api):
    """[pushes, Job.again calls, linked, fastpath] of each step (scenario's docstring)."""
    first = [N, 0, 0 if api == 'copy' else N - 1, {} if api == 'kv' else {'miss': N}]
    # the second call keeps the plan: the general way (Job.again, kv: replay's submit)
    second = [N, 0 if api == 'kv' else N, N - 1, HITS]
    direct = [1, 0, N - 1, HITS]
    changed = [2, 0, N - 1, {'hit': N - 1} if api == 'kv' else {'miss': 1, 'hit': N - 1}]
    again = [2, 0 if api == 'kv' else 1, N - 1, HITS]   # the replaced one keeps its plan
    return [first, second, direct, direct, direct, changed, again, direct]


def test_repeated_calls_are_one_function_linked_and_right():
    out = run_mpi(2, 'chained_direct.py', timeout=300)
    assert 'chained_direct: OK at 2 ranks' in out, out[-3000:]
    for rank, said in enumerate(result(out, 'chained_direct')['ranks']):
        assert said['design'] == 'chained' and said['direct'] == [True, True], said
        assert said['checked'] == said['expected'], rank
        for api in ('named', 'unnamed', 'kv', 'copy'):
            assert said['steps'][api] == _expected(api), (rank, api, said['steps'][api])


@pytest.mark.unit
def test_done_requests_are_dropped_at_the_head_only():
    def reqs(*done):
        return collections.deque(types.SimpleNamespace(done=d, _done=d) for d in done)
    pending = reqs(True, True, True)
    chained._drop_done(pending)
    assert not pending
    pending = reqs(True, True, False, True)
    chained._drop_done(pending)
    assert [r.done for r in pending] == [False, True]
    pending = reqs(False, True)
    chained._drop_done(pending)
    assert [r.done for r in pending] == [False, True]


@pytest.mark.unit
def test_a_done_request_is_renumbered_in_place_only_after_a_clean_run():
    import numpy as np

    from mpi_kvstore.comm.collective import Collective
    model = Collective('allreduce', 'k', np.dtype('float32'), (4,))
    sig = model.numbered_sig(0)
    req = model.again(5, 0, sig, None)
    assert not req.again_in_place(6, sig)            # not done yet: its op runs
    req.finish()
    assert not req.again_in_place(6, sig + 1)        # another signature
    assert req.again_in_place(6, sig, array='new')   # a clean run: renumbered, not done
    assert (req.seq, req.done, req.array, req.sig) == (6, False, 'new', sig)
    for dirty in ('fail', 'attach', 'use_scratch', 'complete_with'):
        req = model.again(7, 0, sig, None)
        getattr(req, dirty)(object())
        req.finish()
        assert not req.again_in_place(8, sig) and req.seq == 7, dirty
