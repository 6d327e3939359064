"""Process groups, and the processes of a job that left its group.

A job starts in a session of its own, so that its process group can be signalled
as a whole. A process that left the group (hydra starts each rank in a session of
its own, so killpg alone does not reach it) is found by a marker variable that
every process of the job inherits from the job's environment.

One helper for ``python -m mpi_kvstore run`` (supervisor.py), the test bed (testbed/) and
the test harness (tests/mpi_harness.py). Reads Linux /proc; without it, the group signal is
all there is. Knows nothing of MPI or test beds.
"""
import os
import signal
import subprocess
import time

POLL_S = 0.05    # seconds between two looks at /proc while waiting for processes to go


def start_group(argv, **popen_kwargs):
    """Popen ARGV in a new session: its pid is the id of a process group of its own."""
    return subprocess.Popen(argv, start_new_session=True, **popen_kwargs)


def signal_group(pgid, sig):
    """SIG to process group PGID; nothing when the group is gone or not ours."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_group(proc, grace):
    """End PROC's process group, politely first, then by force; PROC's status."""
    # On SIGTERM both hydra and Open MPI's launcher tear down their ranks and say
    # which ones were still running; that text is worth the GRACE seconds.
    signal_group(proc.pid, signal.SIGTERM)
    try:
        return proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        signal_group(proc.pid, signal.SIGKILL)
        return proc.wait()


def wait_or_stop(proc, timeout, grace):
    """(status, timed_out): wait up to TIMEOUT seconds for PROC, then stop its group.

    An interrupted wait (Ctrl-C, a signal turned into SystemExit, a pytest-level
    interrupt) also stops the group before it propagates: nothing is left running
    behind the caller.
    """
    try:
        return proc.wait(timeout=timeout), False
    except subprocess.TimeoutExpired:
        return stop_group(proc, grace), True
    except BaseException:
        stop_group(proc, grace)
        raise


def pids():
    """Every pid in /proc; none without /proc."""
    try:
        return [int(entry) for entry in os.listdir('/proc') if entry.isdigit()]
    except OSError:
        return []


def start_time(pid):
    """The start time of PID (from /proc), or None when it is not running.

    With the pid it names one process: a pid reused by another has another start time.
    """
    try:
        with open('/proc/%d/stat' % pid, 'rb') as f:
            fields = f.read().rsplit(b')', 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] == b'Z':
        return None
    return fields[19].decode()


def alive(pid):
    """True while PID runs; a zombie (exited, not yet reaped) counts as dead."""
    try:
        with open('/proc/%d/stat' % pid, 'rb') as f:
            # The state letter follows the parenthesised command name.
            return f.read().rsplit(b')', 1)[1].split()[0] != b'Z'
    except FileNotFoundError:
        return False
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def kill(pids, sig=signal.SIGKILL):
    """SIG to each of PIDS; those already gone, or not ours, are passed over."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def wait_gone(find, grace):
    """Poll FIND() for up to GRACE seconds until it lists no pid; return the last list."""
    deadline = time.monotonic() + grace
    found = find()
    while found and time.monotonic() < deadline:
        time.sleep(POLL_S)
        found = find()
    return found


def marked_environ(base, overrides, var, value):
    """A copy of BASE with OVERRIDES (a value of None removes a variable) and VAR=VALUE.

    VAR=VALUE is the marker that marked() finds in every process of the job.
    """
    env = dict(base)
    for name, setting in (overrides or {}).items():
        if setting is None:
            env.pop(name, None)
        else:
            env[name] = str(setting)
    env[var] = value
    return env


def marked(var, value):
    """Live pids whose environment carries VAR=VALUE."""
    marker = ('%s=%s' % (var, value)).encode()
    return [pid for pid in pids() if _environ_has(pid, marker) and alive(pid)]


def _environ_has(pid, marker):
    try:
        with open('/proc/%d/environ' % pid, 'rb') as f:
            return marker in f.read().split(b'\0')
    except OSError:
        return False


def kill_marked(var, value, grace):
    """SIGKILL every process still carrying VAR=VALUE after GRACE seconds; their pids."""
    # After an abort, mpiexec may exit while its ranks are still dying from the
    # signal it sent them; give them a moment before counting them.
    leftovers = wait_gone(lambda: marked(var, value), grace)
    kill(leftovers)
    return leftovers
