"""Ranks that disagree get a RankMismatchError naming what every rank issued, once.

tests/scenarios/kv_mismatch.py makes each mismatch (shape, dtype, broadcast root, kind,
with a joined rank at 3 ranks, and in the designs whose agreement covers one call, the count of keys in a call); each
rank prints the error it caught as Python prints an uncaught one. The words expected
here are written out for 2 and 3 ranks from what the scenario issues on each rank.
"""
import pytest

from mpi_kvstore.designs import NAMES, mismatch

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


# 3 ranks: ranks that said the same are grouped, and a joined rank takes part (2 ranks took
# another 50 s of the suite and cover nothing more; the words' own tests are below).
@pytest.mark.parametrize('nprocs', [3], ids=lambda n: 'np%d' % n)
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


# -- the words alone (mismatch.explain, no MPI) ---------------------------------------

def _said(seq=0, kind='allreduce', key="'w'", shape=(4,), dtype='float32', root=0,
          compression=None, priority=0, failed=None, factor=1.0, scale=None):
    return {'seq': seq, 'kind': kind, 'key': key, 'shape': [list(shape), dtype], 'root': root,
            'compression': compression, 'place': 'cpu', 'unit': 1, 'priority': priority,
            'factor': factor, 'scale': scale, 'failed': failed}


def test_words_group_ranks_that_said_the_same_and_skip_joined_ones():
    every = [[_said(shape=(3,))]] + [[_said()]] * 4 + [None, [_said()]]
    assert mismatch.explain(every).startswith(
        "ranks disagree on collective #0 (allreduce of key 'w'): rank 0 has shape (3,) "
        "float32, ranks 1-4, 6 have shape (4,) float32; every rank must issue")


@pytest.mark.parametrize('other, words', [
    (_said(failed='ArrayLayoutError: cannot be read in place'),
     "collective #0 (allreduce of key 'w', shape (4,) float32): rank 1 could not take part "
     "(ArrayLayoutError: cannot be read in place)"),
    (_said(compression=['2bit', 0.5]),
     "collective #0 (allreduce of key 'w', shape (4,) float32): rank 0 has no compression, "
     "rank 1 has compression 2bit 0.5"),
    (_said(priority=-3),
     "collective #0 (allreduce of key 'w', shape (4,) float32): rank 0 has priority 0, "
     "rank 1 has priority -3"),
    (_said(seq=5, kind='bcast', key="'x'"),
     "collective (shape (4,) float32): rank 0 has #0 allreduce of key 'w', "
     "rank 1 has #5 bcast of key 'x'"),
])
def test_words_name_what_differs(other, words):
    assert mismatch.explain([[_said()], [other]]) == 'ranks disagree on %s; %s' % (
        words, mismatch.ADVICE)


def test_words_name_the_first_positions_of_a_call():
    mine = [_said(seq=s, key="'k%d'" % s) for s in range(6)]
    theirs = [_said(seq=s, key="'k%d'" % s, dtype='float16') for s in range(6)]
    text = mismatch.explain([mine, theirs])
    assert text.count('rank 1 has shape (4,) float16') == mismatch.MAX_LISTED, text
    assert "collective #3 (allreduce of key 'k3')" in text and 'and 2 more;' in text, text
