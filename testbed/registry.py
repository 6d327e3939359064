"""Which test beds are on this machine, who owns them, and taking them down.

The owner of a test bed is the process whose pid is in the prefix: the Python
process for :class:`testbed.Hosts`, a sleeping keeper process for ``python -m
testbed up``. A test bed whose owner is gone is stale; the next ``up`` tears it
down. An owning process also tears its test beds down at exit and on
SIGTERM/SIGHUP (guard).
"""
import atexit
import json
import os
import signal
import sys
import threading

from mpi_kvstore.launch.processes import kill, start_time, wait_gone

from .machine import TestbedError
from .network import (
    NAME_BASE,
    NAMED_RE,
    NETNS_ETC,
    PREFIX_RE,
    STATE_ROOT,
    artifacts,
    listdir,
    netns_names,
    processes_inside,
    remove,
    run_dir,
)

LOCK = threading.RLock()   # one claim or teardown at a time in this process
INSIDE_GRACE = 2.0         # seconds the processes in a test bed get to die of SIGKILL


# -- state and owners ------------------------------------------------------------------

def read_state(prefix):
    """Test bed PREFIX's state.json, or None."""
    try:
        with open(os.path.join(run_dir(prefix), 'state.json')) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def write_state(prefix, state):
    path = os.path.join(run_dir(prefix), 'state.json')
    with open(path + '.tmp', 'w') as f:
        json.dump(state, f, indent=1)
    os.replace(path + '.tmp', path)


def owner_pid(prefix):
    return int(PREFIX_RE.match(prefix).group(1))


def owner_alive(prefix, state):
    started = start_time(owner_pid(prefix))
    if started is None:
        return False
    # A reused pid is another process: the owner is gone.
    return not (state and state.get('owner_start') and state['owner_start'] != started)


def claim_prefix(owner):
    """A fresh prefix for a test bed of OWNER, its run directory made (the claim)."""
    os.makedirs(STATE_ROOT, exist_ok=True)
    base = '%s%d' % (NAME_BASE, owner)
    for seq in range(1000):
        prefix = base if seq == 0 else '%sn%d' % (base, seq)
        if netns_names(prefix) or any(n.startswith(prefix + '-') for n in listdir(NETNS_ETC)):
            continue
        for _ in range(3):
            try:
                os.mkdir(run_dir(prefix))   # atomic: the claim
                return prefix
            except FileExistsError:
                break
            except FileNotFoundError:        # a teardown removed the empty STATE_ROOT
                os.makedirs(STATE_ROOT, exist_ok=True)
    raise TestbedError('no free test bed name for pid %d' % owner)


def list_runs():
    """{prefix: {'live': owner still running, 'state': its state.json or None}}."""
    prefixes = {NAMED_RE.match(name).group(1) for name in netns_names()}
    prefixes.update(name for name in listdir(STATE_ROOT) if PREFIX_RE.match(name))
    prefixes.update(NAMED_RE.match(name).group(1) for name in listdir(NETNS_ETC)
                    if NAMED_RE.match(name))
    runs = {}
    for prefix in sorted(prefixes):
        state = read_state(prefix)
        runs[prefix] = {'live': owner_alive(prefix, state), 'state': state}
    return runs


# -- taking down -----------------------------------------------------------------------

def cleanup_stale(log=None):
    """Tear down every test bed whose owner is gone; return their prefixes."""
    gone = []
    for prefix, info in list_runs().items():
        if info['live']:
            continue
        try:
            teardown(prefix)
        except TestbedError as err:
            if log:
                log('testbed: stale %s: %s' % (prefix, err))
            continue
        gone.append(prefix)
        if log:
            log('testbed: removed stale test bed %s' % prefix)
    return gone


def teardown(prefix):
    """Remove test bed PREFIX: its processes, namespaces, mounts and files.

    Works from what is on the machine, so it also clears a half-built or stale
    test bed. Raises TestbedError naming what could not be removed.
    """
    if not PREFIX_RE.match(prefix):
        raise ValueError('not a test bed name: %r' % (prefix,))
    with LOCK:
        state = read_state(prefix)
        if state and state.get('keeper') and owner_alive(prefix, state):
            kill([owner_pid(prefix)])
        kill(processes_inside(prefix))
        wait_gone(lambda: processes_inside(prefix), INSIDE_GRACE)
        remove(prefix)
        remaining = artifacts(prefix)
    if remaining:
        raise TestbedError('test bed %s not fully removed: %s' % (prefix, ', '.join(remaining)))


# -- teardown on exit and on SIGTERM/SIGHUP ---------------------------------------------

_LIVE = []             # Hosts that are up and owned by this process
_SAVED_HANDLERS = {}


def _on_signal(signum, frame):
    # Unwinds `with Hosts(...)` blocks (and a job's wait), whose exits tear down.
    raise SystemExit(128 + signum)


def guard(hosts):
    """Take HOSTS down at exit, and on SIGTERM/SIGHUP where nobody else handles them."""
    with LOCK:
        _LIVE.append(hosts)
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if sig not in _SAVED_HANDLERS and signal.getsignal(sig) == signal.SIG_DFL:
                _SAVED_HANDLERS[sig] = signal.SIG_DFL
                signal.signal(sig, _on_signal)


def unguard(hosts):
    """Undo guard(HOSTS); the signal handlers go with the last guarded test bed."""
    with LOCK:
        if hosts in _LIVE:
            _LIVE.remove(hosts)
        if _LIVE or threading.current_thread() is not threading.main_thread():
            return
        for sig, previous in list(_SAVED_HANDLERS.items()):
            if signal.getsignal(sig) is _on_signal:
                signal.signal(sig, previous)
            del _SAVED_HANDLERS[sig]


@atexit.register
def _down_at_exit():
    # A copy: down() takes each one out of _LIVE.
    for hosts in list(_LIVE):
        try:
            hosts.down()
        except Exception as err:
            print('testbed: teardown at exit: %s' % err, file=sys.stderr)
