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
import os
import re
import subprocess
import sys
import uuid

import numpy as np

from mpi_kvstore.launch import rendezvous
from mpi_kvstore.launch.workers import Workers

from mpi_harness import (
    REPO_ROOT,
    SCENARIOS_DIR,
    kill_leftovers,
    run_elastic,
    run_mpi,
    soak_growth,
)

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


# -- survivors that keep going in memory: separate launches, one world ----------------------

WORLD_SCRIPT = os.path.join(SCENARIOS_DIR, 'elastic_world.py')
DIM, GLOBAL, LR = 16, 24, 0.1


def world_reference(steps):
    """The linear model's weights after ``steps`` full-batch steps, in numpy on one process
    (elastic_world.py's data and update)."""
    w = np.zeros(DIM, dtype=np.float32)
    for step in range(steps):
        rng = np.random.RandomState(700 + step)
        data = rng.uniform(-1, 1, (GLOBAL, DIM)).astype(np.float32)
        target = data @ np.linspace(-1, 1, DIM).astype(np.float32) + 0.1
        w = w - LR * (data.T @ (data @ w - target)) / GLOBAL
    return w


def run_world(tmp_path, count, *script_args, timeout=TIMEOUT, before=None, script=None):
    """Start ``count`` workers of elastic_world.py, each its own mpiexec; (statuses, output,
    workers). ``before(workers)`` runs after the start (the workers are watched after it)."""
    run_id = uuid.uuid4().hex
    env = dict(os.environ, OMP_NUM_THREADS='1', MPI_HARNESS_RUN_ID=run_id,
               PYTHONPATH=os.pathsep.join([REPO_ROOT, SCENARIOS_DIR]))
    log_path = tmp_path / 'log'
    with open(log_path, 'wb') as log:
        argv = ([sys.executable, WORLD_SCRIPT, str(tmp_path / 'w')] if script is None
                else [sys.executable, script])
        workers = Workers(argv + [str(a) for a in script_args], count, str(tmp_path / 'rdv'),
                          env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            if before is None:
                workers.start()
            else:
                before(workers)
            statuses = workers.wait(timeout)
        finally:
            workers.stop()
    left = kill_leftovers(run_id)
    output = log_path.read_text(errors='replace')
    assert left == 0, 'processes outlived the job\n' + output[-3000:]
    return statuses, output, workers


def test_survivors_of_a_sigkill_keep_going_in_memory(tmp_path, mpi_available):
    """3 workers, commits every 5 steps; worker 1 SIGKILLed in the middle of step 12: the
    launcher announces it, workers 0 and 2 raise HorovodInternalError, restore step 10,
    re-form a 2-worker world (worker 0 rank 0) and finish the 30 steps in their processes.
    Their weights are bitwise equal, and equal to a numpy run without the loss within
    float32 rounding."""
    statuses, out, _ = run_world(tmp_path, 3, '--kill-id', 1, '--kill-at', 12)
    assert statuses == {0: 0, 1: 9, 2: 0}, (statuses, out[-3000:])
    assert 'worker 0: reset at step 10, rank 0 of 2' in out, out[-3000:]
    assert 'worker 2: reset at step 10, rank 1 of 2' in out, out[-3000:]
    assert 'worker(s) [1] lost (the launcher says so)' in out, out[-3000:]
    for worker in (0, 2):
        assert 'worker %d: finished at rank %d of 2' % (worker, worker // 2) in out
    got = [np.load(tmp_path / ('w.%d.npy' % worker)) for worker in (0, 2)]
    assert np.array_equal(got[0], got[1])
    want = world_reference(30)
    assert np.allclose(got[0], want, rtol=1e-5, atol=1e-6), np.abs(got[0] - want).max()
    assert not (tmp_path / 'w.1.npy').exists()


def test_a_stranger_and_a_forged_notice_are_refused(tmp_path, mpi_available):
    """A process without the job's secret connects to the port while the world forms: it is
    refused and logged, and the world forms without it. A 'lost' notice signed with another
    secret is refused and logged; no worker resets, and the job ends as without them."""
    stranger_out = tmp_path / 'stranger.log'

    def before(workers):
        workers.start(only=[0])
        env = dict(workers.env, PYTHONPATH=os.pathsep.join([REPO_ROOT, SCENARIOS_DIR]))
        with open(stranger_out, 'wb') as log:
            done = subprocess.run(['mpiexec', '-n', '1', sys.executable,
                                   os.path.join(SCENARIOS_DIR, 'elastic_stranger.py'),
                                   workers.directory], env=env, stdout=log,
                                  stderr=subprocess.STDOUT, timeout=60)
        assert done.returncode == 0, stranger_out.read_text()[-3000:]
        rendezvous.announce_lost(workers.directory, rendezvous.new_secret(), 1, 9)
        workers.start(only=[1])

    statuses, out, _ = run_world(tmp_path, 2, '--steps', 12, before=before)
    assert 'stranger: admitted False' in stranger_out.read_text()
    assert statuses == {0: 0, 1: 0}, (statuses, out[-3000:])
    assert "refused a process that connected to the port without the job's secret " \
           '(a wrong signature)' in out, out[-3000:]
    assert re.search(r"refused \S+lost-1.json: its signature does not match the job's "
                     'secret', out), out[-3000:]
    assert 'reset at' not in out
    got = np.load(tmp_path / 'w.0.npy')
    assert np.allclose(got, world_reference(12), rtol=1e-5, atol=1e-6)


def test_the_horovod_pattern_example_resets_and_ends_as_without_the_reset(mpi_available):
    """examples/elastic_horovod.py on 2 ranks: a HorovodInternalError after batch 6
    (commits every 4) resumes at batch 4 through the reset callback, and both epochs end
    with the accuracies of an uninterrupted run."""
    example = os.path.join(REPO_ROOT, 'examples', 'elastic_horovod.py')
    failed = run_mpi(2, example, '--fail-at', 6, timeout=TIMEOUT, module_launch=False)
    plain = run_mpi(2, example, timeout=TIMEOUT, module_launch=False)
    assert ('reset: 2 rank(s), learning rate 0.100, resuming at epoch 0 batch 4'
            in failed), failed[-3000:]
    assert 'reset:' not in plain
    accuracies = [re.findall(r'epoch \d: accuracy [0-9.]+', out) for out in (failed, plain)]
    assert len(accuracies[1]) == 2 and accuracies[0] == accuracies[1], accuracies
    assert 'done: 2 epochs at 2 rank(s)' in failed


def test_the_supervisors_elastic_mode_keeps_the_survivors(tmp_path, mpi_available):
    """python -m mpi_kvstore run --elastic -n 3: worker 2 SIGKILLed in step 8 (commits every
    5); workers 0 and 1 re-form the world in memory and finish; nothing is relaunched."""
    out = run_elastic(WORLD_SCRIPT, tmp_path / 'w', '--steps', 16, '--kill-id', 2, '--kill-at', 8,
                      timeout=TIMEOUT, options=('--reset-limit', 2))
    assert 'mpi_kvstore run: worker 2 on localhost was lost (status 9); host localhost ' \
        'blacklisted; recovery in memory: 2 survivor(s) re-form the world' in out, out[-3000:]
    assert 'elastic job ended: 2 worker(s) finished, 0 left, 1 lost (2)' in out, out[-3000:]
    assert 'launch 2' not in out
    assert 'worker 0: reset at step 5, rank 0 of 2' in out, out[-3000:]
    got = [np.load(tmp_path / ('w.%d.npy' % worker)) for worker in (0, 1)]
    assert np.array_equal(got[0], got[1])
    assert np.allclose(got[0], world_reference(16), rtol=1e-5, atol=1e-6)


def test_survivors_of_a_kill_inside_a_commit_agree(tmp_path, mpi_available):
    """Worker 2 of 3 dies inside the commit of step 10, after its own copy and before the
    commit's broadcast: the survivors had copied step 10 too, restore it, re-form and finish
    equal to a numpy run without the loss (float32), bitwise equal to each other."""
    statuses, out, _ = run_world(tmp_path, 3, '--steps', 16, '--kill-id', 2,
                                 '--kill-in-commit', 10)
    assert statuses == {0: 0, 1: 0, 2: 9}, (statuses, out[-3000:])
    assert 'worker 0: reset at step 10, rank 0 of 2' in out, out[-3000:]
    got = [np.load(tmp_path / ('w.%d.npy' % worker)) for worker in (0, 1)]
    assert np.array_equal(got[0], got[1])
    assert np.allclose(got[0], world_reference(16), rtol=1e-5, atol=1e-6)


def test_twenty_resets_leave_memory_descriptors_and_threads_flat(tmp_path, mpi_available):
    """3 workers re-form their world 20 times (a host update announced at each commit):
    from the first reset to the last each grows by at most 20 MB of RSS and 10 file
    descriptors, keeps its thread count, and the sum trained is exact (22 allreduces of 3)."""
    statuses, out, _ = run_world(tmp_path, 3, script=os.path.join(SCENARIOS_DIR,
                                                                  'elastic_soak.py'))
    assert statuses == {0: 0, 1: 0, 2: 0}, (statuses, out[-3000:])
    found = soak_growth(out)
    assert sorted(f[0] for f in found) == [0, 1, 2], out[-3000:]
    for worker, resets, rss, fds, before, after, total in found:
        assert resets == 20, (worker, resets)
        assert rss <= 20.0 and fds <= 10, (worker, rss, fds)
        assert before == after, (worker, before, after)
        assert total == 66000.0, (worker, total)
