"""Tests of the multi-process harness itself (tests/mpi_harness.py)."""
# The project formats with '%' throughout (as testbed/ruff.toml says for testbed/);
# rewriting every format string here would be churn with no defect behind it.
import time

import pytest

from mpi_harness import MPIRunError, MPITimeout, mpi_sizes, process_alive, run_mpi


@mpi_sizes
def test_allreduce_of_ranks(nprocs, mpi_available):
    out = run_mpi(nprocs, 'harness_allreduce.py', nprocs, 'passed-through',
                  env={'HARNESS_MARK': 'passed-through'}, timeout=120)
    assert 'allreduce ok size=%d sum=%d' % (nprocs, nprocs * (nprocs - 1) // 2) in out


def test_scenario_assertion_fails_the_run(mpi_available):
    # A wrong expected size makes every rank's assert fail: the harness must say so.
    with pytest.raises(MPIRunError) as info:
        run_mpi(2, 'harness_allreduce.py', 3, timeout=120)
    assert not info.value.timed_out
    assert 'AssertionError' in str(info.value)


@pytest.mark.parametrize('nprocs', [2, 3], ids=lambda n: 'np%d' % n)
def test_failing_rank_ends_the_job(nprocs, mpi_available):
    start = time.monotonic()
    with pytest.raises(MPIRunError) as info:
        run_mpi(nprocs, 'harness_rank_fails.py', timeout=120)
    elapsed = time.monotonic() - start
    assert not isinstance(info.value, MPITimeout), str(info.value)
    assert info.value.returncode != 0
    assert elapsed < 60, 'a failing rank took %.1f s to end the job' % elapsed
    # The failure message carries the output tail, traceback included.
    assert 'rank 1 failed on purpose' in str(info.value)


def test_hung_rank_is_killed_at_timeout(mpi_available, tmp_path):
    pidfile = tmp_path / 'pids'
    start = time.monotonic()
    with pytest.raises(MPITimeout) as info:
        # 6 s: ranks of mpi4py alone (no MXNet) are up and hung in about 1 s
        run_mpi(3, 'harness_hang.py', pidfile, timeout=6)
    elapsed = time.monotonic() - start
    assert 6 <= elapsed < 16, 'timeout=6 took %.1f s' % elapsed
    assert info.value.timed_out
    assert 'timed out after 6 s' in str(info.value)
    assert 'rank 0 waiting forever' in str(info.value)
    pids = [int(pid) for pid in pidfile.read_text().split()]
    assert len(pids) == 3
    assert not [pid for pid in pids if process_alive(pid)], 'ranks left running'


def test_missing_scenario_fails(mpi_available):
    with pytest.raises(pytest.fail.Exception, match='scenario not found'):
        run_mpi(1, 'no_such_scenario.py')
