"""Launch multi-process MPI scenarios from pytest, with a hard timeout.

Every rank runs as ``python -m mpi4py SCRIPT``, so an uncaught exception on
any rank calls MPI_Abort and ends the whole job instead of leaving the other
ranks waiting for it; ``module_launch=False`` runs ``python SCRIPT`` instead,
as users launch, for tests of what the library itself does when a rank
fails. The timeout covers what an abort cannot: a rank that hangs. Either
way the test fails with the tail of the job's output, and no rank is left
running afterwards (process groups and the run-id search: mpi_kvstore.launch.processes).

    from mpi_harness import mpi_sizes, result, run_mpi

    @mpi_sizes
    def test_something(nprocs, mpi_available):
        out = run_mpi(nprocs, 'my_scenario.py', '--flag')
        ranks = result(out, 'my_scenario')['ranks']   # what scenarios/common.report printed

"""
# The project formats with '%' throughout (as testbed/ruff.toml says for testbed/);
# rewriting every format string here would be churn with no defect behind it.
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

# One process-group helper for the test bed and this harness (tests/conftest.py puts
# the repository root, which holds testbed/, on sys.path).
from mpi_kvstore.launch import processes

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS_DIR)
SCENARIOS_DIR = os.path.join(TESTS_DIR, 'scenarios')

MPI_SIZES = (1, 2, 3)
DEFAULT_TIMEOUT = 180      # seconds for one whole job, launch to exit
OUTPUT_TAIL_CHARS = 4000   # how much of the output a failure message quotes
KILL_GRACE = 5.0           # seconds mpiexec gets after SIGTERM to end its ranks
LEFTOVER_GRACE = 1.0       # seconds ranks get to exit after mpiexec has

# Every process of one job inherits this variable with a fresh value, which
# finds ranks that left mpiexec's process group (hydra starts each rank in a
# session of its own, so killpg alone does not reach them).
_RUN_ID_VAR = 'MPI_HARNESS_RUN_ID'

MISSING_MPIEXEC = (
    'mpiexec not found next to %s nor on PATH; install an MPI, for example '
    "pip install -e '.[cpu,mpich]'" % sys.executable)


def parametrize_sizes(sizes=MPI_SIZES, argname='nprocs'):
    """A pytest parametrize mark over process counts, with ids np1, np2, ..."""
    return pytest.mark.parametrize(argname, sizes, ids=lambda n: 'np%d' % n)


mpi_sizes = parametrize_sizes()


class MPIRunError(AssertionError):
    """An MPI job failed; the message ends with the tail of its output.

    An AssertionError, so an unexpected one reads as a plain test failure.
    """

    def __init__(self, message, returncode, output, timed_out=False):
        super().__init__(message)
        self.returncode = returncode
        self.output = output
        self.timed_out = timed_out


class MPITimeout(MPIRunError):
    """An MPI job ran past its timeout and was killed."""


def find_mpiexec():
    """Path of mpiexec, or None.

    The one next to the interpreter comes first: the 'mpich' extra installs it
    into the venv, and it matches the MPI library that mpi4py loads there.
    """
    beside = os.path.join(os.path.dirname(sys.executable), 'mpiexec')
    if os.path.isfile(beside) and os.access(beside, os.X_OK):
        return beside
    return shutil.which('mpiexec')


def require_mpiexec():
    """Path of mpiexec; fails the test (never skips): CI installs MPI."""
    mpiexec = find_mpiexec()
    if mpiexec is None:
        pytest.fail(MISSING_MPIEXEC, pytrace=False)
    return mpiexec


@functools.cache
def launcher_flags(mpiexec):
    """Extra mpiexec flags this MPI needs to run N ranks on a small machine.

    MPICH's hydra oversubscribes cores without being asked and forks local
    ranks itself (no ssh involved), so it needs nothing. Open MPI refuses more
    ranks than cores, and refuses to run as root (CI runs as root).
    """
    try:
        version = subprocess.run(
            [mpiexec, '--version'], stdin=subprocess.DEVNULL,
            capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ()
    if 'Open MPI' not in version and 'OpenRTE' not in version:
        return ()
    flags = ['--oversubscribe']
    if os.geteuid() == 0:
        flags.append('--allow-run-as-root')
    return tuple(flags)


def resolve_script(script):
    """A scenario path as given, else under tests/scenarios/, else the repo root."""
    for candidate in (script, os.path.join(SCENARIOS_DIR, script),
                      os.path.join(REPO_ROOT, script)):
        if os.path.isfile(candidate):
            return os.path.abspath(candidate)
    pytest.fail('MPI scenario not found: %s' % script, pytrace=False)


def mpi_command(nprocs, script, args=(), module_launch=True, launcher=None):
    """The argv that runs SCRIPT on NPROCS ranks (under ``-m mpi4py`` unless told not to).

    LAUNCHER, when given, is a function of NPROCS returning the argv that starts
    that many ranks, up to the program (testbed.Hosts.launcher_for gives one that
    spreads them over test hosts); by default, this machine's mpiexec.
    """
    if launcher is None:
        mpiexec = require_mpiexec()
        launch = [mpiexec, *launcher_flags(mpiexec), '-n', str(nprocs)]
    else:
        launch = [str(word) for word in launcher(nprocs)]
    python = [sys.executable, '-m', 'mpi4py'] if module_launch else [sys.executable]
    return launch + python + [resolve_script(script)] + [str(arg) for arg in args]


def child_env(env=None, run_id=''):
    """The ranks' environment: ours, plus the harness settings, plus ENV.

    MXNET_* variables pass through untouched; ENV overrides anything, and a
    value of None removes that variable. RUN_ID marks every process of the job.
    """
    child = dict(os.environ)
    child['OMP_NUM_THREADS'] = '1'  # 2 cores shared by all ranks
    child['PYTHONUNBUFFERED'] = '1'  # a killed job still shows what it printed
    old_path = child.get('PYTHONPATH')
    child['PYTHONPATH'] = os.pathsep.join(
        [REPO_ROOT] + ([old_path] if old_path else []))
    return processes.marked_environ(child, env, _RUN_ID_VAR, run_id)


def run_mpi(nprocs, script, *args, timeout=DEFAULT_TIMEOUT, env=None, module_launch=True,
            launcher=None):
    """Run SCRIPT on NPROCS ranks; return the job's stdout and stderr as text.

    Raises MPIRunError (with the output tail) when the job exits non-zero, and
    MPITimeout when it runs past TIMEOUT seconds, after killing every rank.
    ``module_launch=False`` starts ranks as plain ``python SCRIPT``; LAUNCHER
    replaces the mpiexec command (see mpi_command).
    """
    cmd = mpi_command(nprocs, script, args, module_launch, launcher)
    run_id = uuid.uuid4().hex
    start = time.monotonic()
    # A file, not a pipe: a rank that outlived mpiexec would keep a pipe open
    # and block the read forever.
    with tempfile.TemporaryFile() as log:
        returncode, timed_out = _wait_for_job(
            cmd, child_env(env, run_id), log, timeout)
        killed = kill_leftovers(run_id)
        log.seek(0)
        output = log.read().decode('utf-8', 'replace')
    if killed:
        output += '\n[mpi_harness] killed %d leftover process(es)\n' % killed
    elapsed = time.monotonic() - start
    _log_job(elapsed, nprocs, script, args)
    if timed_out:
        _raise_failure(MPITimeout, cmd, 'timed out after %g s' % timeout,
                       returncode, output)
    if returncode != 0:
        _raise_failure(MPIRunError, cmd, 'exited with code %d after %.1f s'
                       % (returncode, elapsed), returncode, output)
    return output


_BATCHES = {}   # (nprocs, script, designs, args, env) -> the output of its one job


def run_designs(nprocs, script, design, designs, *args, timeout=DEFAULT_TIMEOUT, env=None,
                launcher=None):
    """run_mpi(NPROCS, SCRIPT, DESIGN, *ARGS), from one job that runs it for every design
    in DESIGNS in turn (scenarios/each_design.py); return DESIGN's part of its output.

    The first test of a batch starts the job and the others read its output, so each
    design keeps a test of its own and a job's start-up is paid once, not once per design.
    A design whose part did not end (an error, or a timeout, ended the job) is run again
    alone, so that its own failure, with its whole output, is what its test reports.
    """
    designs = tuple(designs)
    if design not in designs:
        raise ValueError('design %r is not in its batch %s' % (design, designs))
    where = tuple(map(str, launcher(nprocs))) if launcher else ()   # the hosts, for one
    key = (nprocs, script, designs, args, tuple(sorted((env or {}).items())), where)
    if key not in _BATCHES:
        try:
            _BATCHES[key] = run_mpi(nprocs, 'each_design.py', script, ','.join(designs), *args,
                                    timeout=timeout * len(designs), env=env, launcher=launcher)
        except MPIRunError as err:
            _BATCHES[key] = err.output
    output = _BATCHES[key]
    # scenarios/each_design.py's BEGIN and END, which rank 0 prints; not imported from it,
    # since importing it starts MPI and MXNet in this process
    begin, end = '[each_design] begin %s\n' % design, '[each_design] end %s\n' % design
    start = output.find(begin)
    stop = output.find(end, start)
    if start < 0 or stop < 0:
        return run_mpi(nprocs, script, design, *args, timeout=timeout, env=env,
                       launcher=launcher)
    return output[start + len(begin):stop]


_JOINT = {}   # (nprocs, the runs, env, hosts) -> the output of the one job that ran them all
# The designs of the tests pytest selected (tests/conftest.py sets it; None: no test of a
# design): a joint job runs no other design.
SELECTED_DESIGNS = None
# id(a module's JOINT) -> how many of its tests (batches of designs) pytest selected
# (tests/conftest.py sets it; a JOINT not in it: no filter)
SELECTED_JOINT = {}
# Below this many selected tests of a module, each takes run_designs' job of its own: the
# joint job runs every scenario of its size, which costs more than it saves for a few
JOINT_MIN_TESTS = 4


def run_joint(nprocs, script, design, designs, *args, joint, timeout=DEFAULT_TIMEOUT, env=None,
              launcher=None):
    """run_designs(NPROCS, SCRIPT, DESIGN, DESIGNS, *ARGS), from one job that runs, in turn,
    every scenario of JOINT that runs at NPROCS, each for each of its designs (on the
    hosts of LAUNCHER, if given: see mpi_command).

    JOINT lists (script, args, designs, sizes): the scenarios of one test module that share
    a size and ENV. Starting the ranks costs more than most scenarios (MXNet's import: about
    3 s of CPU a rank), so tests of different scenarios at one size share that cost too, as
    the designs of one test do (run_designs). Each test still gets only its own part; a test
    whose part is not in that job (a scenario before it failed and ended the job, it timed
    out, or the run is not in JOINT) gets it from run_designs, as it would without JOINT.
    A joint job runs only the designs of the tests selected (SELECTED_DESIGNS), and only
    where JOINT_MIN_TESTS or more tests of the module were selected; under pytest-xdist,
    whose workers share no job, each test gets its run from run_designs.
    """
    chosen = SELECTED_DESIGNS
    runs = tuple((str(s), tuple(map(str, a)),
                  tuple(x for x in d if chosen is None or x in chosen))
                 for s, a, d, sizes in joint if nprocs in sizes)
    runs = tuple(run for run in runs if run[2])
    mine = (str(script), tuple(map(str, args)))
    batched = functools.partial(run_designs, nprocs, script, design, designs, *args,
                                timeout=timeout, env=env, launcher=launcher)
    if (os.environ.get('PYTEST_XDIST_WORKER')
            or SELECTED_JOINT.get(id(joint), JOINT_MIN_TESTS) < JOINT_MIN_TESTS
            or not any((s, a) == mine and design in d for s, a, d in runs)):
        return batched()
    where = tuple(map(str, launcher(nprocs))) if launcher else ()   # the hosts, for one
    key = (nprocs, runs, tuple(sorted((env or {}).items())), where)
    if key not in _JOINT:
        # a job that hangs goes to run_designs' own jobs at the end of this bound: a bound
        # of one test's batch, many times what the joint job takes
        bound = timeout * max(len(d) for _, _, d in runs)
        try:
            _JOINT[key] = run_mpi(nprocs, 'each_design.py', '--joint', json.dumps(runs),
                                  timeout=bound, env=env, launcher=launcher)
        except MPIRunError as err:
            _JOINT[key] = err.output
    output = _JOINT[key]
    # scenarios/each_design.py's label of a run of a joint job
    label = ' '.join((mine[0], design) + mine[1])
    begin, end = '[each_design] begin %s\n' % label, '[each_design] end %s\n' % label
    start = output.find(begin)
    stop = output.find(end, start)
    if start < 0 or stop < 0:
        return batched()
    return output[start + len(begin):stop]


# scenarios/common.py's RESULT, which starts each line that report() prints; not imported
# from there, since importing it starts MPI in this process
_RESULT_LINE = re.compile(r'^\[result\] (\{.*\})$', re.M)


def results(output, name=None):
    """The JSON lines that scenarios/common.report printed in OUTPUT, in order, each
    {'name', 'size', 'ranks': [each rank's values]}; only NAME's when it is given."""
    found = [json.loads(line) for line in _RESULT_LINE.findall(output)]
    return [r for r in found if name is None or r['name'] == name]


def result(output, name):
    """The last report named NAME in OUTPUT; fails the test, quoting OUTPUT's tail, if none."""
    found = results(output, name)
    assert found, 'no [result] line named %r in:\n%s' % (name, output[-OUTPUT_TAIL_CHARS:])
    return found[-1]


def soak_growth(output):
    """Each worker's line of a resets' soak (scenarios/memory_probe.report_growth) in
    OUTPUT, in order: (worker, resets, RSS growth in MB, descriptors' growth, threads at
    the first reset, threads at the last, the sum trained)."""
    found = re.findall(r'worker (\d+): resets (\d+), rss growth ([-0-9.]+) MB, fd growth '
                       r'(-?\d+), threads (\d+) -> (\d+), sum ([0-9.e+]+)', output)
    return [(int(w), int(n), float(rss), int(fds), int(before), int(after), float(total))
            for w, n, rss, fds, before, after, total in found]


def _log_job(elapsed, nprocs, script, args):
    """Append one line per job to $MPI_HARNESS_LOG, if set: where the suite's time goes."""
    path = os.environ.get('MPI_HARNESS_LOG')
    if path:
        with open(path, 'a') as f:
            f.write('%.2f\t%d\t%s\t%s\t%s\n' % (
                elapsed, nprocs, os.path.basename(str(script)), ' '.join(map(str, args)),
                os.environ.get('PYTEST_CURRENT_TEST', '')))


def _wait_for_job(cmd, env, log, timeout):
    """Start the job in its own session; return (returncode, timed_out).

    At the timeout, and on Ctrl-C or a pytest-level interrupt (re-raised), mpiexec's
    process group gets SIGTERM, then SIGKILL after KILL_GRACE seconds.
    """
    proc = processes.start_group(cmd, stdin=subprocess.DEVNULL, stdout=log,
                                 stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)
    return processes.wait_or_stop(proc, timeout, KILL_GRACE)


def kill_leftovers(run_id, grace=LEFTOVER_GRACE):
    """SIGKILL every process still carrying RUN_ID after GRACE seconds; return how many."""
    return len(processes.kill_marked(_RUN_ID_VAR, run_id, grace))


# True while a pid runs, a zombie counting as dead; tests/test_harness.py checks ranks with it.
process_alive = processes.alive


def _raise_failure(kind, cmd, what, returncode, output):
    tail = output[-OUTPUT_TAIL_CHARS:]
    message = '%s %s\n--- last %d chars of output ---\n%s' % (
        ' '.join(cmd), what, len(tail), tail)
    raise kind(message, returncode, output, timed_out=kind is MPITimeout)


# -- elastic jobs under the supervisor ------------------------------------------------------------
def run_elastic(script, *script_args, workers=3, timeout=150, job_timeout=None, options=()):
    """``python -m mpi_kvstore run --elastic -n WORKERS --elastic-timeout TIMEOUT OPTIONS --
    python SCRIPT ARGS`` -> its output. The job must end with status 0 within JOB_TIMEOUT
    (default TIMEOUT + 30 s) and leave no process behind."""
    run_id = uuid.uuid4().hex
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=os.pathsep.join(
        [REPO_ROOT, SCENARIOS_DIR]), **{_RUN_ID_VAR: run_id})
    argv = [sys.executable, '-m', 'mpi_kvstore', 'run', '--elastic', '-n', str(workers),
            '--elastic-timeout', str(timeout), *[str(o) for o in options], '--',
            sys.executable, resolve_script(script), *[str(a) for a in script_args]]
    try:
        done = subprocess.run(argv, env=env, capture_output=True, text=True,
                              timeout=job_timeout or timeout + 30, cwd=REPO_ROOT)
    finally:
        left = kill_leftovers(run_id)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-OUTPUT_TAIL_CHARS:]
    assert left == 0, 'processes outlived the job\n' + output[-3000:]
    return output


def npz_arrays(path):
    """The arrays ``np.savez(path, *arrays)`` wrote, in order."""
    import numpy as np
    with np.load(path) as got:
        return [got['arr_%d' % i] for i in range(len(got.files))]


def workers_agree(out, workers):
    """Every worker's ``OUT.<id>.npz`` holds bitwise the same arrays: -> worker 0's."""
    import numpy as np
    got = [npz_arrays('%s.%d.npz' % (out, worker)) for worker in workers]
    for other in got[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(got[0], other))
    return got[0]
