"""The store's scenarios with ranks on different hosts, talking real TCP.

Two test hosts (testbed/: network namespaces joined by links shaped to RATE),
mpiexec on h0 reaching h1 through the test bed's ssh stand-in, and
MPICH_CH4_NETMOD=ucx UCX_TLS=tcp so that ranks on different hosts use TCP over
the link (MPICH's default would use shared memory between the namespaces).
Ranks go in blocks: at 2 ranks one a host (every message crosses the link), at 4
ranks two a host (shared memory inside a host, TCP between, in one communicator).

What runs, to stay within about 3 minutes on 2 idle cores (tests/test_store.py has
the full matrix on one host):
  kv_forms, kv_gluon, kv_skew, kv_errors   every design at 2 ranks
  kv_module                                every design at 2 ranks (update_on_kvstore=1),
                                           and update_on_kvstore=0 once
  kv_schedule, kv_topology                 funneled and concurrent at 2 ranks: priority
                                           scheduling, and the defaults that turn it on
  kv_forms (funneled), kv_skew (concurrent)  at 4 ranks (on 2 cores a 4-rank job costs
                                           3 to 5 times a 2-rank one)
  faults    rank 1 (on h1) raises; rank 1 (on h1) is killed; rank 1 skips a collective
            and the stall abort names it (funneled, 2 ranks)
Each job has a timeout, a failing rank ends its job (``-m mpi4py``, or the store's
own abort hook in the fault cases), and no process outlives its job.
"""
import re
import time

import pytest
from test_faults import (
    EXCEPTION_EXIT_S,
    KILL_EXIT_S,
    STALL_ABORT,
    STALL_ENV,
    STALL_JOB_TIMEOUT,
    STALL_WALL_MARGIN,
)
from test_store import _errors, _forms, _gluon, _module, _ranks, _skew

import testbed
from mpi_kvstore.designs import NAMES as DESIGNS
from mpi_kvstore.faults import abort as faults

from mpi_harness import MPIRunError, result, run_designs, run_joint, run_mpi

OK, WHY = testbed.available(rate=True, mpi=True)
pytestmark = pytest.mark.skipif(not OK, reason=WHY or 'test bed available')

HOSTS = 2
RATE = '5gbit'
TIMEOUT = 240
# (scenario, design) at 4 ranks, two a host.
FOUR_RANKS = [('kv_forms', 'funneled'), ('kv_skew', 'concurrent')]
# (script, args, designs, sizes) of the scenario tests below: one job at 2 ranks, one at 4
# (mpi_harness.run_joint), instead of one a scenario, each paying the ranks' start-up
JOINT = tuple((scenario + '.py', (), DESIGNS, (2,))
              for scenario in ('kv_forms', 'kv_gluon', 'kv_skew', 'kv_errors')) + tuple(
    (scenario + '.py', (), (design,), (4,)) for scenario, design in FOUR_RANKS)


@pytest.fixture(scope='module')
def hosts():
    with testbed.Hosts(HOSTS, rate=RATE) as test_hosts:
        yield test_hosts


def run_across(hosts, nprocs, script, *args, **kwargs):
    """run_mpi with NPROCS ranks in blocks over the hosts (h0 gets the first ones)."""
    ppn = -(-nprocs // HOSTS)
    return run_mpi(nprocs, script, *args, launcher=hosts.launcher_for(ppn=ppn),
                   timeout=kwargs.pop('timeout', TIMEOUT), **kwargs)


def designs_across(hosts, nprocs, script, design, designs, *args, **kwargs):
    """run_designs with NPROCS ranks in blocks over the hosts: one job for DESIGNS."""
    ppn = -(-nprocs // HOSTS)
    return run_designs(nprocs, script, design, designs, *args,
                       launcher=hosts.launcher_for(ppn=ppn), timeout=TIMEOUT, **kwargs)


def joint_across(hosts, nprocs, script, design, designs):
    """run_joint with NPROCS ranks in blocks over the hosts: one job for JOINT's scenarios."""
    ppn = -(-nprocs // HOSTS)
    return run_joint(nprocs, script, design, designs, joint=JOINT,
                     launcher=hosts.launcher_for(ppn=ppn), timeout=TIMEOUT)


def _ok(output, name, nprocs):
    assert '%s: OK at %d ranks' % (name, nprocs) in output, output[-2000:]


def _same_as_on_one_host(output, scenario, design, nprocs):
    """tests/test_store.py's checks of SCENARIO's reported values, ranks across hosts."""
    ranks = _ranks(output, '%s[%s]' % (scenario, design), nprocs)
    {'kv_forms': lambda: _forms(ranks, nprocs), 'kv_gluon': lambda: _gluon(ranks),
     'kv_skew': lambda: _skew(ranks, nprocs),
     'kv_errors': lambda: _errors(ranks, nprocs, design)}[scenario]()


@pytest.mark.parametrize('design', DESIGNS)
@pytest.mark.parametrize('scenario', ['kv_forms', 'kv_gluon', 'kv_skew', 'kv_errors'])
def test_scenario_two_hosts_one_rank_each(hosts, scenario, design, designs):
    _same_as_on_one_host(joint_across(hosts, 2, scenario + '.py', design, designs),
                         scenario, design, 2)


@pytest.mark.parametrize('design', ['funneled', 'concurrent'])
def test_priority_scheduling_two_hosts(hosts, design, tmp_path):
    """Partitioned sums, compression, overtaking and join with ranks on two hosts
    (scenarios/kv_schedule.py), and the defaults that across hosts turn it on."""
    out = run_across(hosts, 2, 'kv_schedule.py', design, str(tmp_path / 'trace.json'))
    for part in ('sums', 'compression', 'overtake', 'join'):
        _ok(out, 'kv_schedule[%s] %s' % (design, part), 2)
    for rank in result(out, 'kv_schedule[%s] overtake' % design)['ranks']:
        # one 4 MB request cut in 62 pieces of 64 KB a round, the rest held back
        assert rank['counted']['pieces_cut'] == 2 and rank['counted']['held_back'] > 0
        assert rank['checked']['big, iteration 1'] == [[1000000], 1000000 * 5]   # 2 + 3
    for rank in result(out, 'kv_schedule[%s] join' % design)['ranks']:
        assert rank['checked']['pushpull after join'] == [[5000], 5000 * 3]
    out = run_across(hosts, 2, 'kv_topology.py', design, '2')
    _ok(out, 'kv_topology[%s, 2 hosts]' % design, 2)
    for rank in result(out, 'kv_topology[%s, 2 hosts]' % design)['ranks']:
        assert rank['pieces_cut'] == 1      # across hosts the defaults cut the 10 MB array
        assert rank['checked']['small2'] == [[257], 257 * (2 + 3)]
        assert rank['raised'] == ['ConfigError'] * 3


@pytest.mark.parametrize('scenario, design', FOUR_RANKS,
                         ids=['%s-%s' % pair for pair in FOUR_RANKS])
def test_scenario_two_hosts_two_ranks_each(hosts, scenario, design):
    _same_as_on_one_host(joint_across(hosts, 4, scenario + '.py', design, [design]),
                         scenario, design, 4)


@pytest.mark.parametrize('design, update_on_kvstore', [(d, '1') for d in DESIGNS]
                         + [('funneled', '0')])
def test_module_fit(hosts, design, update_on_kvstore, designs):
    out = designs_across(hosts, 2, 'kv_module.py', design, designs, update_on_kvstore,
                         env={'MXNET_UPDATE_ON_KVSTORE': update_on_kvstore})
    _module(_ranks(out, 'kv_module[%s, MXNET_UPDATE_ON_KVSTORE=%s]' % (design, update_on_kvstore),
                   2))


# -- a rank on the other host fails ---------------------------------------------------------

def failed_across(hosts, nprocs, script, *args, marker, timeout, env=None):
    """A scenario that must end by itself, non-zero: (error, seconds since MARKER)."""
    with pytest.raises(MPIRunError) as info:
        run_across(hosts, nprocs, script, *args, timeout=timeout, env=env,
                   module_launch=False)
    end = time.time()
    err = info.value
    assert not err.timed_out, 'the job did not end by itself:\n%s' % str(err)[-3000:]
    stamp = re.search(r'%s at t=([0-9.]+)' % marker, err.output)
    assert stamp, 'the scenario never reached %r:\n%s' % (marker, err.output[-3000:])
    took = end - float(stamp.group(1))
    print('%s across hosts: exit status %d, %.1f s after %r'
          % (script, err.returncode, took, marker))
    return err, took


def test_unhandled_exception_on_the_other_host_aborts_the_job(hosts):
    err, took = failed_across(hosts, 2, 'fault_exception.py', 'main', marker='rank 1 raises',
                              timeout=2 * EXCEPTION_EXIT_S)
    assert took < EXCEPTION_EXIT_S, 'the job took %.1f s to end after rank 1 failed' % took
    assert err.returncode == faults.FAILURE_STATUS, err.output[-3000:]
    assert ('mpi_kvstore: rank 1 of 2 raised an unhandled exception in the main thread '
            '(LoaderBug: ') in err.output, err.output[-3000:]
    assert 'LoaderBug: rank 1: corrupt record in batch 3' in err.output


def test_killed_rank_on_the_other_host_ends_the_job(hosts):
    err, took = failed_across(hosts, 2, 'fault_kill.py', marker='rank 1 is killed',
                              timeout=3 * KILL_EXIT_S)
    assert took < KILL_EXIT_S, 'the job took %.1f s to end after rank 1 was killed' % took
    # Across hosts hydra learns the death from the proxy on h1: "EXIT CODE: 9".
    assert re.search(r'signal:? 9|EXIT CODE: 9', err.output, re.I), err.output[-3000:]
    assert 'RUNNING AT h1' in err.output, err.output[-3000:]   # hydra names the host


def test_stall_across_hosts_is_named_and_aborted(hosts):
    err, took = failed_across(hosts, 2, 'fault_stall.py', 'funneled', 'sleep',
                              marker='rank 0 starts the last step', timeout=STALL_JOB_TIMEOUT,
                              env=STALL_ENV)
    assert STALL_ABORT <= took < STALL_ABORT + STALL_WALL_MARGIN, (
        'aborted %.1f s after the stall began (stall_abort=%g s)' % (took, STALL_ABORT))
    assert err.returncode == faults.FAILURE_STATUS
    # Rank 0 (on h0) learnt from rank 1 (on h1), over the link, what it had pushed.
    assert re.search(r"collective #\d+ \(allreduce of key '\w+'[^\n]*: waiting [0-9.]+ s; "
                     r'pushed by rank 0; not pushed by rank 1', err.output), err.output[-3000:]
    assert 'rank 0 of 2: stall: aborting the job' in err.output


# -- a cut link under the supervisor (issue 24) -----------------------------------------------

CUT_STALL_ABORT = 10   # s: the supervisor's default is 300, too long for a test


def test_cut_link_under_the_supervisor_relaunches_on_the_remaining_host(hosts, tmp_path):
    """h1's link goes down after the first commit: rank 0's stall abort names rank 1 lost,
    the supervisor relaunches without h1 (--min-np 1) at one rank, which resumes from the
    commit, is told of the resize, and finishes with the weights of an uninterrupted run
    (float32 tolerance: one rank sums the global batch in another order)."""
    import os
    import shlex
    import subprocess
    import sys
    import uuid

    import numpy as np

    from mpi_harness import REPO_ROOT, SCENARIOS_DIR, kill_leftovers, processes
    script = os.path.join(SCENARIOS_DIR, 'elastic_train.py')
    # 20 steps: the cut comes after the first commit (step 5); 15 are left for the one rank
    steps = ['--steps', '20', '--commit-every', '5']
    ref = run_mpi(2, 'elastic_train.py', str(tmp_path / 'ref.npz'), *steps,
                  module_launch=False, env={'MPI_KVSTORE_STATE_DIR': str(tmp_path / 'ref')})
    assert 'finished 20 steps at 2 ranks' in ref, ref[-3000:]
    hostfile = tmp_path / 'hostfile'
    hostfile.write_text('h0:1\nh1:1\n')
    launcher = hosts.exec_argv('h0', [testbed.find_mpiexec(), '-launcher', 'ssh',
                                      '-launcher-exec', hosts.launcher])
    for name, value in testbed.TCP_ENV.items():
        launcher += ['-genv', name, value]
    state = tmp_path / 'state'
    argv = [sys.executable, '-m', 'mpi_kvstore', 'run', '--hostfile', str(hostfile), '-n', '2',
            '--min-np', '1', '--backoff', '0.5', '--state-dir', str(state),
            '--launcher', shlex.join(launcher), '--', sys.executable, script,
            str(tmp_path / 'got.npz')] + steps + ['--step-seconds', '0.3']
    run_id = uuid.uuid4().hex
    env = dict(os.environ, OMP_NUM_THREADS='1', MPI_HARNESS_RUN_ID=run_id,
               MPI_KVSTORE_STALL_ABORT=str(CUT_STALL_ABORT), MPI_KVSTORE_STALL_WARNING='5')
    log_path = tmp_path / 'log'
    cut = relaunched = None
    try:
        with open(log_path, 'wb') as log:
            proc = processes.start_group(argv, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)
            deadline = time.monotonic() + 240
            while proc.poll() is None and time.monotonic() < deadline:
                if cut is None and (state / 'commit-00000001').exists():
                    subprocess.run(['ip', '-n', hosts.namespace('h1'), 'link', 'set', 'eth0',
                                    'down'], check=True)
                    cut = time.monotonic()
                if relaunched is None and 'launch 2 (' in log_path.read_text(errors='replace'):
                    relaunched = time.monotonic()
                time.sleep(0.2)
            status, timed_out = processes.wait_or_stop(proc, 1, 5.0)
    finally:
        subprocess.run(['ip', '-n', hosts.namespace('h1'), 'link', 'set', 'eth0', 'up'],
                       check=False)
        kill_leftovers(run_id)
    out = log_path.read_text(errors='replace')
    assert not timed_out and status == 0, out[-4000:]
    assert cut is not None and relaunched is not None, out[-4000:]
    print('cut link: relaunched %.1f s after the cut (stall_abort %d s)'
          % (relaunched - cut, CUT_STALL_ABORT))
    assert relaunched - cut < CUT_STALL_ABORT + 30, out[-4000:]
    assert re.search(r'launch 1 ended after [0-9.]+ s: stall abort: rank\(s\) 1 lost; '
                     r'host\(s\) h1; relaunching 1 rank\(s\)', out), out[-4000:]
    assert 'launch 2 (of at most 4): 1 rank(s) on h0' in out, out[-4000:]
    assert 'resized from 2 to 1 ranks' in out and 'finished 20 steps at 1 ranks' in out
    with np.load(tmp_path / 'ref.npz') as want, np.load(tmp_path / 'got.npz') as got:
        for name in want.files:
            assert np.allclose(got[name], want[name], rtol=1e-4, atol=1e-5), name
