"""A rank that fails ends the job, fast and loudly; a stalled collective is named.

The scenarios run as users launch them (plain ``python``, not ``-m mpi4py``), so
only what the store itself installs can end the job. Times run from the moment a
scenario announces the failure to the moment the launcher has returned. The
pure parts of the stall inspector (report, rank lists, ages) are tested without MPI.
"""
import re
import sys
import threading
import time
import types

import pytest

from mpi_kvstore.comm.host import MPI
from mpi_kvstore.config import Config, ConfigError
from mpi_kvstore.designs import ENGINE_NAMES
from mpi_kvstore.faults import abort as faults
from mpi_kvstore.faults import stall

from mpi_harness import MPIRunError, run_mpi

EXCEPTION_EXIT_S = 30   # the other ranks are gone this soon after one raised
KILL_EXIT_S = 10        # ... after one was killed
STALL_WARNING, STALL_ABORT = 2, 6
# The inspecting rank itself measures how long the collective had waited when it aborts:
# at least stall_abort, and at most one inspection period (0.25 s at these thresholds) more,
# plus slack for its thread waking late on a busy machine.
STALL_REPORTED_MARGIN = 3.0
# Seen from outside, the job also needs the wait for answers of a rank that has not
# answered before (3 s) and the launcher's teardown of every rank, which a loaded 2-core
# machine can stretch by seconds; the bound says only that the abort ends the job, well
# before the timeout that a job which never aborts runs into.
STALL_WALL_MARGIN = 20.0
# That timeout counts from the launch, not from the stall: importing MXNet on every rank and
# reaching the stall took up to 22 s on a loaded machine before stall_abort even starts, so
# it only has to tell a job that aborts from one that never does.
STALL_JOB_TIMEOUT = 120
STALL_ENV = {'MPI_KVSTORE_STALL_WARNING': STALL_WARNING, 'MPI_KVSTORE_STALL_ABORT': STALL_ABORT}


def failed_job(nprocs, script, *args, marker, timeout, env=None):
    """Run a scenario that must end by itself, non-zero; return (error, seconds since MARKER)."""
    with pytest.raises(MPIRunError) as info:
        run_mpi(nprocs, script, *args, timeout=timeout, env=env, module_launch=False)
    end = time.time()
    err = info.value
    assert not err.timed_out, 'the job did not end by itself:\n%s' % str(err)[-3000:]
    assert err.returncode != 0
    stamp = re.search(r'%s at t=([0-9.]+)' % marker, err.output)
    assert stamp, 'the scenario never reached %r:\n%s' % (marker, err.output[-3000:])
    took = end - float(stamp.group(1))
    print('%s %s: exit status %d, %.1f s after %r' % (script, ' '.join(map(str, args)),
                                                      err.returncode, took, marker))
    return err, took


# -- a rank raises ---------------------------------------------------------------

@pytest.mark.parametrize('nprocs, mode, status, what', [
    (2, 'main', 1, 'raised an unhandled exception in the main thread (LoaderBug: '),
    (3, 'main', 1, 'raised an unhandled exception in the main thread (LoaderBug: '),
    (2, 'thread', 1, "raised an unhandled exception in thread 'loader' (LoaderBug: "),
    (2, 'interrupt', faults.INTERRUPT_STATUS,
     'was interrupted in the main thread (KeyboardInterrupt)'),
])
def test_unhandled_exception_on_one_rank_aborts_the_job(nprocs, mode, status, what,
                                                       mpi_available):
    err, took = failed_job(nprocs, 'fault_exception.py', mode, marker='rank 1 [a-z ]+',
                           timeout=2 * EXCEPTION_EXIT_S)
    assert took < EXCEPTION_EXIT_S, 'the job took %.1f s to end after rank 1 failed' % took
    assert err.returncode == status, err.output[-3000:]
    assert 'mpi_kvstore: rank 1 of %d %s' % (nprocs, what) in err.output, err.output[-3000:]
    if mode != 'interrupt':  # the hook it replaced still printed the traceback
        assert 'LoaderBug: rank 1: corrupt record in batch 3' in err.output


# -- a rank is killed -------------------------------------------------------------

def test_killed_rank_ends_the_job(mpi_available):
    err, took = failed_job(2, 'fault_kill.py', marker='rank 1 is killed',
                           timeout=3 * KILL_EXIT_S)
    assert took < KILL_EXIT_S, 'the job took %.1f s to end after rank 1 was killed' % took
    # MPICH: "KILLED BY SIGNAL: 9", "Killed (signal 9)"; Open MPI: "exited on signal 9".
    assert re.search(r'signal:? 9', err.output, re.I), err.output[-3000:]


# -- a rank skips a collective -------------------------------------------------------

def _stall_heading(rank, nprocs, action, knob, limit):
    return ('mpi_kvstore: rank %d of %d: stall: %scollectives pending for more than %s=%g s'
            % (rank, nprocs, action, knob, limit))


def _what_is_known_of_rank1(mode, env):
    if 'MPI4PY_RC_THREAD_LEVEL' in env:
        return 'not asked: rank 1'     # below MPI_THREAD_MULTIPLE: a local report
    if mode == 'exit':
        return 'no answer from rank 1 ('
    return 'not pushed by rank 1'


@pytest.mark.parametrize('nprocs, design, mode, env', [
    (2, 'funneled', 'sleep', {}),
    (3, 'funneled', 'sleep', {}),
    (2, 'chained', 'sleep', {}),    # an engine worker waits inside MPI
    # ready data run inline: the user's thread waits inside MPI, the GIL given up
    (2, 'chained', 'sleep', {'MPI_KVSTORE_INLINE_MAX_BYTES': '1M'}),
    (2, 'blocking', 'sleep', {}),   # the user's thread waits inside MPI
    (2, 'funneled', 'exit', {}),    # the skipping rank has finished: it cannot answer
    (2, 'funneled', 'sleep', {'MPI4PY_RC_THREAD_LEVEL': 'serialized'}),  # local report only
    # the scenario's 64-byte arrays cut in 4 pieces, 2 taken a round (schedule.py)
    (2, 'funneled', 'sleep', {'MPI_KVSTORE_PARTITION_BYTES': '16',
                              'MPI_KVSTORE_CREDIT_BYTES': '32'}),
    # the sharded optimizer: rank 1 skips a reduce-scatter, cut in pieces too
    (3, 'funneled', 'sleep', {'MPI_KVSTORE_SHARD_OPTIMIZER': '1',
                              'MPI_KVSTORE_PARTITION_BYTES': '16'}),
], ids=['np2', 'np3', 'chained', 'chained-inline', 'blocking', 'rank-exited', 'serialized',
        'partitioned', 'sharded'])
def test_stall_is_named_repeated_and_aborted(nprocs, design, mode, env, mpi_available):
    err, took = failed_job(nprocs, 'fault_stall.py', design, mode,
                           marker='rank 0 starts the last step', timeout=STALL_JOB_TIMEOUT,
                           env=dict(STALL_ENV, **env))
    out = err.output
    # never before stall_abort (a promise that load cannot break: it only makes things later)
    assert STALL_ABORT <= took < STALL_ABORT + STALL_WALL_MARGIN, (
        'aborted %.1f s after the stall began (stall_abort=%g s)' % (took, STALL_ABORT))
    assert err.returncode == faults.FAILURE_STATUS
    seq, key = re.search(r"rank 1 skips collective #(\d+) \(key '(\w+)'\)", out).groups()
    waiting = [r for r in range(nprocs) if r != 1]
    for rank in waiting:
        warnings = out.count(_stall_heading(rank, nprocs, '', 'stall_warning', STALL_WARNING))
        assert warnings >= 2, 'rank %d warned %d times before the abort:\n%s' % (
            rank, warnings, out[-3000:])
    aborts = [out.find(_stall_heading(rank, nprocs, 'aborting the job: ', 'stall_abort',
                                      STALL_ABORT)) for rank in waiting]
    assert any(at >= 0 for at in aborts), out[-3000:]
    # the age the aborting rank reports for the collective it gave up on
    waited = float(re.search(r': waiting ([0-9.]+) s; ', out[max(aborts):]).group(1))
    assert STALL_ABORT <= waited < STALL_ABORT + STALL_REPORTED_MARGIN, (waited, out[-3000:])
    rank1 = _what_is_known_of_rank1(mode, env)
    kind = 'reducescatter' if 'MPI_KVSTORE_SHARD_OPTIMIZER' in env else 'allreduce'
    named = re.escape("collective #%s (%s of key '%s'" % (seq, kind, key))
    who = re.escape('pushed by %s; %s' % (faults.rank_list(waiting), rank1))
    assert re.search(r'%s[^\n]*: waiting [0-9.]+ s; %s' % (named, who), out), out[-3000:]
    if rank1 == 'not pushed by rank 1':
        assert 'rank 1 has pushed %s collectives and waits on none' % seq in out


@pytest.mark.parametrize('dtype', ['float32', 'int32', 'uint8'])
@pytest.mark.parametrize('design', ENGINE_NAMES)
def test_mismatch_read_is_poisoned_and_the_exit_fails(design, dtype, mpi_available):
    """Shapes (6,4) and (4,6) at one position: no rank reads its own unsummed values, and a
    script that exits without another store call does not exit 0."""
    with pytest.raises(MPIRunError) as info:
        run_mpi(2, 'fault_mismatch_read.py', design, dtype, timeout=120, module_launch=False)
    out = info.value.output
    assert not info.value.timed_out and info.value.returncode != 0, out[-3000:]
    for rank in (0, 1):
        assert 'rank %d: output poisoned' % rank in out, out[-3000:]
        assert 'rank %d exits with an error that was never raised' % rank in out, out[-3000:]
    if design != 'chained':   # MXNet's own read raises the error first (docs/faults.md, the first table)
        assert out.count('first read raised MXNetError') == 2, out[-3000:]


def test_mismatch_read_blocking_raises_in_the_call(mpi_available):
    out = run_mpi(2, 'fault_mismatch_read.py', 'blocking', 'float32', timeout=120,
                  module_launch=False)
    assert out.count('call raised RankMismatchError') == 2 and out.count('output poisoned') == 2


# -- pure parts -----------------------------------------------------------------------

def test_rank_list_is_short():
    assert faults.rank_list([]) == 'no rank'
    assert faults.rank_list([3]) == 'rank 3'
    assert faults.rank_list([2, 0]) == 'ranks 0, 2'
    assert faults.rank_list([0, 1]) == 'ranks 0, 1'
    assert faults.rank_list([9, 0, 1, 2, 3, 5, 6]) == 'ranks 0-3, 5, 6, 9'
    assert faults.rank_list(range(4096)) == 'ranks 0-4095'


def _state(pushed, *pending):
    return pushed, list(pending)


WAIT11 = (11, "collective #11 (allreduce of key 'w')", 7.5)


def test_who_pushed_from_pushed_counts():
    states = {0: _state(12, WAIT11), 1: _state(11), 2: _state(12, WAIT11)}
    assert stall.who_pushed(11, 3, states) == 'pushed by ranks 0, 2; not pushed by rank 1'
    assert stall.who_pushed(10, 3, states) == 'pushed by ranks 0-2'
    del states[1]
    assert stall.who_pushed(11, 4, states) == (
        'pushed by ranks 0, 2; no answer from ranks 1, 3 (finished or closed its store, '
        'or hung where its inspector cannot run)')


def test_format_report_names_collectives_and_ranks():
    stalled = [(11, "collective #11 (allreduce of key 'w')", 7.5),
               (12, "collective #12 (allreduce of key 'b')", 7.25)]
    states = {0: _state(13, *stalled), 1: _state(11), 2: _state(13, WAIT11)}
    report = stall.format_report('HEAD', 0, 3, stalled, states).split('\n')
    assert report == [
        'HEAD',
        "  collective #11 (allreduce of key 'w'): waiting 7.5 s; pushed by ranks 0, 2; "
        'not pushed by rank 1',
        "  collective #12 (allreduce of key 'b'): waiting 7.2 s; pushed by ranks 0, 2; "
        'not pushed by rank 1',
        '  rank 1 has pushed 11 collectives and waits on none',   # the culprit comes first
        "  rank 2 has pushed 13 collectives and waits on collective #11 (allreduce of key 'w') "
        'for 7.5 s']


def test_format_report_is_bounded_and_says_when_it_is_local():
    stalled = [(s, 'collective #%d' % s, 9.0) for s in range(stall.MAX_LISTED + 5)]
    report = stall.format_report('HEAD', 0, 2, stalled, {0: _state(99)}, note='NOTE')
    lines = report.split('\n')
    assert len(lines) == 1 + stall.MAX_LISTED + 2
    assert lines[-2] == '  ... and 5 more'
    assert lines[-1] == '  NOTE'
    assert lines[1].endswith('pushed by rank 0; not asked: rank 1')


def _req(seq, done=False):
    return types.SimpleNamespace(seq=seq, done=done)


def test_pending_ages_are_sampled_from_first_sight():
    ages = stall.PendingAges()
    a, b, c, unnumbered = _req(3), _req(4), _req(5, done=True), _req(-1)
    ages.update([b, a, c, unnumbered], now=10.0)
    assert [(r.seq, age) for r, age in ages.ages(12.0)] == [(3, 2.0), (4, 2.0)]
    a.done = True
    d = _req(6)
    ages.update([b, d], now=13.0)   # a finished and left; b keeps its first sighting
    assert [(r.seq, age) for r, age in ages.ages(14.0)] == [(4, 4.0), (6, 1.0)]


def test_inspection_period_follows_the_shortest_threshold():
    assert stall.inspection_period(60.0, 0.0) == 1.0
    assert stall.inspection_period(2.0, 6.0) == 0.25
    assert stall.inspection_period(0.0, 0.2) == 0.1


def test_stall_knobs():
    config = Config(environ={})
    assert (config.stall_warning, config.stall_abort) == (60.0, 600.0)
    config = Config(environ={'MPI_KVSTORE_STALL_WARNING': '2.5', 'MPI_KVSTORE_STALL_ABORT': '9'})
    assert (config.stall_warning, config.stall_abort) == (2.5, 9.0)
    with pytest.raises(ConfigError, match='MPI_KVSTORE_STALL_ABORT'):
        Config(environ={'MPI_KVSTORE_STALL_ABORT': '-1'})


def test_inspector_of_one_rank_starts_nothing():
    before = threading.active_count()
    inspector = stall.StallInspector(MPI.COMM_SELF, Config(environ={}), None, list)
    assert threading.active_count() == before
    inspector.stop()
    inspector.stop()


# -- the abort hook, with MPI_Abort replaced ----------------------------------------------

@pytest.fixture
def hooks(monkeypatch):
    """Fresh hooks over recording ones; aborts recorded instead of done."""
    seen, aborts = [], []
    monkeypatch.setattr(sys, 'excepthook', lambda *exc: seen.append(exc[0]))
    monkeypatch.setattr(threading, 'excepthook', lambda args: seen.append(args.exc_type))
    monkeypatch.setattr(faults, '_hooks_installed', False)
    monkeypatch.setattr(faults, 'abort_job', lambda msg, status: aborts.append((msg, status)))
    monkeypatch.setattr(faults, 'world', lambda: (1, 4))
    faults.install_abort_hook()
    faults.install_abort_hook()   # idempotent: one wrapper, not two
    return seen, aborts


def test_abort_hook_chains_then_aborts_naming_the_rank(hooks):
    seen, aborts = hooks
    sys.excepthook(ValueError, ValueError('bad batch'), None)
    assert seen == [ValueError]
    assert aborts == [('mpi_kvstore: rank 1 of 4 raised an unhandled exception in the main '
                       'thread (ValueError: bad batch); aborting the job, whose other ranks '
                       'would otherwise wait for it forever', faults.FAILURE_STATUS)]


def test_abort_hook_covers_threads_and_interrupts_but_not_thread_exit(hooks):
    seen, aborts = hooks
    thread = types.SimpleNamespace(name='loader')
    for exc_type in (KeyError, SystemExit):
        threading.excepthook(types.SimpleNamespace(exc_type=exc_type, exc_value=exc_type(),
                                                   exc_traceback=None, thread=thread))
    sys.excepthook(KeyboardInterrupt, KeyboardInterrupt(), None)
    assert seen == [KeyError, SystemExit, KeyboardInterrupt]
    assert [status for _, status in aborts] == [faults.FAILURE_STATUS, faults.INTERRUPT_STATUS]
    assert "in thread 'loader' (KeyError)" in aborts[0][0]
    assert 'rank 1 of 4 was interrupted in the main thread (KeyboardInterrupt)' in aborts[1][0]


def test_single_process_exits_as_python_would(hooks, monkeypatch):
    seen, aborts = hooks
    monkeypatch.setattr(faults, 'world', lambda: (0, 1))
    sys.excepthook(ValueError, ValueError('x'), None)
    assert seen == [ValueError] and aborts == []
