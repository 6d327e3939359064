"""``python -m mpi_kvstore run --host-discovery-script S`` across test hosts (testbed/): hosts
that join, hosts that leave, and a worker lost on another host.

Three test hosts (network namespaces with hostnames h0, h1, h2, links at RATE). The
supervisor runs on h0, with the test bed's hydra as its launcher (``Hosts.hydra_argv``: the
ssh stand-in, MPICH_CH4_NETMOD=ucx UCX_TLS=tcp): a worker on h0 is a local launch, a worker
on h1 or h2 a launch with ``-hosts H``, and workers on different hosts talk TCP over the
links. The discovery script is ``cat FILE``, a file the test rewrites while the job runs.
Each worker says on which host it runs (scenarios/elastic_testbed_train.py), then trains
elastic_hosts_train.py's linear model, whose update does not depend on the number of
workers: every job ends with equal weights on every worker, equal within float32 rounding
to a numpy run without losses or additions (test_elastic_run.world_reference).

Every job runs under a timeout; no process of it may outlive it; the test hosts are removed
at the end of the module. Skipped, with the reason, where the test bed cannot be built.
"""
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import test_elastic_hosts
from test_elastic_hosts import assert_equal_and_right, steps_of

import testbed
from mpi_kvstore.launch import processes, rendezvous

from mpi_harness import REPO_ROOT, SCENARIOS_DIR

OK, WHY = testbed.available(rate=True, mpi=True)
pytestmark = pytest.mark.skipif(not OK, reason=WHY or 'test bed available')

SCRIPT = os.path.join(SCENARIOS_DIR, 'elastic_testbed_train.py')
RATE = '3gbit'
TIMEOUT = 240
HARNESS_VAR = 'MPI_HARNESS_RUN_ID'


@pytest.fixture(scope='module')
def hosts():
    with testbed.Hosts(3, rate=RATE) as test_hosts:
        yield test_hosts
    assert testbed.artifacts(test_hosts.prefix or '') == []


class Job(test_elastic_hosts.Job):
    """test_elastic_hosts' job, its supervisor on h0 with the test bed's hydra as launcher."""

    def __init__(self, hosts, tmp_path, listed, *options, script_args=()):
        self.test_hosts = hosts
        super().__init__(tmp_path, listed, '--launcher', ' '.join(hosts.hydra_argv()),
                         *options, script_args=script_args, script=SCRIPT)

    def command(self, argv):
        return self.test_hosts.exec_argv('h0', argv)

    def start(self, argv, env):
        return processes.start_group(argv, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env, cwd=REPO_ROOT)

    def stop(self):
        status, _ = processes.wait_or_stop(self.proc, self.left(), 2.0)
        return status

    def worker_pid(self, worker):
        """The pid of worker ``worker``'s Python process (not its mpiexec or hydra proxy)."""
        mine = set(processes.marked(HARNESS_VAR, self.run_id))
        for pid in sorted(mine & set(processes.marked(rendezvous.ID_ENV, str(worker)))):
            try:
                with open('/proc/%d/cmdline' % pid, 'rb') as fh:
                    words = fh.read().split(b'\0')
            except OSError:
                continue
            if os.path.basename(words[0]).startswith(b'python') and SCRIPT.encode() in words:
                return pid
        return None


def where(out):
    """{worker: host} as the workers said. Their lines may run together in the log, since
    every launch writes to it ('worker 0 on h0worker 1 on h1'), so a line start is not
    required: only that nothing but another such line or the line's end follows."""
    return {int(w): h for w, h in re.findall(r'worker (\d+) on (h\d+)(?=worker |$)', out, re.M)}


def test_a_host_the_script_adds_joins_and_trains(hosts, tmp_path, mpi_available):
    """h0 and h1, then h2 listed: h2's worker, launched there with -hosts h2, joins at a
    commit with no rollback and trains; all three end equal, and equal to numpy's."""
    job = Job(hosts, tmp_path, 'h0:1\nh1:1\n', '--min-np', 2, '--max-np', 3, '--state-dir',
              tmp_path / 'state', script_args=(
        '--steps', 40, '--step-seconds', 0.02, '--wait-at', 10, '--wait-for', 3))
    job.wait_for(r'worker 0: step 5 done')
    job.set_hosts('h0:1\nh1:1\nh2:1\n')
    status, out = job.finish()
    assert status == 0, out[-4000:]
    assert where(out) == {0: 'h0', 1: 'h1', 2: 'h2'}, out[-4000:]
    assert 'h2 slot 0 found: worker 2 starts and joins at the next commit' in out
    assert 'meet through the files' not in out   # --state-dir given: the user chose it
    assert re.search(r'worker 2 on h2 joined: world \d+ of 3 worker\(s\)', out), out[-4000:]
    assert 'worker 2: joined at rank 2 of 3' in out, out[-4000:]
    assert steps_of(out, 2)[0][0] == 11
    for worker in (0, 1):   # no step redone: no rollback
        assert 'worker %d: reset at step 10, rank %d of 3' % (worker, worker) in out
        assert [step for step, _ in steps_of(out, worker)] == list(range(1, 41))
    assert_equal_and_right(job, (0, 1, 2), 40)


def test_a_host_the_script_removes_leaves_at_the_next_commit(hosts, tmp_path, mpi_available):
    """h0, h1 and h2, then h2 no longer listed: its worker leaves at the next commit; the
    others go on from that step (no rollback) and end equal to numpy's."""
    job = Job(hosts, tmp_path, 'h0:1\nh1:1\nh2:1\n', '--min-np', 2, script_args=(
        '--steps', 60, '--step-seconds', 0.03))
    job.wait_for(r'worker 0: step 7 done')
    job.set_hosts('h0:1\nh1:1\n')
    status, out = job.finish()
    assert status == 0, out[-4000:]
    assert where(out) == {0: 'h0', 1: 'h1', 2: 'h2'}, out[-4000:]
    assert re.search(r'workers on other hosts \(h1\) meet through the files of \S+: it must be '
                     r'on a filesystem every host shares', out), out[-4000:]
    assert 'h2 slot 0 is no longer listed: worker 2 leaves at the next commit' in out
    assert 'worker 2 on h2 left the job' in out, out[-4000:]
    last = steps_of(out, 2)[-1][0]
    assert last % 5 == 0 and last < 60
    for worker in (0, 1):
        assert 'worker %d: reset at step %d, rank %d of 2' % (worker, last, worker) in out
        assert [step for step, _ in steps_of(out, worker)] == list(range(1, 61))
    assert not (tmp_path / 'w.2.npy').exists()
    assert_equal_and_right(job, (0, 1), 60)


def test_a_worker_killed_on_another_host_the_survivors_go_on_in_memory(hosts, tmp_path,
                                                                       mpi_available):
    """h0, h1 and h2; the test SIGKILLs worker 1's process, in h1's namespace, after its
    step 12: the survivors on h0 and h2 keep their processes, restore the last commit in
    memory, re-form a world of 2 and finish, equal to each other and to numpy's."""
    job = Job(hosts, tmp_path, 'h0:1\nh1:1\nh2:1\n', script_args=(
        '--steps', 50, '--step-seconds', 0.03))
    job.wait_for(r'worker 1: step 12 done')
    pid = job.worker_pid(1)
    assert pid is not None, job.output()[-3000:]
    named = subprocess.run(['ip', 'netns', 'identify', str(pid)], capture_output=True,
                           text=True, timeout=30).stdout.split()
    assert named == [hosts.namespace('h1')]
    survivors = {job.worker_pid(0), job.worker_pid(2)}
    os.kill(pid, signal.SIGKILL)
    job.wait_for(r'worker 0: step 20 done at \S+ \(0 of 2\)')
    assert {job.worker_pid(0), job.worker_pid(2)} == survivors   # the same processes
    status, out = job.finish()
    assert status == 0, out[-4000:]
    assert where(out) == {0: 'h0', 1: 'h1', 2: 'h2'}, out[-4000:]
    assert re.search(r'worker 1 on h1 was lost \(status \d+\); host h1 blacklisted; recovery '
                     r'in memory: 2 survivor\(s\) re-form the world', out), out[-4000:]
    assert 'relaunch' not in out
    resets = re.findall(r'worker 0: reset at step (\d+), rank 0 of 2', out)
    assert len(resets) == 1 and int(resets[0]) % 5 == 0, out[-4000:]
    assert 'worker 2: reset at step %s, rank 1 of 2' % resets[0] in out
    assert 'worker 3' not in out    # nothing new started on the blacklisted h1
    assert_equal_and_right(job, (0, 2), 50)


def test_a_failed_host_comes_back_after_its_blacklist_cooldown(hosts, tmp_path, mpi_available):
    """--blacklist-cooldown-range 3 30: worker 1 SIGKILLed on h1; h1 is out for 3 s, then the
    script still lists it and a new worker starts there and joins; the job ends with workers
    on h0, h2 and h1 again, equal to each other and to numpy's."""
    cooldown = 3.0
    job = Job(hosts, tmp_path, 'h0:1\nh1:1\nh2:1\n', '--blacklist-cooldown-range', cooldown, 30,
              script_args=('--steps', 50, '--step-seconds', 0.03, '--wait-at', 30,
                           '--wait-for', 3))
    job.wait_for(r'worker 1: step 12 done')
    killed = time.monotonic()
    os.kill(job.worker_pid(1), signal.SIGKILL)
    job.wait_for(r'worker 3 starts')
    assert time.monotonic() - killed >= cooldown
    status, out = job.finish()
    assert status == 0, out[-4000:]
    assert where(out) == {0: 'h0', 1: 'h1', 2: 'h2', 3: 'h1'}, out[-4000:]
    assert 'host h1 blacklisted for 3 s (failure 1)' in out, out[-4000:]
    assert 'h1 slot 0 found: worker 3 starts and joins at the next commit (the host is back ' \
           'after its blacklist cooldown)' in out, out[-4000:]
    assert re.search(r'worker 3 on h1 joined: world \d+ of 3 worker\(s\)', out), out[-4000:]
    assert 'relaunch' not in out
    assert_equal_and_right(job, (0, 2, 3), 50)


def test_the_gpu_like_benchmark_trains_under_the_supervisor_across_hosts(hosts, tmp_path,
                                                                         mpi_available):
    """python -m benchmarks.gpu_like under run --elastic on h0 and h1: hvd.init forms the
    elastic world, DistributedTrainer trains on the store across the link, and every run's
    weights are checked against numpy in the benchmark (a wrong one raises: status 1)."""
    listed = tmp_path / 'hosts'
    listed.write_text('h0:1\nh1:1\n')
    argv = hosts.exec_argv('h0', [
        sys.executable, '-m', 'mpi_kvstore', 'run', '--launcher', ' '.join(hosts.hydra_argv()),
        '--host-discovery-script', 'cat %s' % listed, '--min-np', 2, '--max-np', 2, '--',
        sys.executable, '-m', 'benchmarks.gpu_like', '--model', 'mobilenet0.25', '--chain', 2,
        '--trials', 2])
    result = testbed.run_job(argv, timeout=TIMEOUT, cwd=REPO_ROOT, env={
        'PYTHONPATH': REPO_ROOT, 'OMP_NUM_THREADS': '1'})
    assert result.ok and result.leftovers == 0, result.output[-4000:]
    assert re.search(r'gpu_like mobilenet0\.25: 2 ranks, elastic: ms a step [0-9.]+ ',
                     result.output), result.output[-4000:]
    assert '2 worker(s) finished, 0 left, 0 lost' in result.output
