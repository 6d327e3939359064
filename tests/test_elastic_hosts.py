"""Hosts that come and go under ``python -m mpi_kvstore run --host-discovery-script S``: the
script is ``cat FILE``, a file the test rewrites while the job runs. Each worker is its own
``mpiexec -n 1`` launch on this machine (127.0.0.x and localhost name it); every job runs
under a timeout, and no process of it may outlive it.

The model (scenarios/elastic_hosts_train.py) is the linear one of test_elastic_run.py, whose
update does not depend on the number of workers: every run ends equal, within float32
rounding, to a numpy run without losses or additions (test_elastic_run.world_reference).
"""
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest
from test_elastic_run import world_reference

from mpi_harness import REPO_ROOT, SCENARIOS_DIR, kill_leftovers

SCRIPT = os.path.join(SCENARIOS_DIR, 'elastic_hosts_train.py')
TIMEOUT = 240


class Job:
    """The supervisor in the background, its output in a file, its hosts in another."""

    timeout = TIMEOUT

    def __init__(self, tmp_path, hosts, *options, script_args=(), script=SCRIPT):
        self.tmp_path, self.hosts = tmp_path, tmp_path / 'hosts'
        self.set_hosts(hosts)
        self.run_id = uuid.uuid4().hex
        env = dict(os.environ, OMP_NUM_THREADS='1', MPI_HARNESS_RUN_ID=self.run_id,
                   PYTHONPATH=os.pathsep.join([REPO_ROOT, SCENARIOS_DIR]))
        argv = self.command([
            sys.executable, '-m', 'mpi_kvstore', 'run', '--host-discovery-script',
            'cat %s' % self.hosts, *[str(o) for o in options], '--', sys.executable, script,
            str(tmp_path / 'w'), *[str(a) for a in script_args]])
        self.log_path = tmp_path / 'log'
        self.log = open(self.log_path, 'wb')
        self.started = time.monotonic()
        self.proc = self.start(argv, env)

    def command(self, argv):
        """The argv that runs the supervisor: here, ``argv`` itself."""
        return argv

    def start(self, argv, env):
        return subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                cwd=REPO_ROOT, start_new_session=True)

    def left(self):
        """Seconds left of the job's timeout (at least 1)."""
        return max(self.timeout - (time.monotonic() - self.started), 1)

    def stop(self):
        """Wait for the job, killing it past the timeout; its status."""
        try:
            return self.proc.wait(timeout=self.left())
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait()

    def output(self):
        return self.log_path.read_text(errors='replace')

    def set_hosts(self, text):
        """Rewrite the hosts file whole; the time it was written."""
        tmp = self.tmp_path / 'hosts.tmp'
        tmp.write_text(text)
        os.replace(tmp, self.hosts)
        return time.time()

    def wait_for(self, pattern):
        while not re.search(pattern, self.output()):
            if self.proc.poll() is not None or time.monotonic() - self.started > self.timeout:
                self.finish()
                pytest.fail('no %r in the output:\n%s' % (pattern, self.output()[-4000:]))
            time.sleep(0.05)

    def finish(self):
        """Wait for the job (killing it past the timeout); (status, output)."""
        try:
            status = self.stop()
        finally:
            self.log.close()
            left = kill_leftovers(self.run_id)
        out = self.output()
        assert left == 0, 'processes outlived the job\n' + out[-3000:]
        return status, out

    def weights(self, worker):
        return np.load(self.tmp_path / ('w.%d.npy' % worker))


def steps_of(out, worker):
    return [(int(step), float(at)) for step, at in
            re.findall(r'worker %d: step (\d+) done at ([0-9.]+)' % worker, out)]


def assert_equal_and_right(job, workers, steps):
    got = [job.weights(worker) for worker in workers]
    for other in got[1:]:
        assert np.array_equal(got[0], other)
    want = world_reference(steps)
    assert np.allclose(got[0], want, rtol=1e-5, atol=1e-6), np.abs(got[0] - want).max()


def test_a_host_the_script_adds_joins_at_a_commit_and_trains(tmp_path, mpi_available):
    """2 hosts, then 3: the third host's worker joins at a commit (no rollback), trains, and
    all three end with equal weights, equal to numpy's. The two wait after step 10 for the
    third, however long its start takes on a loaded machine."""
    job = Job(tmp_path, '127.0.0.1:1\n127.0.0.2:1\n', '--min-np', 2, '--max-np', 3,
              script_args=('--steps', 60, '--step-seconds', 0.02, '--wait-at', 10,
                           '--wait-for', 3))
    job.wait_for(r'worker 0: step 5 done')
    listed = job.set_hosts('127.0.0.1:1\n127.0.0.2:1\n127.0.0.3:1\n')
    status, out = job.finish()
    assert status == 0, out[-4000:]
    assert 'worker 2: joined at rank 2 of 3' in out, out[-4000:]
    assert re.search(r'worker 2 on 127\.0\.0\.3 joined: world \d+ of 3 worker\(s\)', out)
    joined_at = steps_of(out, 2)[0]
    assert 'worker 0: reset at step 10, rank 0 of 3' in out, out[-4000:]
    assert joined_at[0] == 11
    for worker in (0, 1):   # no step redone: no rollback
        assert [step for step, _ in steps_of(out, worker)] == list(range(1, 61))
    assert_equal_and_right(job, (0, 1, 2), 60)
    print('host listed -> its first step: %.2f s' % (joined_at[1] - listed))


def test_a_re_forming_whose_connect_gets_no_answer_is_retried_with_the_newcomer(
        tmp_path, mpi_available):
    """2 hosts, then 3; in the re-forming that admits the third host's worker, worker 1's
    connect to the root gets no answer (--connect-stalls 1, deadline 8 s). Worker 1 gives up;
    the root, told so, gives up its accept, which the launcher's stand-in completes; the
    retry admits worker 2 with both (the launcher's notice still counts), no relaunch, and
    all three end equal to numpy's."""
    job = Job(tmp_path, '127.0.0.1:1\n127.0.0.2:1\n', '--min-np', 2, '--max-np', 3,
              script_args=('--steps', 40, '--step-seconds', 0.02, '--wait-at', 10,
                           '--wait-for', 3, '--connect-stalls', 1, '--deadline', 8))
    job.wait_for(r'worker 0: step 5 done')
    job.set_hosts('127.0.0.1:1\n127.0.0.2:1\n127.0.0.3:1\n')
    status, out = job.finish()
    assert status == 0, out[-4000:]
    assert 'worker 1 gave up joining the world of generation 1: a stand-in completes ' \
           "worker 0's accept" in out, out[-4000:]
    assert re.search(r'the reset lost the world too \(.*gave up on this forming\)', out), \
        out[-4000:]
    assert 'worker 2: joined at rank 2 of 3' in out, out[-4000:]
    assert 'relaunch' not in out
    for worker in (0, 1):   # the re-forming's retry redid no step: no rollback
        assert [step for step, _ in steps_of(out, worker)] == list(range(1, 41))
    assert_equal_and_right(job, (0, 1, 2), 40)


def test_a_slot_the_script_drops_leaves_at_the_next_commit(tmp_path, mpi_available):
    """localhost:3, then localhost:2: worker 2 leaves at the next commit; the others go on
    from that step (no rollback) and end equal to numpy's."""
    job = Job(tmp_path, 'localhost:3\n', '--min-np', 2,
              script_args=('--steps', 80, '--step-seconds', 0.03))
    job.wait_for(r'worker 0: step 7 done')
    job.set_hosts('localhost:2\n')
    status, out = job.finish()
    assert status == 0, out[-4000:]
    assert 'localhost slot 2 is no longer listed: worker 2 leaves at the next commit' in out
    assert 'worker 2 left out by the host discovery' in out, out[-4000:]
    assert 'worker 2 on localhost left the job' in out, out[-4000:]
    last = steps_of(out, 2)[-1][0]
    assert last % 5 == 0
    for worker in (0, 1):
        assert 'worker %d: reset at step %d, rank %d of 2' % (worker, last, worker) in out
        assert [s for s, _ in steps_of(out, worker)] == list(range(1, 81))
    assert not (tmp_path / 'w.2.npy').exists()
    assert_equal_and_right(job, (0, 1), 80)


def test_below_min_np_the_job_waits_and_resumes_when_a_host_comes_back(tmp_path,
                                                                       mpi_available):
    """2 hosts, --min-np 2; the worker on 127.0.0.2 is SIGKILLed in step 12: its host is
    blacklisted, the survivor restores step 10 and waits; the script then lists a third
    host, whose worker joins, and training resumes to the end."""
    job = Job(tmp_path, '127.0.0.1:1\n127.0.0.2:1\n', '--min-np', 2, '--elastic-timeout', 90,
              script_args=('--steps', 40, '--kill-id', 1, '--kill-at', 12))
    job.wait_for(r'fewer than --min-np 2: waiting up to 90 s')
    job.set_hosts('127.0.0.1:1\n127.0.0.2:1\n127.0.0.3:1\n')
    status, out = job.finish()
    assert status == 0, out[-4000:]
    assert 'worker 1 on 127.0.0.2 was lost (status 9); host 127.0.0.2 blacklisted; recovery ' \
           'in memory' in out, out[-4000:]
    assert 'worker 2: joined at rank 1 of 2' in out, out[-4000:]
    assert 'worker 0: reset at step 10, rank 0 of 2' in out, out[-4000:]
    assert 'training resumes' in out
    assert 'worker 3' not in out   # nothing started on the blacklisted host
    assert_equal_and_right(job, (0, 2), 40)


def test_below_min_np_the_job_ends_with_a_message_when_no_host_comes_back(tmp_path,
                                                                          mpi_available):
    job = Job(tmp_path, '127.0.0.1:1\n127.0.0.2:1\n', '--min-np', 2, '--elastic-timeout', 5,
              script_args=('--steps', 400, '--step-seconds', 0.01, '--kill-id', 1,
                           '--kill-at', 12))
    status, out = job.finish()
    assert status == 1, out[-4000:]
    assert 'elastic job ended: 1 worker(s), fewer than --min-np 2, and the host discovery ' \
           'brought no host back in 5 s (--elastic-timeout)' in out, out[-4000:]


def test_a_worker_killed_while_the_world_reforms_is_stood_in_for(tmp_path, mpi_available):
    """3 workers; worker 1 SIGKILLed in step 12; while the survivors re-form, worker 2 dies
    once the root waits for it in Accept: the launcher's stand-in connects in its place, the
    root forms a world of one and finishes."""
    job = Job(tmp_path, 'localhost:3\n', script_args=(
        '--steps', 30, '--kill-id', 1, '--kill-at', 12, '--die-in-form', 2))
    status, out = job.finish()
    assert status == 0, out[-4000:]
    assert 'worker 2 died while the world re-formed and worker 0 waited for it: a stand-in ' \
           'connects in its place' in out, out[-4000:]
    assert "the launcher's stand-in answered for worker 2" in out, out[-4000:]
    assert 'worker 0: finished at rank 0 of 1' in out
    assert_equal_and_right(job, (0,), 30)


def test_the_root_lost_while_the_world_reforms_relaunches_from_disk(tmp_path, mpi_available):
    """3 workers committing to --state-dir every 5 steps; worker 1 SIGKILLed in step 12, then
    worker 0, the root of the survivors' re-forming, dies before it admits anyone: memory
    cannot recover that, so the supervisor relaunches on the slot still running (localhost
    is blacklisted), the new worker restores commit 2 (step 10) from disk and finishes."""
    job = Job(tmp_path, 'localhost:3\n', '--state-dir', tmp_path / 'ckpt', script_args=(
        '--steps', 30, '--kill-id', 1, '--kill-at', 12, '--root-dies', 0, '--disk'))
    status, out = job.finish()
    assert status == 0, out[-4000:]
    assert 'worker 0, the root of the world being formed, was lost; recovery by relaunch ' \
           'from disk: every worker starts again from the last commit in' in out, out[-4000:]
    assert 'worker 0: restored commit 2 at step 10' in out, out[-4000:]
    assert 'worker 0: finished at rank 0 of 1' in out
    assert_equal_and_right(job, (0,), 30)
