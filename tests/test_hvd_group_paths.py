"""A grouped hvd.allreduce_ that one rank repeats (one engine op) while another takes the
full path stays paired on every design (scenarios/hvd_group_paths.py, 2 ranks): the sums are
numpy's on every step, and a group whose ranks give different scale factors fails on every
rank, naming both, with the group's next calls right. On the chained design this hung
before (the full path pushed one op a tensor)."""
import pytest

from mpi_kvstore.designs import NAMES

from mpi_harness import result, run_designs


@pytest.mark.parametrize('design', NAMES)
def test_a_group_repeated_on_one_rank_and_new_on_another_stays_paired(design, designs):
    out = run_designs(2, 'hvd_group_paths.py', design, designs, timeout=240)
    name = 'hvd_group_paths[%s]' % design
    assert '%s: OK at 2 ranks' % name in out, out[-3000:]
    for rank, seen in enumerate(result(out, name)['ranks']):
        paths = seen['paths']
        # the repeats took again_group's one op; rank 1's call on a new array did not
        assert paths[1].get('group') == 1, paths
        assert paths[2].get('group') == (1 if rank == 0 else None), paths
        assert paths[4].get('group') == 1, paths
        assert seen['raised'] == ['RankMismatchError']
        said = seen['said']
        assert 'rank 0 has' in said and 'rank 1 has' in said, said
        assert '2.0' in said and '3.0' in said, said
        assert len(seen['checked']) == 24   # 4 checks of 3 tensors in each part
        for what, got in seen['checked'].items():
            shape, total = seen['expected'][what]
            assert got[0] == shape, what
            assert got[1] == pytest.approx(total, rel=1e-6), what
