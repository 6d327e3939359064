"""hvd.elastic over the store, on several ranks (every job under a timeout, through
mpi_harness.run_mpi, which leaves nothing running):

- MXNetState + DistributedTrainer under hvd.elastic.run: rank 1 starts from other weights
  (the first sync gives it rank 0's), every rank raises HorovodInternalError after step 7
  (commits every 3 steps): the run restores step 6, resets, syncs and goes on. Both ranks
  end bitwise equal to an uninterrupted 2-rank run, and to a 1-rank run within float32
  rounding (the update does not depend on the number of ranks);
- a commit to a full disk (a 128 KB tmpfs; where none can be mounted, writes that fail with
  ENOSPC): every rank raises a clear OSError, commit 1 stays whole, no temporary directory
  is left, and the next commit succeeds.
"""
import re
import subprocess

import numpy as np

from mpi_harness import run_mpi

TIMEOUT = 120


def weights(path):
    with np.load(path) as got:
        return [got['arr_%d' % i] for i in range(len(got.files))]


def test_hvd_elastic_run_restores_syncs_and_matches_an_uninterrupted_run(tmp_path,
                                                                       mpi_available):
    out = run_mpi(2, 'elastic_hvd.py', str(tmp_path / 'fail'), '--fail-at', 7, '--perturb',
                  timeout=TIMEOUT)
    for rank in (0, 1):
        assert 'rank %d of 2: starts [0, 6] resets [6]' % rank in out, out[-3000:]
    run_mpi(2, 'elastic_hvd.py', str(tmp_path / 'ref'), timeout=TIMEOUT)
    run_mpi(1, 'elastic_hvd.py', str(tmp_path / 'one'), timeout=TIMEOUT)
    reference, single = weights(tmp_path / 'ref.0.npz'), weights(tmp_path / 'one.0.npz')
    for rank in (0, 1):
        got = weights(tmp_path / ('fail.%d.npz' % rank))
        for mine, ref, one in zip(got, reference, single):
            assert np.array_equal(mine, ref), (rank, np.abs(mine - ref).max())
            assert np.allclose(mine, one, rtol=1e-5, atol=1e-6), np.abs(mine - one).max()


def _mount_tmpfs(path):
    """Whether a 128 KB tmpfs could be mounted at PATH (root only)."""
    try:
        done = subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=128k', 'tmpfs', str(path)],
                              capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def test_a_commit_to_a_full_disk_fails_everywhere_and_training_goes_on(tmp_path,
                                                                      mpi_available):
    directory = tmp_path / 'small'
    directory.mkdir()
    mounted = _mount_tmpfs(directory)
    try:
        out = run_mpi(2, 'elastic_full.py', str(directory),
                      *(() if mounted else ('--simulate',)), timeout=TIMEOUT)
    finally:
        if mounted:
            subprocess.run(['umount', str(directory)], capture_output=True, timeout=30)
    for rank in (0, 1):
        assert re.search(r'rank %d: commit 2 failed: elastic.State: commit 2 to \S+ failed on '
                         r'rank 0 \(OSError: \[Errno 28\] No space left on device\); commit 1 '
                         r'stays the last' % rank, out), out[-3000:]
        assert 'rank %d: commit 2, allreduce -20000' % rank in out, out[-3000:]
    assert "left after the failure: ['commit-00000001', 'filler']" in out, out[-3000:]
    assert 'commit 1 whole: True' in out, out[-3000:]
    assert "left at the end: ['commit-00000002']" in out, out[-3000:]
