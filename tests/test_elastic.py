"""The supervisor (``python -m mpi_kvstore run``) and elastic.State, for real: ranks are
SIGKILLed, raise, are interrupted, and the jobs relaunch from committed files
(scenarios/elastic_train.py). Every job runs under a timeout, and no process outlives it.

- a rank SIGKILLed after step 7, commits every 5 steps: one relaunch, which resumes at step
  5 and ends with weights bitwise equal to an uninterrupted run's;
- rank 0 SIGKILLed halfway through writing commit 2 (before its rename): commit 1 is whole,
  the relaunch resumes from it, and the weights are again bitwise equal;
- a Python exception in the script: no relaunch, status 1, the exception named;
- a rank killed at every launch: --max-restarts 1 gives up after two launches;
- Ctrl-C at the supervisor: the job stops, status 130, nothing relaunched or left running;
- Module.fit through State.fit, killed mid-epoch and right after an epoch's last commit:
  bitwise equal to an uninterrupted fit (scenarios/elastic_module.py).

The cut link across test hosts is in tests/test_multihost.py.
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

from mpi_kvstore.launch import supervision, supervisor

from mpi_harness import REPO_ROOT, SCENARIOS_DIR, kill_leftovers, processes

SCRIPT = os.path.join(SCENARIOS_DIR, 'elastic_train.py')
TIMEOUT = 180


def supervise(tmp_path, *script_args, options=(), env=None, timeout=TIMEOUT, script=SCRIPT):
    """(status, output) of the supervisor running SCRIPT (elastic_train.py) on 2 ranks."""
    run_id = uuid.uuid4().hex
    argv = [sys.executable, '-m', 'mpi_kvstore', 'run', '-n', '2', '--backoff', '0.2',
            '--state-dir', str(tmp_path / 'state')] + list(options) + [
        '--', sys.executable, script] + [str(a) for a in script_args]
    full_env = dict(os.environ, OMP_NUM_THREADS='1', MPI_HARNESS_RUN_ID=run_id, **(env or {}))
    with open(tmp_path / 'log', 'wb') as log:
        proc = processes.start_group(argv, stdin=subprocess.DEVNULL, stdout=log,
                                     stderr=subprocess.STDOUT, env=full_env, cwd=REPO_ROOT)
        status, timed_out = processes.wait_or_stop(proc, timeout, 5.0)
    kill_leftovers(run_id)
    output = (tmp_path / 'log').read_text(errors='replace')
    assert not timed_out, output[-4000:]
    return status, output


_REFERENCE = {}   # the uninterrupted run's weights, once a session


def reference(tmp_path):
    if 'weights' not in _REFERENCE:
        status, out = supervise(tmp_path, tmp_path / 'ref.npz')
        assert status == 0, out[-4000:]
        assert launches(out) == [1], out[-4000:]
        _REFERENCE['weights'] = weights(tmp_path / 'ref.npz')
    return _REFERENCE['weights']


def weights(path):
    with np.load(path) as got:
        return [got['arr_%d' % i] for i in range(len(got.files))]


def launches(output):
    return [int(n) for n in re.findall(r'mpi_kvstore run: launch (\d+) \(of at most', output)]


@pytest.fixture
def ref(tmp_path_factory, mpi_available):
    return reference(tmp_path_factory.mktemp('reference'))


def test_a_killed_rank_relaunches_and_resumes_bitwise(tmp_path, ref):
    status, out = supervise(tmp_path, tmp_path / 'got.npz', '--kill-at', 7)
    assert status == 0, out[-4000:]
    assert launches(out) == [1, 2], out[-4000:]
    assert 'a rank was lost' in out
    assert 'launch 1: starting at step 5 (restored: True)' in out, out[-4000:]
    for got, want in zip(weights(tmp_path / 'got.npz'), ref):
        assert np.array_equal(got, want), np.abs(got - want).max()


def test_distributed_trainer_resumes_bitwise(tmp_path, mpi_available):
    """DistributedTrainer (the optimizer on each rank, its states committed from rank 0)."""
    (tmp_path / 'ref').mkdir()
    (tmp_path / 'got').mkdir()
    status, out = supervise(tmp_path / 'ref', tmp_path / 'ref.npz', '--trainer', 'distributed')
    assert status == 0, out[-4000:]
    status, out = supervise(tmp_path / 'got', tmp_path / 'got.npz', '--trainer', 'distributed',
                            '--kill-at', 7)
    assert status == 0 and launches(out) == [1, 2], out[-4000:]
    assert 'launch 1: starting at step 5 (restored: True)' in out, out[-4000:]
    for got, want in zip(weights(tmp_path / 'got.npz'), weights(tmp_path / 'ref.npz')):
        assert np.array_equal(got, want), np.abs(got - want).max()


def test_a_kill_during_a_commit_leaves_the_previous_one(tmp_path, ref):
    status, out = supervise(tmp_path, tmp_path / 'got.npz', '--kill-in-commit', 2,
                            '--kill-rank', 0)
    assert status == 0, out[-4000:]
    assert launches(out) == [1, 2], out[-4000:]
    # commit 2 (step 10) was never renamed into place: the relaunch starts from commit 1
    assert 'launch 1: starting at step 5 (restored: True)' in out, out[-4000:]
    for got, want in zip(weights(tmp_path / 'got.npz'), ref):
        assert np.array_equal(got, want), np.abs(got - want).max()
    left = os.listdir(tmp_path / 'state')
    assert not [n for n in left if n.startswith('.tmp-commit')], left   # cleaned up


def test_a_python_exception_is_a_bug_not_a_fault(tmp_path, mpi_available):
    status, out = supervise(tmp_path, tmp_path / 'got.npz', '--raise-at', 3)
    assert status == 1, out[-4000:]
    assert launches(out) == [1], out[-4000:]
    assert 'rank 1 raised ValueError: a bug in the training script at step 3' in out
    assert 'not relaunching' in out


def test_max_restarts_is_honoured_and_the_last_failure_reported(tmp_path, mpi_available):
    status, out = supervise(tmp_path, tmp_path / 'got.npz', '--kill-at', 2, '--kill-always',
                            options=['--max-restarts', '1'])
    assert status != 0, out[-4000:]
    assert launches(out) == [1, 2], out[-4000:]
    assert re.search(r'launch 2 ended after [0-9.]+ s: a rank was lost .*giving up after 1 '
                     r'relaunch\(es\) \(--max-restarts 1\)', out), out[-4000:]


def test_ctrl_c_stops_everything_without_a_relaunch(tmp_path, mpi_available):
    marker = tmp_path / 'running'
    run_id = uuid.uuid4().hex
    argv = [sys.executable, '-m', 'mpi_kvstore', 'run', '-n', '2', '--state-dir',
            str(tmp_path / 'state'), '--', sys.executable, SCRIPT, str(tmp_path / 'got.npz'),
            '--steps', 200, '--step-seconds', 0.2, '--marker', marker]
    env = dict(os.environ, OMP_NUM_THREADS='1', MPI_HARNESS_RUN_ID=run_id)
    with open(tmp_path / 'log', 'wb') as log:
        proc = processes.start_group([str(a) for a in argv], stdin=subprocess.DEVNULL,
                                     stdout=log, stderr=subprocess.STDOUT, env=env,
                                     cwd=REPO_ROOT)
        try:
            deadline = time.monotonic() + 60
            while not marker.exists() and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.2)
            assert marker.exists(), (tmp_path / 'log').read_text()[-4000:]
            os.kill(proc.pid, signal.SIGINT)   # the supervisor alone, as a terminal's Ctrl-C
            status = proc.wait(timeout=30)     # reaches its group
        finally:
            processes.wait_or_stop(proc, 1, 2.0)
    left = kill_leftovers(run_id)
    out = (tmp_path / 'log').read_text(errors='replace')
    assert status == supervisor.INTERRUPTED, out[-4000:]
    assert launches(out) == [1] and 'not relaunching' in out, out[-4000:]
    assert left == 0, 'processes outlived the supervisor'
    assert not (tmp_path / 'got.npz').exists()


def test_diagnosis_of_records():
    """diagnose() from what ranks recorded (no MPI): bugs, stalls with lost hosts, hosts
    that started nothing, silent kills."""
    started = {0: {'rank': 0, 'host': 'h0'}, 1: {'rank': 1, 'host': 'h1'}}
    bug = {1: {'rank': 1, 'cause': supervision.EXCEPTION, 'fault': False,
               'detail': 'KeyError: 3', 'lost': []}}
    assert supervisor.diagnose(1, started, bug, False, 2).kind == 'error'
    mpi = {0: {'rank': 0, 'cause': supervision.EXCEPTION, 'fault': True,
               'detail': 'CollectiveError: x', 'lost': []}}
    assert supervisor.diagnose(1, started, mpi, False, 2).kind == 'fault'
    stall = {0: {'rank': 0, 'cause': supervision.STALL, 'fault': True, 'detail': '',
                 'lost': [1]}}
    found = supervisor.diagnose(1, started, stall, False, 2, ['h0', 'h1'])
    assert (found.kind, found.lost_hosts) == ('fault', ['h1']), found
    # a cut link: each side's stall abort names the other; rank 0's side stays
    both = {**stall, 1: {'rank': 1, 'cause': supervision.STALL, 'fault': True, 'detail': '',
                         'lost': [0]}}
    found = supervisor.diagnose(1, started, both, False, 2, ['h0', 'h1'])
    assert (found.kind, found.lost_hosts) == ('fault', ['h1']), found
    found = supervisor.diagnose(9, {0: started[0]}, {}, False, 2, ['h0', 'h1'])
    assert (found.kind, found.lost_hosts) == ('fault', ['h1']), found
    assert supervisor.diagnose(0, started, {}, False, 2).kind == 'ok'
    assert supervisor.diagnose(9, started, bug, True, 2).kind == 'interrupted'


def test_hostfiles_of_mpich_and_open_mpi(tmp_path):
    path = tmp_path / 'hosts'
    path.write_text('# cluster\nh0:2\nh1 slots=3\nh2\n')
    assert supervisor.parse_hostfile(str(path)) == [('h0', 2), ('h1', 3), ('h2', 1)]
    path.write_text('h0:zero\n')
    with pytest.raises(ValueError, match='slots must be a positive integer'):
        supervisor.parse_hostfile(str(path))
    assert supervisor.launch_argv(['mpiexec'], 3, [('h0', 2)], 'F', ['python', 't.py']) == [
        'mpiexec', '-hostfile', 'F', '-n', '3', 'python', 't.py']
    assert supervisor.launch_argv(['srun'], 3, [('h0', 2), ('h1', 1)], 'F', ['python']) == [
        'srun', '-n', '3', '--nodelist', 'h0,h1', 'python']


MODULE_SCRIPT = os.path.join(SCENARIOS_DIR, 'elastic_module.py')


def test_module_fit_resumes_mid_epoch_and_after_a_whole_epoch_bitwise(tmp_path,
                                                                     mpi_available):
    """State.fit under Module.fit, commits every 3 of 6 batches: killed at epoch 1 batch 4
    it resumes at batch 3 of epoch 1; killed at epoch 1 batch 0 it resumes after epoch 0's
    last batch. Both end bitwise equal to an uninterrupted fit."""
    runs = {}
    for name, kill in (('ref', ()), ('mid', ('--kill-epoch', 1, '--kill-batch', 4)),
                       ('whole', ('--kill-epoch', 1, '--kill-batch', 0))):
        folder = tmp_path / name
        folder.mkdir()
        status, out = supervise(folder, tmp_path / (name + '.npz'), *kill,
                                script=MODULE_SCRIPT)
        assert status == 0, out[-4000:]
        runs[name] = out
    assert launches(runs['ref']) == [1]
    assert 'launch 1: starting at epoch 1 batch 3 (restored: True)' in runs['mid']
    assert 'launch 1: starting at epoch 0 batch 6 (restored: True)' in runs['whole']
    want = weights(tmp_path / 'ref.npz')
    for name in ('mid', 'whole'):
        assert launches(runs[name]) == [1, 2], runs[name][-4000:]
        for got, ref in zip(weights(tmp_path / (name + '.npz')), want):
            assert np.array_equal(got, ref), (name, np.abs(got - ref).max())


def test_the_example_survives_a_killed_rank(tmp_path, mpi_available):
    """examples/train_elastic.py under the supervisor: rank 1 killed at step 3, commits every
    2 steps; the relaunch resumes at step 2 and finishes both epochs."""
    example = os.path.join(REPO_ROOT, 'examples', 'train_elastic.py')
    status, out = supervise(tmp_path, '--steps', 4, '--epochs', 2, '--commit-every', 2,
                            '--kill-at', 3, script=example)
    assert status == 0, out[-4000:]
    assert launches(out) == [1, 2], out[-4000:]
    assert 'launch 1: resuming at epoch 0, step 2' in out, out[-4000:]
    assert 'done: 2 epochs at 2 ranks' in out, out[-4000:]
    assert re.search(r'epoch 2/2: loss [0-9.]+, accuracy [0-9.]+', out), out[-4000:]


# -- elastic.State in this process (one rank) ----------------------------------------------

def test_state_of_a_dict_of_arrays_round_trips_and_keeps_the_last_commits(tmp_path):
    """The Horovod-style API's arrays: committed, changed, restored by a new State; extra
    values and numpy's random state come back; only the last 'keep' commits remain."""
    import mxnet as mx

    from mpi_kvstore import elastic
    arrays = {'w': mx.nd.array(np.arange(6.0).reshape(2, 3)), 'b': mx.nd.ones((3,))}
    state = elastic.State(arrays, directory=str(tmp_path), keep=2, step=0)
    assert not state.restored
    for step in range(3):
        arrays['w'][:] = arrays['w'] + 1
        state.step = step + 1
        np.random.seed(step)
        state.commit()
    expected_draw = np.random.rand()
    saved_w = arrays['w'].asnumpy().copy()
    arrays['w'][:] = 0
    np.random.seed(99)
    again = elastic.State(arrays, directory=str(tmp_path), keep=2, step=0)
    assert again.restored and again.step == 3 and again.restored_from == (3, 1)
    assert np.array_equal(arrays['w'].asnumpy(), saved_w)
    assert np.random.rand() == expected_draw      # the committed random state
    assert sorted(os.listdir(tmp_path)) == ['commit-00000002', 'commit-00000003']
    with pytest.raises(AttributeError, match="no value 'epoch'"):
        getattr(again, 'epoch')   # noqa: B009 (the attribute access is the test)


def test_state_refuses_what_cannot_be_restored_or_written(tmp_path):
    import mxnet as mx
    from mxnet import gluon

    from mpi_kvstore import elastic
    arrays = {'w': mx.nd.ones((2, 2))}
    elastic.State(arrays, directory=str(tmp_path)).commit()
    with pytest.raises(ValueError, match='do not fit this model'):
        elastic.State({'w': mx.nd.ones((3, 2))}, directory=str(tmp_path))
    net = gluon.nn.Dense(2, in_units=2)
    net.initialize()
    trainer = gluon.Trainer(net.collect_params(), 'sgd', kvstore=None)
    trainer._kv_initialized = True       # as after a first step
    elastic.State(net.collect_params(), trainer, directory=str(tmp_path / 'net')).commit()
    with pytest.raises(RuntimeError, match='before the trainer'):
        elastic.State(net.collect_params(), trainer, directory=str(tmp_path / 'net'))
    gone = tmp_path / 'gone'
    state = elastic.State(arrays, directory=str(gone))
    gone.rmdir()
    gone.write_text('no longer a directory')
    with pytest.raises(OSError, match=r'commit 1 to .* failed on rank 0'):
        state.commit()
    assert state.number == 0
