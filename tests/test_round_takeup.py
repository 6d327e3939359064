"""A round's native ops taken up and completed together (designs/negotiated.py _collect:
one compiled read of every op's record; designs/base.complete_all: their engine ops in one
compiled call; designs/repeat.py: a bet's data copied in and out through kept addresses):
scenarios/kv_round.py on every design sums bursts of mixed sizes, dtypes and APIs as numpy
does and says the bulk paths ran; the compiled copies move bytes as numpy does.
"""
import numpy as np
import pytest

from mpi_kvstore.designs import NAMES, NEGOTIATED_NAMES

from mpi_harness import result, run_designs


def test_gather_and_scatter_move_bytes_as_numpy_does():
    from mpi_kvstore.engine import rounds
    rng = np.random.RandomState(0)
    parts = [rng.randint(0, 255, size=n).astype(np.uint8) for n in (1, 7, 4096, 3, 0, 1000)]
    addresses = np.array([p.ctypes.data for p in parts], dtype=np.int64)
    nbytes = np.array([p.nbytes for p in parts], dtype=np.int64)
    buf = np.zeros(int(nbytes.sum()), dtype=np.uint8)
    rounds.gather(buf, addresses, nbytes)
    assert np.array_equal(buf, np.concatenate(parts))
    back = buf[::-1].copy()
    rounds.scatter(back, addresses, nbytes)
    at = 0
    for part in parts:
        assert np.array_equal(part, back[at:at + part.size])
        at += part.size


@pytest.mark.parametrize('design', NAMES)
def test_bursts_taken_up_in_bulk_sum_right(design, designs):
    out = run_designs(2, 'kv_round.py', design, designs, '6', timeout=300)
    assert 'kv_round[%s]: OK at 2 ranks' % design in out, out[-3000:]
    sums = result(out, 'kv_round[%s]' % design)['ranks']
    for rank, seen in enumerate(sums):
        # 100 tensors and the list pushpulls' other keys, as numpy summed them (the last
        # step's; the scenario checked every step)
        assert len(seen['checked']) > 100, (rank, len(seen['checked']))
        for what, got in seen['checked'].items():
            assert got == seen['expected'][what], (rank, what, got, seen['expected'][what])
    info = result(out, 'kv_round_info')['ranks']
    for rank, said in enumerate(info):
        if design in NEGOTIATED_NAMES:
            # every step's bursts: their ops read in few take-ups, completed in bulk
            assert said['round'].get('taken', 0) >= 18, (rank, said)
            assert said['round'].get('bulk', 0) >= 18, (rank, said)
        else:
            assert said['round'] == {}, (rank, said)


def test_round_calls_are_cached_by_the_source_they_compile_in(monkeypatch, tmp_path):
    """numba keys its on-disk cache by the compiled function's own file only: the round
    calls are keyed by the source of the files they take constants and code from too, so
    a change there compiles them again instead of loading stale machine code."""
    import numba

    from mpi_kvstore.engine import rounds
    monkeypatch.setattr(numba.config, 'CACHE_DIR', str(tmp_path))
    hits = []
    for key in ('one', 'one', 'another', 'one'):
        monkeypatch.setattr(rounds, '_round', [])
        monkeypatch.setattr(rounds, '_source_key', lambda key=key: key)
        calls = rounds._round_calls()
        hits.append([sum(fn.stats.cache_hits.values()) for fn in calls])
    assert hits == [[0] * 4, [1] * 4, [0] * 4, [1] * 4]
