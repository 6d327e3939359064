"""Ranks that disagree get a RankMismatchError naming what every rank issued, once.

tests/scenarios/kv_mismatch.py makes each mismatch (shape, dtype, broadcast root, kind,
with a joined rank at 3 ranks, and in the designs whose agreement covers one call, the count of keys in a call); each
rank prints the error it caught as Python prints an uncaught one. The words expected
here are written out for 2 and 3 ranks from what the scenario issues on each rank.
"""
import pytest

from mpi_kvstore.designs import NAMES

from mpi_harness import run_mpi

GROUP_DESIGNS = ('chained', 'blocking')   # one call is one agreement: its count is checked


def expected(case, nprocs):
    """What the message says each rank issued (the scenario's docstring says why)."""
    if case == 'shape':
        return ', '.join('rank %d has shape (%d,) float32' % (r, 3 + r) for r in range(nprocs))
    if case == 'joined':   # the last rank joined: it is not named
        return ', '.join('rank %d has shape (%d,) float32' % (r, 3 + r) for r in range(nprocs - 1))
    if case == 'dtype':
        dtypes = ('float32', 'float64', 'int32')
        return ', '.join('rank %d has shape (4,) %s' % (r, dtypes[r]) for r in range(nprocs))
    others = 'rank 1 has' if nprocs == 2 else 'ranks 1, 2 have'
    if case == 'root':
        zeros = 'rank 0 has' if nprocs == 2 else 'ranks 0, 2 have'
        return '%s root 0, rank 1 has root 1' % zeros
    if case == 'kind':
        return 'rank 0 has allreduce, %s bcast' % others
    assert case == 'count'
    return ', '.join(["rank 0 issued 2 (keys 'c0', 'c1')"] + [
        "rank %d issued 3 (keys 'c0', 'c1', 'c2')" % r for r in range(1, nprocs)])


HEADS = {'shape': "collective #0 (allreduce of key 'w'): ",
         'dtype': "collective #2 (allreduce of key 'd'): ",
         'root': "collective #4 (bcast of key 'b', shape (4,) float32): ",
         'kind': "collective #6 (key 'k', shape (4,) float32): ",
         'joined': "collective #8 (allreduce of key 'j'): ",
         'count': 'how many collectives one call issues: '}


@pytest.mark.parametrize('nprocs', [2, 3], ids=lambda n: 'np%d' % n)
@pytest.mark.parametrize('design', NAMES)
def test_mismatch_names_every_rank_once(design, nprocs, mpi_available):
    out = run_mpi(nprocs, 'kv_mismatch.py', design, timeout=150)
    cases = ['shape', 'dtype', 'root', 'kind'] + (['joined'] if nprocs > 2 else []) + (
        ['count'] if design in GROUP_DESIGNS else [])
    for case in cases:
        for rank in range(nprocs - 1 if case == 'joined' else nprocs):
            assert 'rank %d: %s raised RankMismatchError' % (rank, case) in out, out[-3000:]
        words = 'ranks disagree on %s%s; every rank must issue' % (HEADS[case],
                                                                    expected(case, nprocs))
        lines = [line for line in out.splitlines() if words in line]
        # once per rank: the traceback each rank printed, and nothing of the library's
        want = nprocs - 1 if case == 'joined' else nprocs
        assert len(lines) == want, '%s: %r in %d lines, expected %d:\n%s' % (
            case, words, len(lines), want, out[-4000:])
    assert 'kv_mismatch[%s]: OK at %d ranks' % (design, nprocs) in out
