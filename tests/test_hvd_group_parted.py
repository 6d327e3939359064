"""A grouped hvd.allreduce_ that one rank cuts into more engine ops than another (an aliased
or a sparse member: one op a tensor, against the group's one op elsewhere) fails on every
rank of the designs that agree op by op, naming both ranks' counts, and the calls queued
behind it run right; the designs that agree request by request run it (sums as numpy).
scenarios/hvd_group_parted.py, 2 ranks. On chained the ranks' agreements parted before
(the next call waited for a partner until the stall inspector)."""
import pytest

from mpi_kvstore.designs import NAMES

from mpi_harness import result, run_designs, run_mpi

_PARTS = 3   # aliased on rank 0, on rank 1, a sparse member on rank 1


def _assert_ran(out, design):
    name = 'hvd_group_parted[%s]' % design
    assert '%s: OK at 2 ranks' % name in out, out[-3000:]
    for seen in result(out, name)['ranks']:
        if design in ('chained', 'blocking'):
            assert seen['raised'] == ['RankMismatchError'] * _PARTS, seen['raised']
            for said in seen['said']:
                assert 'how many collectives one call issues' in said, said
                assert 'rank 0 issued' in said and 'rank 1 issued' in said, said
        else:
            assert seen['raised'] == [] and seen['said'] == [None] * _PARTS, seen
        # before, other, after, again of each part, and the parted call where it ran
        assert len(seen['checked']) >= _PARTS * 8, sorted(seen['checked'])
        for what, got in seen['checked'].items():
            shape, total = seen['expected'][what]
            assert got[0] == shape, what
            assert got[1] == pytest.approx(total, rel=1e-6), what


@pytest.mark.parametrize('design', NAMES)
def test_a_group_cut_into_more_ops_on_one_rank_fails_together(design, designs):
    _assert_ran(run_designs(2, 'hvd_group_parted.py', design, designs, timeout=120), design)


def test_a_parted_group_on_chained_python_ops():
    """The same on chained's Python op (native_ops off): its rest fails in
    Chained.agree_and_execute rather than by the native op's record."""
    _assert_ran(run_mpi(2, 'hvd_group_parted.py', 'chained', 'python', timeout=120), 'chained')
