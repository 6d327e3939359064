"""Helpers shared by the benchmark scripts (allreduce.py, scaling.py, ...).

Every script runs under mpiexec; rank 0 prints and writes files. Sizes are in bytes of
float32 data; bandwidths are in GB/s with GB = 1e9 bytes, as nccl-tests reports them.
"""
import argparse
import atexit
import contextlib
import gc
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import weakref

import numpy as np
from mpi4py import MPI

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO_ROOT, 'benchmarks', 'results')
_UNITS = {'': 1, 'K': 1 << 10, 'M': 1 << 20, 'G': 1 << 30}
DEFAULT_SIZES = [4096 * 4 ** i for i in range(9)]          # 4 KB .. 256 MB
QUICK_SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20]


def use_checkout():
    """Put the repository root first on sys.path: benchmark the checkout the script sits in,
    not whatever mpi_kvstore happens to be installed."""
    if REPO_ROOT not in sys.path:
        sys.path.insert(0, REPO_ROOT)


# ---------------------------------------------------------------- sizes and arguments

def parse_size(text):
    """'4K', '1M', '256MB', '4096' -> bytes; must be a positive multiple of 4 (float32)."""
    spec = text.strip().upper().removesuffix('B')
    unit = spec[-1:] if spec[-1:] in _UNITS else ''
    try:
        nbytes = int(float(spec[:len(spec) - len(unit)]) * _UNITS[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f'bad size {text!r}: use e.g. 4K, 1M, 256M') from None
    if nbytes <= 0 or nbytes % 4:
        raise argparse.ArgumentTypeError(f'size {text!r} must be a positive multiple of 4 bytes')
    return nbytes


def parse_sizes(text):
    """'4K,1M,256M' -> [4096, 1048576, 268435456]."""
    return [parse_size(part) for part in text.split(',') if part.strip()]


def format_size(nbytes):
    """4096 -> '4KB', 1638400 -> '1.56MB'."""
    for unit in ('G', 'M', 'K'):
        scale = _UNITS[unit]
        if nbytes >= scale:
            return f'{nbytes / scale:.3g}{unit}B'
    return f'{nbytes}B'


def add_common_args(parser, default_out=DEFAULT_OUT, sizes=True):
    """The options every benchmark shares; call resolve_quick() after parsing.
    sizes=False leaves out --sizes, for a script that does not sweep message sizes."""
    parser.add_argument('--quick', action='store_true',
                        help='few small sizes and few trials (a smoke run, well under a minute)')
    if sizes:
        parser.add_argument('--sizes', type=parse_sizes, default=None,
                            help='comma-separated sizes in bytes, e.g. 4K,1M,256M '
                                 '(default: 4KB to 256MB in powers of 4)')
    parser.add_argument('--warmups', type=int, default=None,
                        help='untimed runs per case (default 5, quick 2)')
    parser.add_argument('--trials', type=int, default=None, help='timed runs per case (default 20, quick 5)')
    parser.add_argument('--timeout', type=float, default=600.0,
                        help='seconds one case may take before the job is ended (default 600)')
    parser.add_argument('--out', default=default_out, help='folder for JSON and PNG results')
    return parser


def resolve_quick(args):
    """Fill the defaults that depend on --quick; explicit options always win."""
    if args.sizes is None:
        args.sizes = QUICK_SIZES if args.quick else DEFAULT_SIZES
    if args.warmups is None:
        args.warmups = 2 if args.quick else 5
    if args.trials is None:
        args.trials = 5 if args.quick else 20
    if args.warmups < 0 or args.trials < 1:
        raise SystemExit('--warmups must be >= 0 and --trials >= 1')
    return args


# ---------------------------------------------------------------- timing and bandwidth

class Timer:
    """with Timer() as t: ...; t.elapsed is in seconds (time.perf_counter)."""

    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.elapsed = time.perf_counter() - self.start


def median(values):
    return statistics.median(values)


def machine_busy():
    """Seconds of CPU this machine has spent busy so far, all cores together (user, system,
    irq and softirq from /proc/stat: the kernel's network work too, which no process is
    charged for). None where /proc/stat is missing."""
    try:
        with open('/proc/stat') as fh:
            fields = [int(v) for v in fh.readline().split()[1:8]]
    except OSError:
        return None
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf('SC_CLK_TCK')   # less idle, iowait


def one_machine(comm):
    """Whether every rank of comm runs on this kernel (test hosts of testbed/ do: network
    namespaces of one machine), so that /proc/stat counts what all of them cost."""
    try:
        with open('/proc/sys/kernel/random/boot_id') as fh:
            boot = fh.read().strip()
    except OSError:
        boot = None
    boots = comm.allgather(boot)
    return boot is not None and len(set(boots)) == 1


def measure(comm, op, warmups, trials):
    """Time op() `trials` times after `warmups` untimed runs.

    A barrier releases the ranks together before each run. A collective is done only when
    its slowest rank is, so each trial counts the maximum over ranks. Returns seconds per
    trial, identical on every rank.
    """
    for _ in range(warmups):
        comm.Barrier()
        op()
    times = np.empty(trials)
    for i in range(trials):
        comm.Barrier()
        with Timer() as timer:
            op()
        times[i] = timer.elapsed
    comm.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
    return times.tolist()


def algbw(nbytes, seconds):
    """Algorithm bandwidth in GB/s."""
    return nbytes / seconds / 1e9


def busbw(alg_bw, nranks):
    """Allreduce bus bandwidth: what each link carries in a ring (nccl-tests' 2(n-1)/n)."""
    return alg_bw * 2 * (nranks - 1) / nranks


def summarize(times, nbytes, nranks):
    """Median latency and bandwidths of one case, as stored in the JSON."""
    latency = median(times)
    alg = algbw(nbytes, latency)
    return {'bytes': nbytes, 'latency_us': latency * 1e6, 'min_us': min(times) * 1e6,
            'algbw_GBps': alg, 'busbw_GBps': busbw(alg, nranks), 'trials_us': [t * 1e6 for t in times]}


# ---------------------------------------------------------------- output

def agree(error, comm=MPI.COMM_WORLD):
    """Collective: every rank's error (or None) -> the first one, the same on all ranks."""
    return next((e for e in comm.allgather(error) if e), None)


def designs(text):
    """--designs 'funneled,chained' -> a list; None -> every design mpi_kvstore has.

    A design may carry store options after '+': 'funneled+native_ops=0' is the
    funneled design with the Python engine op, for an A/B in one run; '+2bit=T' sets
    2-bit gradient compression with threshold T (kv.set_gradient_compression).
    """
    import mpi_kvstore
    return [d for d in text.split(',') if d] if text else list(mpi_kvstore.DESIGNS)


def store_options(spec):
    """'funneled+native_ops=0' -> {'design': 'funneled', 'native_ops': '0'}; None -> {}."""
    if not spec:
        return {}
    name, *pairs = spec.split('+')
    return dict([('design', name)] + [tuple(p.split('=', 1)) for p in pairs])


def create_store(design, timeout):
    """Collective: (mpi_kvstore store, None) on every rank, or (None, why) on every rank.
    design None takes the default (MPI_KVSTORE_DESIGN, else funneled); see designs()."""
    import mpi_kvstore   # after use_checkout(): the checkout's package
    options = store_options(design)
    two_bit = options.pop('2bit', None)
    with deadline(timeout, f'creating mpi_kvstore design {design or "default"!r}'):
        try:
            kv, why = mpi_kvstore.create('dist_mpi', **options), None
            if two_bit is not None:
                kv.set_gradient_compression({'type': '2bit', 'threshold': float(two_bit)})
        except Exception as exc:    # e.g. a design this MPI's thread level refuses
            kv, why = None, f'{type(exc).__name__}: {exc}'
        why = agree(why)
    return (None, why) if why else (kv, None)


def rank0_print(*args, comm=MPI.COMM_WORLD, **kwargs):
    if comm.rank == 0:
        print(*args, flush=True, **kwargs)


def _version_of(module_name):
    try:
        return __import__(module_name).__version__
    except Exception as exc:    # a missing optional package is a fact to record, not an error
        return f'unavailable ({type(exc).__name__})'


def versions():
    """Everything needed to tell two result files apart."""
    return {'python': platform.python_version(), 'numpy': _version_of('numpy'),
            'mxnet': _version_of('mxnet'), 'mpi4py': _version_of('mpi4py'),
            'mpi_kvstore': _version_of('mpi_kvstore'),
            'mpi_library': MPI.Get_library_version().strip(),
            'mpi_thread_level': MPI.Query_thread(), 'hostname': socket.gethostname(),
            'platform': platform.platform(), 'cpu_count': os.cpu_count()}


def _relevant_env():
    prefixes = ('OMP_', 'MXNET_', 'MPI_KVSTORE_', 'DMLC_', 'MPICH_', 'UCX_', 'FI_')
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(prefixes)}


def write_json(path, payload, config=None, comm=MPI.COMM_WORLD):
    """Write payload plus versions, environment, rank count and configuration (rank 0 only)."""
    if comm.rank != 0:
        return
    record = {'versions': versions(), 'env': _relevant_env(), 'nranks': comm.size,
              'config': config or {}, 'time': time.strftime('%Y-%m-%dT%H:%M:%S%z'), **payload}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f'{path}.tmp'
    with open(tmp, 'w') as handle:
        json.dump(record, handle, indent=1, default=str)
    os.replace(tmp, path)   # a reader never sees half a file, even if the job is killed


def plot_lines(path, series, xlabel, ylabel, title):
    """Log-log plot, one line per {label: (xs, ys)}; returns a message saying what happened."""
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        return 'matplotlib is not installed: no plot (pip install matplotlib)'
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, marker='o', label=label)
    ax.set(xscale='log', yscale='log', xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(True, which='both', alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f'plot written to {path}'


def plot_bars(path, panels, ylabel, title):
    """Bar charts side by side, one per {panel: {label: value}} (each panel with its own
    scale: models differ by orders of magnitude); returns a message saying what happened."""
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        return 'matplotlib is not installed: no plot (pip install matplotlib)'
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(1 + 4.5 * max(1, len(panels)), 5.5),
                             squeeze=False)
    for ax, (name, bars) in zip(axes[0], panels.items()):
        positions = range(len(bars))
        ax.bar(positions, list(bars.values()))
        ax.set_xticks(list(positions))
        ax.set_xticklabels(list(bars), rotation=40, ha='right', fontsize=8)
        ax.set(title=name, ylabel=ylabel)
        ax.grid(True, axis='y', alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f'plot written to {path}'


# ---------------------------------------------------------------- failure handling

def run_main(main):
    """Run main(); an uncaught exception on any rank ends the whole job instead of leaving
    the other ranks waiting in a collective (what `python -m mpi4py` does)."""
    try:
        main()
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)


def _expire(seconds, what, on_expire):
    sys.stderr.write(f'[rank {MPI.COMM_WORLD.rank}] {what} took more than {seconds:.0f} s; '
                     'ending the job\n')
    sys.stderr.flush()
    with contextlib.suppress(Exception):
        if on_expire:
            on_expire()
    os._exit(124)   # nothing else stops a thread blocked in C; mpiexec then ends the other ranks


@contextlib.contextmanager
def deadline(seconds, what, on_expire=None):
    """Kill this process (after on_expire()) if the body runs longer than `seconds`: a hung
    collective or ps-lite handshake blocks in C, where no Python exception can reach it."""
    timer = threading.Timer(seconds, _expire, (seconds, what, on_expire))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


# ---------------------------------------------------------------- ps-lite for dist_sync

# Run in each ps-lite child. The kernel kills it if its parent (rank 0) dies and an alarm
# bounds its life, so no server outlives a killed job. `import mxnet` does the rest: with
# DMLC_ROLE=server or scheduler, mxnet/kvstore/kvstore_server.py creates a 'dist' store,
# serves until the workers shut it down, then calls sys.exit().
_BOOTSTRAP = (
    'import ctypes, os, signal, sys\n'
    'ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG\n'
    'if os.getppid() != int(sys.argv[1]): sys.exit(3)  # parent already gone\n'
    'signal.alarm(int(sys.argv[2]))\n'
    'import mxnet\n'
    'sys.exit(4)  # reached only if mxnet did not start serving\n'
)


def free_port():
    """A TCP port on 127.0.0.1 nobody listens on now (the small race is acceptable here)."""
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        return sock.getsockname()[1]


class PsLite:
    """The ps-lite scheduler and servers behind MXNet's dist_sync store, run on 127.0.0.1 as
    subprocesses of rank 0, with every rank of `comm` as a worker.

        pslite = PsLite(comm)
        error = pslite.start()       # collective; None on success, else why not
        kv = mx.kv.create('dist_sync')
        ...
        del kv; gc.collect()         # collective: the workers' destructor stops the servers
        pslite.stop()                # collective

    ps-lite keeps one worker per process for the life of the process: start it once.
    """

    def __init__(self, comm, num_servers=1, start_timeout=60.0, lifetime=3600):
        self.comm, self.num_servers = comm, num_servers
        self.start_timeout, self.lifetime = start_timeout, int(lifetime)
        self.procs, self.log = [], None
        self._saved_env = {}

    def _env(self, port, role):
        return {'DMLC_ROLE': role, 'DMLC_PS_ROOT_URI': '127.0.0.1', 'DMLC_PS_ROOT_PORT': str(port),
                'DMLC_NUM_WORKER': str(self.comm.size), 'DMLC_NUM_SERVER': str(self.num_servers),
                # without it ps-lite looks for a non-loopback interface and aborts where none is
                'DMLC_NODE_HOST': '127.0.0.1'}

    def _spawn(self, port, role):
        # The children must not look like MPI processes to the launcher's PMI.
        env = {k: v for k, v in os.environ.items() if not k.startswith(('PMI_', 'HYDRA_', 'MPI_LOCALRANK'))}
        env.update(self._env(port, role), OMP_NUM_THREADS='1')
        argv = [sys.executable, '-c', _BOOTSTRAP, str(os.getpid()), str(self.lifetime)]
        return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=self.log,
                                stderr=subprocess.STDOUT)

    def _wait_listening(self, port):
        """None once the scheduler accepts connections, else why not."""
        give_up = time.monotonic() + self.start_timeout
        while time.monotonic() < give_up:
            dead = [p for p in self.procs if p.poll() is not None]
            if dead:
                return f'a ps-lite process exited with code {dead[0].returncode}: {self.log_tail()}'
            with contextlib.suppress(OSError), socket.create_connection(('127.0.0.1', port), 1):
                return None
            time.sleep(0.2)
        return f'the ps-lite scheduler did not listen within {self.start_timeout:.0f} s: {self.log_tail()}'

    def _start_root(self):
        """Rank 0: start the processes; return (port, error)."""
        try:
            self.log = tempfile.NamedTemporaryFile('w+', prefix='pslite-', suffix='.log')
            port = free_port()
            self.procs = [self._spawn(port, 'scheduler')]
            self.procs += [self._spawn(port, 'server') for _ in range(self.num_servers)]
            atexit.register(self.kill)
            error = self._wait_listening(port)
        except Exception as exc:     # any failure here only means: no dist_sync baseline
            port, error = None, f'{type(exc).__name__}: {exc}'
        if error:
            self.kill()
        return port, error

    def start(self):
        """Collective. Start the servers, point this process's ps-lite at them (environment
        read when the store is created); return None, or a message why it could not."""
        port, error = self._start_root() if self.comm.rank == 0 else (None, None)
        port, error = self.comm.bcast((port, error), root=0)
        if error is None:
            for key, value in self._env(port, 'worker').items():
                self._saved_env[key] = os.environ.get(key)
                os.environ[key] = value
        return error

    def stop(self, timeout=30.0):
        """Collective. Wait for the servers to leave (the workers' store destructor tells them
        to), kill them if they do not, restore the environment."""
        self.comm.Barrier()
        give_up = time.monotonic() + timeout
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.1, give_up - time.monotonic()))
        self.kill()
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    def kill(self):
        """Idempotent, never raises: also runs at exit and from a deadline."""
        for proc in self.procs:
            with contextlib.suppress(Exception):
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(5)
        self.procs = []

    def log_tail(self, chars=2000):
        if self.log is None:
            return ''
        with contextlib.suppress(Exception):
            self.log.flush()
            with open(self.log.name) as handle:
                return handle.read()[-chars:].strip()
        return ''


class DistSync:
    """MXNet's dist_sync store behind its ps-lite processes, for one run of a script.

        dist_sync = DistSync(run, lifetime)   # run: .args.timeout, .args.no_dist_sync, .on_expire
        why = dist_sync.start()               # collective; None, or why there is no baseline
        ... dist_sync.kv ...
        dist_sync.stop()                      # collective; always stops ps-lite

    ps-lite starts once per process: one DistSync per run. `lifetime` (s) is the servers' own
    alarm, a safety net should the script die without stopping them.
    """

    def __init__(self, run, lifetime):
        self.run, self.lifetime, self.kv, self.pslite = run, lifetime, None, None

    def start(self):
        import mxnet as mx
        if self.run.args.no_dist_sync:
            return '--no-dist-sync'
        self.pslite = PsLite(MPI.COMM_WORLD, lifetime=self.lifetime)
        error = self.pslite.start()
        if error:
            return f'ps-lite did not start: {error}'
        self.run.on_expire = self.pslite.kill
        # On one host the handshake takes about a second; minutes mean it will never finish.
        with deadline(min(self.run.args.timeout, 120), 'creating the dist_sync store',
                      self.pslite.kill):
            self.kv = mx.kv.create('dist_sync')
        return None

    def stop(self):
        """The store's destructor tells the servers to leave; a store still referenced
        would instead hang at exit, talking to servers that were killed."""
        import mxnet as mx
        if self.kv is None:
            return
        with deadline(self.run.args.timeout, 'shutting down dist_sync', self.pslite.kill):
            mx.nd.waitall()
            MPI.COMM_WORLD.Barrier()
            alive = weakref.ref(self.kv)
            self.kv = None
            gc.collect()
            if alive() is not None:
                raise RuntimeError('the dist_sync store is still referenced: cannot stop ps-lite')
            self.pslite.stop()
        self.run.on_expire = None
