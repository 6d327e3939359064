"""The chained design fuses a burst (scenarios/chained_fuse.py): held bursts of mixed
sizes, dtypes, priorities and APIs sum as numpy does, and the counters say that each op
ran the FUSE_OPS calls after it, every call but a store's first linked (one engine op);
none does where the calls' arrays were busy when they were made, on every rank or on rank
0 only, where the rounds still line up; a shape that differs in the middle of a burst fails
on every rank naming both shapes, while the calls around it run fused. About 40 s at 2
ranks on the 2-core VM.
"""
import pytest

from mpi_harness import result, run_mpi


@pytest.mark.parametrize('nprocs', [2, 3])
def test_bursts_fuse_and_sum_right(nprocs, mpi_available):
    out = run_mpi(nprocs, 'chained_fuse.py', '12' if nprocs == 2 else '4', timeout=400)
    assert 'chained_fuse: OK at %d ranks' % nprocs in out, out[-3000:]
    for rank, seen in enumerate(result(out, 'chained_fuse')['ranks']):
        assert len(seen['checked']) >= 100, (rank, len(seen['checked']))
        for what, got in seen['checked'].items():
            assert got == seen['expected'][what], (rank, what, got, seen['expected'][what])
    shapes = ['rank %d has shape (%d,) float32' % (r, 4 + r) for r in range(nprocs)]
    for rank, said in enumerate(result(out, 'chained_fuse_info')['ranks']):
        assert max(said['seen']) > 32, said['seen']     # runs of more than one op's share
        assert said['busy'] == {'busy': 1}, said['busy']
        assert said['busy0'] == ({'busy': 1} if rank == 0 else {'linked': 9}), (
            rank, said['busy0'])
        assert said['mismatch_counts'] == {'led': 2, 'absorbed': 4, 'linked': 6}, said
        assert said['mismatch'] is not None and "key 'm3'" in said['mismatch'], said
        for words in shapes:
            assert words in said['mismatch'], (rank, words, said['mismatch'])
