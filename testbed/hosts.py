"""Test hosts as network namespaces on one machine, and MPI jobs across them.

Layout of one test bed, named by a prefix unique to the run (``mkvtb<pid>``, or
``mkvtb<pid>n<k>`` for the k-th concurrent one of that process)::

    netns PREFIX-br:  bridge br0, ports h0, h1, ...      (no address, no uplink)
    netns PREFIX-h0:  eth0 198.18.0.1/24 (peer h0 on br0), lo; hostname h0
    netns PREFIX-h1:  eth0 198.18.0.2/24 (peer h1 on br0), lo; hostname h1
    /run/mkvtb/PREFIX/        state.json, h<i>.uts (persistent UTS namespaces),
                              launch (the ssh stand-in), mpiexec (a wrapper)
    /etc/netns/PREFIX-h<i>/hosts   names every host; ``ip netns exec`` mounts it on /etc/hosts

The veth pairs are created directly inside their namespaces, so the root network
namespace never holds an interface of the test bed; deleting the namespaces
deletes everything in them. The only route in a host is its connected /24, and
the bridge has no uplink: no packet can leave the test bed. With a rate, each
link is shaped by tbf in both directions (egress of eth0 inside the host, egress
of the bridge port), so a host has a full-duplex link of that rate.

The owner of a test bed is the process whose pid is in the prefix: the Python
process for :class:`Hosts`, a sleeping keeper process for ``python -m testbed up``.
A test bed whose owner is gone is stale; the next ``up`` tears it down.
"""
import atexit
import functools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid

NAME_BASE = 'mkvtb'
STATE_ROOT = '/run/mkvtb'
NETNS_RUN = '/run/netns'     # where ``ip netns add`` mounts a namespace
NETNS_ETC = '/etc/netns'     # what ``ip netns exec`` mounts over /etc
BRIDGE_SUFFIX = 'br'
BRIDGE = 'br0'
IFACE = 'eth0'               # every host's interface has this name, inside its namespace
SUBNET = '198.18.0.'         # 198.18.0.0/24, inside the RFC 2544 range 198.18.0.0/15
SUBNET_BITS = 24
MAX_HOSTS = 64

# Real TCP between ranks on different hosts: MPICH's default (UCX with every
# transport) finds the shared memory of the one kernel even across namespaces.
TCP_ENV = {'MPICH_CH4_NETMOD': 'ucx', 'UCX_TLS': 'tcp', 'UCX_NET_DEVICES': IFACE}

DEFAULT_TIMEOUT = 600.0      # seconds for one job run through the test bed
KILL_GRACE = 5.0             # seconds a job gets after SIGTERM before SIGKILL
LEFTOVER_GRACE = 1.0         # seconds processes of an ended job get to exit
TBF_LATENCY = '20ms'         # how long a packet may wait in the shaper's queue
TBF_BURST_S = 0.002          # bucket size, in seconds at the rate
TBF_MIN_BURST = 16 * 1024    # bytes; above any MTU
RUN_VAR = 'MKVTB_RUN_ID'     # every process of one job carries it: finds leftovers
KEEPER_ARGV = ['sleep', '2147483647']

_RUN_RE = re.compile(r'^%s(\d+)(?:n\d+)?$' % NAME_BASE)
_NAMED_RE = re.compile(r'^(%s\d+(?:n\d+)?)-' % NAME_BASE)
_LOCK = threading.RLock()


class TestbedError(RuntimeError):
    """The test bed could not be built, used or torn down."""

    __test__ = False   # not a pytest test class


# -- what the machine offers -------------------------------------------------------

def _which(tool):
    for directory in ('/usr/sbin', '/sbin', '/usr/bin', '/bin'):
        path = os.path.join(directory, tool)
        if os.access(path, os.X_OK):
            return path
    return shutil.which(tool)


def _tool(tool):
    path = _which(tool)
    if path is None:
        raise TestbedError('the test bed needs %s on PATH' % tool)
    return path


def find_mpiexec():
    """mpiexec beside this interpreter (the venv's 'mpich' wheel), else on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), 'mpiexec')
    if os.access(beside, os.X_OK):
        return beside
    return shutil.which('mpiexec')


@functools.lru_cache(maxsize=None)
def _is_hydra(mpiexec):
    try:
        out = subprocess.run([mpiexec, '--version'], stdin=subprocess.DEVNULL,
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return 'HYDRA' in out


def _probe(argv):
    """'' when ARGV runs, else why not."""
    try:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        return str(err)
    if proc.returncode != 0:
        return (proc.stderr or proc.stdout).strip() or 'exit status %d' % proc.returncode
    return ''


@functools.lru_cache(maxsize=None)
def available(rate=False, mpi=False):
    """(True, '') where a test bed can be built here, else (False, why not).

    RATE: links will be shaped (needs tc and the tbf qdisc). MPI: jobs will be
    launched across the hosts (needs MPICH's hydra mpiexec). Probes in throwaway
    namespaces, which vanish with the probe.
    """
    if not sys.platform.startswith('linux'):
        return False, 'the test bed needs Linux network namespaces'
    if os.geteuid() != 0:
        return False, 'the test bed needs root (it creates network namespaces)'
    tools = ['ip', 'nsenter', 'unshare', 'umount'] + (['tc'] if rate else [])
    missing = [tool for tool in tools if _which(tool) is None]
    if missing:
        return False, 'the test bed needs %s on PATH' % ', '.join(missing)
    unshare, ip = _which('unshare'), _which('ip')
    probes = [[unshare, '--net', '--uts', '--', ip, 'link', 'add', 'p0', 'type', 'veth',
               'peer', 'name', 'p1'],
              [unshare, '--net', '--', ip, 'link', 'add', 'b0', 'type', 'bridge']]
    if rate:
        probes.append([unshare, '--net', '--', _which('tc'), 'qdisc', 'add', 'dev', 'lo',
                       'root', 'tbf', 'rate', '1gbit', 'burst', '32kb', 'latency', '10ms'])
    for argv in probes:
        why = _probe(argv)
        if why:
            return False, 'cannot build a test bed here: %s: %s' % (' '.join(argv[4:]), why)
    if mpi:
        mpiexec = find_mpiexec()
        if mpiexec is None:
            return False, 'no mpiexec beside %s nor on PATH' % sys.executable
        if not _is_hydra(mpiexec):
            return False, '%s is not MPICH hydra (the test bed launches with hydra)' % mpiexec
    return True, ''


_RATE_UNITS = {'': 1, 'k': 10 ** 3, 'm': 10 ** 6, 'g': 10 ** 9, 't': 10 ** 12}


def parse_rate(rate):
    """Bits per second from a tc-style rate: '3gbit', '500mbit', '125mbps', or a number."""
    if isinstance(rate, (int, float)) and not isinstance(rate, bool):
        bits = float(rate)
    else:
        match = re.fullmatch(r'\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(bit|bps)?\s*', str(rate).lower())
        if not match:
            raise ValueError('rate %r: expected a number with kbit, mbit, gbit (or bps) units'
                             % (rate,))
        bits = float(match.group(1)) * _RATE_UNITS[match.group(2)]
        if match.group(3) == 'bps':
            bits *= 8
    if bits < 10 ** 5:
        raise ValueError('rate %r is below 100kbit' % (rate,))
    return int(bits)


# -- processes ---------------------------------------------------------------------

def _start_time(pid):
    """The start time of PID (from /proc), or None when it is not running."""
    try:
        with open('/proc/%d/stat' % pid, 'rb') as f:
            fields = f.read().rsplit(b')', 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] == b'Z':
        return None
    return fields[19].decode()


def _pids():
    try:
        return [int(entry) for entry in os.listdir('/proc') if entry.isdigit()]
    except OSError:
        return []


def _kill(pids, sig=signal.SIGKILL):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _wait_gone(find, grace):
    """Poll FIND() for up to GRACE seconds until it lists no pid; return the last list."""
    deadline = time.monotonic() + grace
    pids = find()
    while pids and time.monotonic() < deadline:
        time.sleep(0.05)
        pids = find()
    return pids


def processes_of_job(run_id):
    """Live pids whose environment carries RUN_VAR=RUN_ID."""
    marker = ('%s=%s' % (RUN_VAR, run_id)).encode()
    found = []
    for pid in _pids():
        try:
            with open('/proc/%d/environ' % pid, 'rb') as f:
                if marker not in f.read().split(b'\0'):
                    continue
        except OSError:
            continue
        if _start_time(pid) is not None:
            found.append(pid)
    return found


def _ns_ids(paths):
    ids = set()
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            continue
        ids.add((st.st_dev, st.st_ino))
    return ids


def processes_inside(prefix):
    """Live pids in a network or UTS namespace of test bed PREFIX."""
    ids = _ns_ids([os.path.join(NETNS_RUN, name) for name in _netns_names(prefix)]
                  + _uts_files(prefix))
    if not ids:
        return []
    me = os.getpid()
    found = []
    for pid in _pids():
        if pid == me:
            continue
        for kind in ('net', 'uts'):
            try:
                st = os.stat('/proc/%d/ns/%s' % (pid, kind))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) in ids and _start_time(pid) is not None:
                found.append(pid)
                break
    return found


# -- what a test bed leaves on the machine ---------------------------------------------

def _listdir(path):
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _netns_names(prefix=None):
    names = _listdir(NETNS_RUN)
    if prefix is None:
        return [name for name in names if _NAMED_RE.match(name)]
    return [name for name in names if name.startswith(prefix + '-')]


def _run_dir(prefix):
    return os.path.join(STATE_ROOT, prefix)


def _uts_files(prefix):
    run_dir = _run_dir(prefix)
    return [os.path.join(run_dir, name) for name in _listdir(run_dir) if name.endswith('.uts')]


def _mount_points():
    try:
        with open('/proc/self/mountinfo') as f:
            return [line.split()[4].replace('\\040', ' ') for line in f]
    except OSError:
        return []


def artifacts(prefix):
    """What test bed PREFIX has on this machine: namespaces, mounts, files, processes."""
    found = ['netns ' + name for name in _netns_names(prefix)]
    found += ['mount ' + path for path in _mount_points()
              if path.startswith(_run_dir(prefix) + '/')
              or path.startswith(os.path.join(NETNS_RUN, prefix + '-'))]
    if os.path.lexists(_run_dir(prefix)):
        found.append('dir ' + _run_dir(prefix))
    found += ['dir ' + os.path.join(NETNS_ETC, name) for name in _listdir(NETNS_ETC)
              if name.startswith(prefix + '-')]
    found += ['pid %d' % pid for pid in processes_inside(prefix)]
    return found


def _read_state(prefix):
    try:
        with open(os.path.join(_run_dir(prefix), 'state.json')) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _owner_alive(prefix, state):
    pid = int(_RUN_RE.match(prefix).group(1))
    started = _start_time(pid)
    if started is None:
        return False
    # A reused pid is another process: the owner is gone.
    return not (state and state.get('owner_start') and state['owner_start'] != started)


def list_runs():
    """{prefix: {'live': owner still running, 'state': its state.json or None}}."""
    prefixes = {_NAMED_RE.match(name).group(1) for name in _netns_names()}
    prefixes.update(name for name in _listdir(STATE_ROOT) if _RUN_RE.match(name))
    prefixes.update(_NAMED_RE.match(name).group(1) for name in _listdir(NETNS_ETC)
                    if _NAMED_RE.match(name))
    runs = {}
    for prefix in sorted(prefixes):
        state = _read_state(prefix)
        runs[prefix] = {'live': _owner_alive(prefix, state), 'state': state}
    return runs


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


def _umount_all(path):
    umount = _which('umount') or 'umount'
    for _ in range(8):   # a file can carry stacked mounts
        if path not in _mount_points():
            return
        subprocess.run([umount, path], stdin=subprocess.DEVNULL, capture_output=True)


def _rmdir_if_empty(path):
    try:
        os.rmdir(path)
    except OSError:
        pass


def teardown(prefix):
    """Remove test bed PREFIX: its processes, namespaces, mounts and files.

    Works from what is on the machine, so it also clears a half-built or stale
    test bed. Raises TestbedError naming what could not be removed.
    """
    if not _RUN_RE.match(prefix):
        raise ValueError('not a test bed name: %r' % (prefix,))
    with _LOCK:
        state = _read_state(prefix)
        if state and state.get('keeper') and _owner_alive(prefix, state):
            _kill([int(_RUN_RE.match(prefix).group(1))])
        _kill(processes_inside(prefix))
        _wait_gone(lambda: processes_inside(prefix), 2.0)
        ip = _which('ip') or 'ip'
        for name in _netns_names(prefix):
            subprocess.run([ip, 'netns', 'delete', name], stdin=subprocess.DEVNULL,
                           capture_output=True)
            _umount_all(os.path.join(NETNS_RUN, name))   # in case ip could not
            try:
                os.remove(os.path.join(NETNS_RUN, name))
            except OSError:
                pass
        for path in _uts_files(prefix):
            _umount_all(path)
        shutil.rmtree(_run_dir(prefix), ignore_errors=True)
        for name in _listdir(NETNS_ETC):
            if name.startswith(prefix + '-'):
                shutil.rmtree(os.path.join(NETNS_ETC, name), ignore_errors=True)
        _rmdir_if_empty(NETNS_ETC)
        _rmdir_if_empty(STATE_ROOT)
        remaining = artifacts(prefix)
    if remaining:
        raise TestbedError('test bed %s not fully removed: %s' % (prefix, ', '.join(remaining)))


# -- teardown on exit and on SIGTERM/SIGHUP ---------------------------------------------

_LIVE = []             # Hosts that are up and owned by this process
_SAVED_HANDLERS = {}


def _on_signal(signum, frame):
    # Unwinds `with Hosts(...)` blocks (and a job's wait), whose exits tear down.
    raise SystemExit(128 + signum)


def _guard(hosts):
    with _LOCK:
        _LIVE.append(hosts)
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if sig not in _SAVED_HANDLERS and signal.getsignal(sig) == signal.SIG_DFL:
                _SAVED_HANDLERS[sig] = signal.SIG_DFL
                signal.signal(sig, _on_signal)


def _unguard(hosts):
    with _LOCK:
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
    for hosts in list(_LIVE):
        try:
            hosts.down()
        except Exception as err:   # noqa: BLE001 (exiting: report, go on)
            print('testbed: teardown at exit: %s' % err, file=sys.stderr)


# -- one job ----------------------------------------------------------------------------

class RunResult:
    """How a job run through the test bed ended."""

    def __init__(self, argv, returncode, output, timed_out, elapsed, leftovers):
        self.argv, self.returncode, self.output = argv, returncode, output
        self.timed_out, self.elapsed, self.leftovers = timed_out, elapsed, leftovers

    @property
    def ok(self):
        return self.returncode == 0 and not self.timed_out

    def check(self, tail=4000):
        """Self, or TestbedError with the tail of the output when the job failed."""
        if not self.ok:
            what = ('timed out after %.0f s' % self.elapsed if self.timed_out
                    else 'exited with status %d' % self.returncode)
            raise TestbedError('%s %s\n--- output tail ---\n%s'
                               % (shlex.join(self.argv), what, (self.output or '')[-tail:]))
        return self

    def __repr__(self):
        return '<RunResult status=%s timed_out=%s %.1f s>' % (
            self.returncode, self.timed_out, self.elapsed)


def _signal_group(pgid, sig):
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _stop(proc):
    _signal_group(proc.pid, signal.SIGTERM)
    try:
        return proc.wait(timeout=KILL_GRACE)
    except subprocess.TimeoutExpired:
        _signal_group(proc.pid, signal.SIGKILL)
        return proc.wait()


def run_job(argv, timeout=DEFAULT_TIMEOUT, env=None, stream=False, cwd=None):
    """Run ARGV in a session of its own with a hard TIMEOUT; no process of it survives.

    ENV overrides the environment (a value of None removes a variable). STREAM:
    output goes to ours as it comes, else it is collected into the result.
    """
    run_id = uuid.uuid4().hex
    child = dict(os.environ)
    for name, value in (env or {}).items():
        if value is None:
            child.pop(name, None)
        else:
            child[name] = str(value)
    child[RUN_VAR] = run_id
    start = time.monotonic()
    # A file, not a pipe: a process that outlived the job would keep a pipe open.
    log = None if stream else tempfile.TemporaryFile()
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=None if stream else subprocess.STDOUT,
                                env=child, cwd=cwd, start_new_session=True)
        timed_out = False
        try:
            returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            returncode, timed_out = _stop(proc), True
        except BaseException:
            _stop(proc)
            raise
        finally:
            leftovers = _wait_gone(lambda: processes_of_job(run_id), LEFTOVER_GRACE)
            _kill(leftovers)
        output = ''
        if log is not None:
            log.seek(0)
            output = log.read().decode('utf-8', 'replace')
    finally:
        if log is not None:
            log.close()
    if leftovers:
        output += '\n[testbed] killed %d leftover process(es)\n' % len(leftovers)
    return RunResult(list(argv), returncode, output, timed_out,
                     time.monotonic() - start, len(leftovers))


# -- the test bed -------------------------------------------------------------------------

_LAUNCH_SCRIPT = '''#!/bin/sh
# Stand-in for ssh, for MPICH's hydra: mpiexec -launcher ssh -launcher-exec THIS ...
# Runs a command line on one host of test bed {prefix}, that is inside its
# namespaces. Called as: THIS [-x] HOST WORDS...; as with ssh, the words are
# joined by spaces and run by a shell "on the host".
while [ $# -gt 0 ]; do
  case $1 in
    -o|-p|-l|-i|-F) shift 2 ;;
    -*) shift ;;
    *) break ;;
  esac
done
if [ $# -lt 2 ]; then
  echo "$0: usage: $0 [-x] HOST COMMAND..." >&2
  exit 255
fi
host=$1
shift
case $host in
{cases}
  *) echo "$0: $host is not a host of test bed {prefix}" >&2; exit 255 ;;
esac
exec {nsenter} --uts="$uts" -- {ip} netns exec "$ns" /bin/sh -c "$*"
'''

_MPIEXEC_SCRIPT = '''#!/bin/sh
# mpiexec across the hosts of test bed {prefix}, started on {first} over real TCP.
# Usage: THIS [-ppn K] -n N PROGRAM ARGS...  (any hydra options)
exec {argv} "$@"
'''


class Hosts:
    """N test hosts with their own network and hostname, joined by (shaped) links.

        with Hosts(2, rate='3gbit') as hosts:
            hosts.mpirun(4, ['python', 'x.py'], ppn=2).check()

    ``up()`` builds, ``down()`` (or leaving the ``with``) removes everything, as does
    exit or SIGTERM/SIGHUP of this process; a test bed whose process was killed is
    removed by the next ``up()`` on the machine.
    """

    def __init__(self, count=2, rate=None, timeout=DEFAULT_TIMEOUT):
        if not 1 <= int(count) <= MAX_HOSTS:
            raise ValueError('hosts: 1 to %d, not %r' % (MAX_HOSTS, count))
        self.count = int(count)
        self.rate = rate
        self.rate_bits = parse_rate(rate) if rate else None
        self.timeout = timeout
        self.names = ['h%d' % i for i in range(self.count)]
        self.prefix = None
        self._owned = False

    # -- naming ------------------------------------------------------------------------

    def _index(self, host):
        if isinstance(host, int) and 0 <= host < self.count:
            return host
        for i, name in enumerate(self.names):
            if host in (name, self.namespace(i) if self.prefix else None, self.address(i)):
                return i
        raise TestbedError('%r is not a host of test bed %s' % (host, self.prefix))

    def namespace(self, host):
        """The network namespace of HOST (an index or a name), as ``ip netns`` knows it."""
        return '%s-%s' % (self._need_prefix(), self.names[self._index(host)])

    @property
    def bridge_namespace(self):
        return '%s-%s' % (self._need_prefix(), BRIDGE_SUFFIX)

    def address(self, host):
        """HOST's address: 198.18.0.<index+1>."""
        index = host if isinstance(host, int) else self.names.index(host)
        return '%s%d' % (SUBNET, index + 1)

    def uts_file(self, host):
        return os.path.join(_run_dir(self._need_prefix()), '%s.uts' % self.names[self._index(host)])

    @property
    def launcher(self):
        """The ssh stand-in for ``mpiexec -launcher ssh -launcher-exec``."""
        return os.path.join(_run_dir(self._need_prefix()), 'launch')

    @property
    def mpiexec_wrapper(self):
        """A script: mpiexec over TCP across all hosts, started on h0; None without mpiexec."""
        path = os.path.join(_run_dir(self._need_prefix()), 'mpiexec')
        return path if os.path.exists(path) else None

    def _need_prefix(self):
        if self.prefix is None:
            raise TestbedError('the test bed is not up')
        return self.prefix

    # -- life cycle --------------------------------------------------------------------

    def __enter__(self):
        return self.up()

    def __exit__(self, *exc):
        self.down()
        return False

    def up(self, owner=None, keeper=False):
        """Build the test bed; return self.

        OWNER: the pid whose life the test bed lasts (default: this process, and
        teardown at its exit). KEEPER: that pid is a keeper process, killed on down.
        """
        if self.prefix is not None:
            raise TestbedError('test bed %s is already up' % self.prefix)
        ok, why = available(rate=self.rate_bits is not None)
        if not ok:
            raise TestbedError(why)
        cleanup_stale(log=lambda msg: print(msg, file=sys.stderr))
        owner = os.getpid() if owner is None else owner
        with _LOCK:
            self.prefix = _claim_prefix(owner)
            self._owned = owner == os.getpid()
            if self._owned:
                _guard(self)
        try:
            self._write_state(owner, keeper)
            self._build()
        except BaseException:
            self.down()
            raise
        return self

    @classmethod
    def attach(cls, prefix):
        """A Hosts for test bed PREFIX, already up (``python -m testbed up``); not owned."""
        state = _read_state(prefix)
        if not state:
            raise TestbedError('no test bed %s (see python -m testbed list)' % prefix)
        hosts = cls(len(state['hosts']), state.get('rate'))
        hosts.prefix = prefix
        return hosts

    def down(self):
        """Remove the test bed (idempotent)."""
        prefix = self.prefix
        if prefix is None:
            return
        try:
            teardown(prefix)
        finally:
            self.prefix = None
            if self._owned:
                _unguard(self)
            self._owned = False

    def _write_state(self, owner, keeper):
        state = {'prefix': self.prefix, 'owner': owner, 'owner_start': _start_time(owner),
                 'keeper': bool(keeper), 'hosts': self.names, 'rate': self.rate,
                 'rate_bits': self.rate_bits, 'created': time.time()}
        path = os.path.join(_run_dir(self.prefix), 'state.json')
        with open(path + '.tmp', 'w') as f:
            json.dump(state, f, indent=1)
        os.replace(path + '.tmp', path)

    def _build(self):
        ip, tc = _tool('ip'), _which('tc')
        bridge = self.bridge_namespace
        _sh(ip, 'netns', 'add', bridge)
        _sh(ip, '-n', bridge, 'link', 'add', BRIDGE, 'type', 'bridge')
        _sh(ip, '-n', bridge, 'link', 'set', BRIDGE, 'up')
        for i, host in enumerate(self.names):
            ns = self.namespace(i)
            _sh(ip, 'netns', 'add', ns)
            # Created in place: the pair never appears in the root namespace.
            _sh(ip, '-n', ns, 'link', 'add', IFACE, 'type', 'veth',
                'peer', 'name', host, 'netns', bridge)
            _sh(ip, '-n', bridge, 'link', 'set', host, 'master', BRIDGE)
            _sh(ip, '-n', bridge, 'link', 'set', host, 'up')
            _sh(ip, '-n', ns, 'addr', 'add', '%s/%d' % (self.address(i), SUBNET_BITS),
                'dev', IFACE)
            _sh(ip, '-n', ns, 'link', 'set', IFACE, 'up')
            _sh(ip, '-n', ns, 'link', 'set', 'lo', 'up')
            if self.rate_bits:
                for where, dev in ((ns, IFACE), (bridge, host)):
                    _sh(tc, '-n', where, 'qdisc', 'replace', 'dev', dev, 'root',
                        *tbf_args(self.rate_bits))
            uts = self.uts_file(i)
            open(uts, 'w').close()
            _sh(_tool('unshare'), '--uts=%s' % uts, _tool('hostname'), host)
            etc = os.path.join(NETNS_ETC, ns)
            os.makedirs(etc, exist_ok=True)
            with open(os.path.join(etc, 'hosts'), 'w') as f:
                f.write(self.hosts_file())
        self._write_scripts()

    def hosts_file(self):
        lines = ['# test bed %s' % self.prefix, '127.0.0.1 localhost',
                 '::1 localhost ip6-localhost ip6-loopback']
        lines += ['%s %s %s' % (self.address(i), name, self.namespace(i))
                  for i, name in enumerate(self.names)]
        return '\n'.join(lines) + '\n'

    def _write_scripts(self):
        cases = '\n'.join('  %s|%s|%s) ns=%s uts=%s ;;' % (
            name, self.namespace(i), self.address(i), self.namespace(i), self.uts_file(i))
            for i, name in enumerate(self.names))
        _write_executable(self.launcher, _LAUNCH_SCRIPT.format(
            prefix=self.prefix, cases=cases, nsenter=_tool('nsenter'), ip=_tool('ip')))
        mpiexec = find_mpiexec()
        if mpiexec and _is_hydra(mpiexec):
            argv = self.mpiexec_argv(None, mpiexec=mpiexec)
            _write_executable(os.path.join(_run_dir(self.prefix), 'mpiexec'),
                              _MPIEXEC_SCRIPT.format(prefix=self.prefix, first=self.names[0],
                                                     argv=shlex.join(argv)))

    # -- running things on the hosts ------------------------------------------------------

    def exec_argv(self, host, argv=()):
        """ARGV run on HOST: in its network namespace (and /etc/hosts) and hostname."""
        return [_tool('nsenter'), '--uts=%s' % self.uts_file(host), '--',
                _tool('ip'), 'netns', 'exec', self.namespace(host)] + [str(a) for a in argv]

    def mpiexec_argv(self, nprocs, ppn=None, hosts=None, tcp=True, mpiexec=None, extra=()):
        """The argv that starts NPROCS ranks across HOSTS (default: all), program not included.

        mpiexec runs on the first of HOSTS and reaches the others through the ssh
        stand-in. Ranks go round-robin over the hosts, or PPN to a host in turn.
        TCP: inter-host traffic is real TCP over the links (TCP_ENV); otherwise
        MPICH's defaults, which use shared memory between the namespaces.
        NPROCS None leaves ``-n`` out (for wrappers).
        """
        hosts = [self.names[self._index(h)] for h in (hosts or self.names)]
        mpiexec = mpiexec or find_mpiexec()
        if mpiexec is None or not _is_hydra(mpiexec):
            raise TestbedError('the test bed launches with MPICH hydra; mpiexec: %s' % mpiexec)
        argv = self.exec_argv(hosts[0], [mpiexec, '-launcher', 'ssh', '-launcher-exec',
                                         self.launcher, '-hosts', ','.join(hosts)])
        if ppn:
            argv += ['-ppn', str(ppn)]
        if tcp:
            for name, value in TCP_ENV.items():
                argv += ['-genv', name, value]
        argv += [str(a) for a in extra]
        if nprocs is not None:
            argv += ['-n', str(nprocs)]
        return argv

    def launcher_for(self, ppn=None, **kwargs):
        """A function of nprocs giving mpiexec_argv (for tests/mpi_harness.run_mpi)."""
        return functools.partial(self.mpiexec_argv, ppn=ppn, **kwargs)

    def run(self, argv, host=None, timeout=None, env=None, stream=False, cwd=None):
        """Run ARGV (on HOST when given, else as is) with a timeout; a RunResult."""
        if host is not None:
            argv = self.exec_argv(host, argv)
        return run_job(argv, timeout=self.timeout if timeout is None else timeout,
                       env=env, stream=stream, cwd=cwd)

    def mpirun(self, nprocs, argv, ppn=None, hosts=None, tcp=True, timeout=None, env=None,
               stream=False, cwd=None):
        """ARGV on NPROCS ranks across the hosts (see mpiexec_argv); a RunResult."""
        return self.run(self.mpiexec_argv(nprocs, ppn=ppn, hosts=hosts, tcp=tcp) + list(argv),
                        timeout=timeout, env=env, stream=stream, cwd=cwd)

    def __repr__(self):
        return '<Hosts %s: %s%s>' % (self.prefix or '(down)', ', '.join(self.names),
                                     ' at %s' % self.rate if self.rate else '')


def tbf_args(rate_bits):
    """The tbf qdisc arguments for RATE_BITS per second."""
    burst = max(int(rate_bits / 8 * TBF_BURST_S), TBF_MIN_BURST)
    return ['tbf', 'rate', '%dbit' % rate_bits, 'burst', str(burst), 'latency', TBF_LATENCY]


def _claim_prefix(owner):
    os.makedirs(STATE_ROOT, exist_ok=True)
    base = '%s%d' % (NAME_BASE, owner)
    for seq in range(1000):
        prefix = base if seq == 0 else '%sn%d' % (base, seq)
        if _netns_names(prefix) or any(n.startswith(prefix + '-') for n in _listdir(NETNS_ETC)):
            continue
        for _ in range(3):
            try:
                os.mkdir(_run_dir(prefix))   # atomic: the claim
                return prefix
            except FileExistsError:
                break
            except FileNotFoundError:        # a teardown removed the empty STATE_ROOT
                os.makedirs(STATE_ROOT, exist_ok=True)
    raise TestbedError('no free test bed name for pid %d' % owner)


def _write_executable(path, text):
    with open(path, 'w') as f:
        f.write(text)
    os.chmod(path, 0o755)


def _sh(*argv):
    proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if proc.returncode != 0:
        raise TestbedError('%s: %s' % (shlex.join(argv), (proc.stderr or proc.stdout).strip()))
    return proc.stdout
