"""Bursts of repeated out-of-place allreduces (hvd.allreduce, functional.allreduce) on every
design at 2 ranks (scenarios/hvd_copy_burst.py): each repeat copies its input at its push
(engine.records.CopyNow) or, where the input is being written, after that write; every
result holds its sum (numpy), every input is left as it was, mixed with in-place calls and
with an input written by an engine op between calls; a changed shape in the middle of a
burst sums right; a rank's mismatched call fails on every rank naming both shapes, on the
array the caller holds, and the next burst sums right. On chained a burst of them fuses:
calls link behind the burst's leader ('fuse' 'linked' > 0; 0 before, when each copy was an
MXNet op still pending at the collective's push)."""
import pytest

from mpi_kvstore.designs import NAMES

from mpi_harness import result, run_designs


@pytest.mark.parametrize('design', NAMES)
def test_out_of_place_bursts_sum_right_and_fuse(design, designs):
    out = run_designs(2, 'hvd_copy_burst.py', design, designs, timeout=240)
    name = 'hvd_copy_burst[%s]' % design
    assert '%s: OK at 2 ranks' % name in out, out[-3000:]
    for seen in result(out, name)['ranks']:
        assert [c['copy'] for c in seen['counts']] == [48] * 3, seen['counts']
        assert seen['changes'] == 10
        if design == 'chained':
            assert all(n > 0 for n in seen['linked']) and sum(seen['linked']) >= 30, \
                seen['linked']
        assert seen['raised'] == ['RankMismatchError']
        said = seen['said']
        assert 'rank 0 has shape (16,) float32' in said, said
        assert 'rank 1 has shape (17,) float32' in said, said
        read = seen['read']
        if design == 'blocking':   # raises in the call: no array was handed back
            assert read == [], read
        else:
            assert len(read) == 1 and (read[0] == 'poisoned' or (
                'rank 0 has shape (16,) float32' in read[0]
                and 'rank 1 has shape (17,) float32' in read[0])), read
        # rank 1's other input became the name's record where its call was submitted
        assert seen['after']['copy'] >= 5, seen['after']
        assert len(seen['checked']) >= 200
        for what, got in seen['checked'].items():
            shape, total = seen['expected'][what]
            assert got[0] == shape, what
            assert got[1] == pytest.approx(total, rel=1e-6), what
