"""Bursts of small collectives (scenarios/kv_burst.py), on every design: random bursts of
mixed sizes, dtypes, priorities and APIs (kv.pushpull of a key or a list, hvd.allreduce_,
hvd.grouped_allreduce_), whose data each rank finds ready in an order of its own, sum as
numpy does; a mismatch in a burst fails on every rank naming every rank's shape; the fast
paths of repeated calls say they ran and fall back on another shape or dtype; an idle
store's negotiation thread uses no CPU. About 15-30 s a design at 2 ranks on the 2-core VM.
"""
import pytest

from mpi_kvstore.designs import NAMES, NEGOTIATED_NAMES

from mpi_harness import result, run_designs, run_mpi


def check(out, design, nprocs):
    assert 'kv_burst[%s]: OK at %d ranks' % (design, nprocs) in out, out[-3000:]
    sums = result(out, 'kv_burst[%s]' % design)['ranks']
    for rank, seen in enumerate(sums):
        bursts = {what: got for what, got in seen['checked'].items() if what.startswith('burst')}
        assert len(bursts) >= 20, (rank, sorted(bursts))   # the draws reached many tensors
        for what, got in seen['checked'].items():
            assert got == seen['expected'][what], (rank, what, got, seen['expected'][what])
    info = result(out, 'kv_burst_info')['ranks']
    shapes = ['rank %d has shape (%d,) float32' % (r, 4 + r) for r in range(nprocs)]
    for rank, said in enumerate(info):
        assert said['mismatch'] is not None, rank
        assert 'ranks disagree on' in said['mismatch'] and "key 'm5'" in said['mismatch']
        for words in shapes:
            assert words in said['mismatch'], (rank, words, said['mismatch'])
        assert said['cache'] == {'hit': 3}, said['cache']
        assert said['named'] == {'same': {'hit': 1}, 'shape': {'miss': 1},
                                 'dtype': {'miss': 1}, 'twice': {'miss': 1, 'staged': 1},
                                 'views': {'miss': 2}}, said
        if design in NEGOTIATED_NAMES:
            # blocked on its waker without a timeout: no tick in a second (one at most, as
            # the tick that the sleep's start shared with the last round)
            assert said['idle_ticks'] is not None and said['idle_ticks'] <= 1, said
        else:
            assert said['idle_ticks'] is None, said


@pytest.mark.parametrize('design', NAMES)
def test_bursts_sum_right_and_mismatches_fail_everywhere(design, designs):
    out = run_designs(2, 'kv_burst.py', design, designs, '20', timeout=240)
    check(out, design, 2)


@pytest.mark.parametrize('design', ['funneled', 'chained'])
def test_bursts_at_three_ranks(design, mpi_available):
    out = run_mpi(3, 'kv_burst.py', design, '10', timeout=300)
    check(out, design, 3)


def test_dense_meta_reads_dense_arrays_and_refuses_the_rest():
    """The in-place test of named allreduces (engine.arrays.dense_meta), from metadata alone:
    a dense array or a slice of one gives its shape, dtype and place; a sparse array gives
    None (it travels through a staging copy); a fresh array whose op has not run yet is not
    allocated by the question (its memory is only read inside the op that holds it)."""
    import mxnet as mx
    import numpy as np

    from mpi_kvstore.engine.arrays import dense_meta

    for dtype in ('float16', 'float32', 'float64', 'int32', 'int64', 'int8', 'uint8'):
        assert dense_meta(mx.nd.ones((3, 5), dtype=dtype)) == ((3, 5), np.dtype(dtype), 'cpu')
    assert dense_meta(mx.nd.ones((6, 3))[2:4]) == ((2, 3), np.dtype('float32'), 'cpu')
    assert dense_meta(mx.nd.ones((4, 3)).tostype('row_sparse')) is None
    assert dense_meta(mx.nd.ones((4, 3)).tostype('csr')) is None
    fresh = mx.nd.empty((2, 2))
    assert dense_meta(fresh) == ((2, 2), np.dtype('float32'), 'cpu')
    fresh[:] = 3
    assert fresh.asnumpy().tolist() == [[3, 3], [3, 3]]
