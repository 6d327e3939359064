"""Repeated hvd.allreduce (out of place) and unnamed hvd.allreduce_ on their one-function
paths (scenarios/hvd_unnamed.py, every design at 2 ranks): alternating unnamed tensors are
each taken again by their tensor ('again': 'unnamed' from their second call); a burst of
repeated out-of-place calls sums right with every result its own array ('again': 'copy'),
and on the chained design plans nothing new (its plan cache the same size after 3 and 12
calls: the prepared call moves to each new copy); an input of another shape or dtype under
one name falls back (fastpath 'miss') and sums right. A repeated call meeting another shape
fails on every rank naming both shapes, on the array the caller holds (its read raises the
error or returns the poison), and the next calls sum right on their one-function path."""
import pytest

from mpi_kvstore.designs import NAMES

from mpi_harness import result, run_designs


@pytest.mark.parametrize('design', NAMES)
def test_unnamed_and_out_of_place_repeats_sum_right_on_their_paths(design, designs):
    out = run_designs(2, 'hvd_unnamed.py', design, designs, timeout=240)
    name = 'hvd_unnamed[%s]' % design
    assert '%s: OK at 2 ranks' % name in out, out[-3000:]
    for rank, seen in enumerate(result(out, name)['ranks']):
        assert seen['unnamed'] == [{}] + [{'unnamed': 3}] * 3, seen['unnamed']
        assert seen['copies'] == {'copy': 4 * 11}, seen['copies']
        if design == 'chained':
            assert len(seen['plans']) == 2 and seen['plans'][0] == seen['plans'][1], \
                seen['plans']
        assert seen['changed'] == [{'miss': 1}] * 4, seen['changed']
        assert seen['raised'] == ['RankMismatchError'] * 2
        for what in ('copy', 'unnamed'):
            said = seen[what + '_said']
            assert 'rank 0 has shape (16,) float32' in said, said
            assert 'rank 1 has shape (17,) float32' in said, said
            # blocking raises in the call: no array was handed back
            read = seen[what + '_read']
            if design == 'blocking':
                assert read == [], read
            else:
                assert len(read) == 1 and (read[0] == 'poisoned' or (
                    'rank 0 has shape (16,) float32' in read[0]
                    and 'rank 1 has shape (17,) float32' in read[0])), read
        # rank 1's other array became the name's record where the call was submitted (as
        # kv_copy: test_kv_fastpath); the unnamed records are the tensors' own
        kept = rank == 0 or design == 'blocking'
        assert seen['copy_after'] == ([{'copy': 1}] * 2 if kept else [{}, {'copy': 1}])
        assert seen['unnamed_after'] == [{'unnamed': 1}] * 2, seen['unnamed_after']
        assert len(seen['checked']) >= 30
        for what, got in seen['checked'].items():
            shape, total = seen['expected'][what]
            assert got[0] == shape, what
            assert got[1] == pytest.approx(total, rel=1e-6), what
