"""Hypothesis property test of the store at 2 ranks, for every design.

Random sequences of valid and invalid calls (scenarios/kv_property.py): every
result equals numpy's, every rejected call raises a clear error and leaves no
trace, and the store stays usable. 150 examples per design: 7-30 s a job on
the 2-core VM.
"""
import pytest

from mpi_kvstore.designs import NAMES as DESIGNS

from mpi_harness import result, run_designs


@pytest.mark.parametrize('design', DESIGNS)
def test_random_calls_match_numpy_and_rejections_leave_no_trace(design, designs):
    out = run_designs(2, 'kv_property.py', design, designs, timeout=240)
    assert 'kv_property[%s]: OK' % design in out, out[-2000:]
    ranks = result(out, 'kv_property[%s]' % design)['ranks']
    for rank in ranks:      # both ranks ran the same program of calls
        assert {k: rank[k] for k in ('examples', 'calls', 'rejected', 'by_fault')} == {
            k: ranks[0][k] for k in ('examples', 'calls', 'rejected', 'by_fault')}
    stats = ranks[0]
    assert stats['examples'] > 0 and stats['calls'] > stats['examples'], stats
    # valid calls and rejected ones of several kinds, every one counted once
    assert stats['by_fault']['valid'] == stats['calls'] - stats['rejected'] > 0, stats
    assert len(stats['by_fault']) > 2 and sum(stats['by_fault'].values()) == stats['calls']
