"""The records of unnamed hvd.allreduce_ calls (store/collectives.py: again_unnamed,
remember_unnamed; store/repeats.py: Unnamed), found by the tensor, are bounded: at most name_cache_capacity entries
and _UNNAMED_BYTES of arrays, the least recently used dropped first; a dropped tensor's
next call takes the full path and sums right, then its one-function path again. A repeated
out-of-place hvd.allreduce on the chained design plans nothing (the store's plan cache stays
the same size: its prepared call moves to each new copy) and every result, a new array,
holds its own values. One process, so every sum is the value itself, as numpy has it."""
import mxnet as mx
import numpy as np
import pytest

import mpi_kvstore.horovod as hvd
from mpi_kvstore import debug
from mpi_kvstore.store import repeats

pytestmark = pytest.mark.unit

N = 16


def _call(tensor, step):
    """An unnamed allreduce_ of new values -> its 'again' and 'fastpath' counts."""
    want = np.arange(N, dtype=np.float32) * (step + 1)
    tensor[:] = want
    before = debug.snapshot()
    hvd.allreduce_(tensor, op=hvd.Sum)
    np.testing.assert_array_equal(tensor.asnumpy(), want)
    return debug.since(before, 'again'), debug.since(before, 'fastpath')


def test_alternating_unnamed_tensors_are_taken_again_by_tensor(hvd_chained):
    a, b = mx.nd.zeros((N,)), mx.nd.zeros((N,))
    assert _call(a, 0) == ({}, {'miss': 1}) and _call(b, 1) == ({}, {'miss': 1})
    for step in range(2, 8):
        assert _call(b if step % 2 else a, step) == ({'unnamed': 1}, {'hit': 1})


def test_unnamed_records_are_bounded_by_entries_least_recently_used_first(hvd_chained):
    kept = hvd_chained.collectives
    kept._unnamed.max = 2
    a, b, c = (mx.nd.zeros((N,)) for _ in range(3))
    for step, t in enumerate((a, b)):
        assert _call(t, step)[0] == {}
    assert _call(a, 2)[0] == {'unnamed': 1}   # a now the most recently used
    assert _call(c, 3)[0] == {}               # in: b (the least recently used) out
    assert list(kept._unnamed.entries) == [id(a), id(c)]
    assert _call(b, 4) == ({}, {'miss': 1})   # the full path; in again, a out
    assert list(kept._unnamed.entries) == [id(c), id(b)]
    assert _call(b, 5)[0] == {'unnamed': 1} and _call(c, 6)[0] == {'unnamed': 1}
    assert kept._unnamed.nbytes == 2 * N * 4


def test_unnamed_records_are_bounded_by_bytes(hvd_chained, monkeypatch):
    kept = hvd_chained.collectives
    monkeypatch.setattr(repeats, '_UNNAMED_BYTES', 3 * N * 4)
    small = [mx.nd.zeros((N,)) for _ in range(4)]
    for step, t in enumerate(small):
        assert _call(t, step)[0] == {}
    assert list(kept._unnamed.entries) == [id(t) for t in small[1:]]   # 3 arrays' bytes: first out
    assert kept._unnamed.nbytes == 3 * N * 4
    big = mx.nd.zeros((4 * N,))   # more than the bound: never kept, the others stay
    want = np.arange(4 * N, dtype=np.float32)
    for _ in range(2):
        big[:] = want
        before = debug.snapshot()
        hvd.allreduce_(big, op=hvd.Sum)
        np.testing.assert_array_equal(big.asnumpy(), want)
        assert debug.since(before, 'again') == {}
    assert list(kept._unnamed.entries) == [id(t) for t in small[1:]]
    assert _call(small[0], 9) == ({}, {'miss': 1})   # dropped: the full path, right
    assert _call(small[0], 10)[0] == {'unnamed': 1}
    assert kept._unnamed.nbytes == 3 * N * 4


def test_repeated_out_of_place_calls_plan_nothing_new(hvd_chained):
    design = hvd_chained._job.design
    x = mx.nd.zeros((N,))
    outs = []
    for step in range(10):
        x[:] = np.arange(N, dtype=np.float32) + step
        before = debug.snapshot()
        outs.append(hvd.allreduce(x, name='c', op=hvd.Sum))
        assert debug.since(before, 'again') == ({'copy': 1} if step else {})
        if step == 2:
            plans = len(design._plans)
    assert len(design._plans) == plans
    for step, out in enumerate(outs):   # each call's copy, its own values
        assert out is not x
        np.testing.assert_array_equal(out.asnumpy(), np.arange(N, dtype=np.float32) + step)
    np.testing.assert_array_equal(x.asnumpy(), np.arange(N, dtype=np.float32) + 9)
