"""What every benchmark script shares: arguments, timing, checks, stores, output, failure handling.

Scripts run as modules from the repository root (``mpiexec -n 2 python -m benchmarks.NAME``);
rank 0 prints and writes files. Sizes are in bytes of float32 data; bandwidths are in GB/s
with GB = 1e9 bytes, as nccl-tests reports them.

Timing: :func:`timed_run` (one run, with its CPU), :func:`measure` (one op again and again),
:func:`interleaved` (several ops in rounds, in an order that rotates, so a shared VM's slow
phases hit them alike); a trial counts the slowest rank. :func:`make_trainer` makes every
trainer the scripts compare. mpi4py is imported on first use: cost_model and grid.py use
this module outside mpiexec.
"""
import argparse
import contextlib
import hashlib
import json
import os
import platform
import resource
import shlex
import socket
import statistics
import sys
import threading
import time
import traceback

import numpy as np
import psutil

from benchmarks import schema

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Runs write below results/runs/ (git-ignored); results/ itself holds the documented tables.
DEFAULT_OUT = os.path.join(REPO_ROOT, 'benchmarks', 'results', 'runs')
DEFAULT_SIZES = [4096 * 4 ** i for i in range(9)]          # 4 KB .. 256 MB
QUICK_SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20]
# Defaults of the shared options: a full run's, and what --quick makes of them.
FULL = {'sizes': DEFAULT_SIZES, 'warmups': 5, 'trials': 20}
QUICK = {'sizes': QUICK_SIZES, 'warmups': 2, 'trials': 5}


def _mpi():
    from mpi4py import MPI  # on first use: see the module docstring
    return MPI


def world():
    return _mpi().COMM_WORLD


# ---------------------------------------------------------------- sizes and arguments

def parse_size(text):
    """'4K', '1M', '256MB', '4096' -> bytes (mpi_kvstore.config.parse_bytes); must be a
    positive multiple of 4 (float32)."""
    from mpi_kvstore.config import parse_bytes  # on first use: the package imports MPI
    try:
        nbytes = parse_bytes(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f'bad size {text!r}: use e.g. 4K, 1M, 256M') from None
    if nbytes <= 0 or nbytes % 4:
        raise argparse.ArgumentTypeError(f'size {text!r} must be a positive multiple of 4 bytes')
    return nbytes


def parse_sizes(text):
    """'4K,1M,256M' -> [4096, 1048576, 268435456]."""
    return [parse_size(part) for part in names(text)]


def names(text):
    """'a, b,,c' -> ['a', 'b', 'c']: a comma-separated option as a list."""
    return [part.strip() for part in text.split(',') if part.strip()]


def format_size(nbytes):
    """4096 -> '4KB' (mpi_kvstore.config.format_bytes, in bytes) where that is the largest
    unit; else three digits of it, 1638400 -> '1.56MB'."""
    from mpi_kvstore.config import format_bytes  # on first use: the package imports MPI
    exact = format_bytes(nbytes, 'B')
    largest = next((unit for unit, shift in (('G', 30), ('M', 20), ('K', 10)) if nbytes >> shift), '')
    if exact[-1] == largest or not largest:
        return exact + ('B' if largest else '')
    shift = {'G': 30, 'M': 20, 'K': 10}[largest]
    return f'{nbytes / (1 << shift):.3g}{largest}B'


class _ShowDefaults(argparse.HelpFormatter):
    """Adds '(default: X)' to an option's help, unless X is None or False or the help says."""

    def _get_help_string(self, action):
        if action.default in (None, False, argparse.SUPPRESS) or 'default' in action.help:
            return action.help
        return action.help + ' (default: %(default)s)'


def parser(doc):
    """An argument parser described by doc's first paragraph, defaults in its options' help."""
    return argparse.ArgumentParser(description=doc.split('\n\n')[0], formatter_class=_ShowDefaults)


def add_common_args(parser, default_out=DEFAULT_OUT, sizes=True, quick=True, full=None,
                    timeout=600.0):
    """The options every benchmark shares; call resolve_quick(args, full, quick) after parsing.
    sizes=False leaves out --sizes, for a script that does not sweep message sizes;
    quick=False leaves out --quick, a dict gives its defaults (QUICK's keys); full: the
    defaults of a full run (FULL's keys)."""
    full = dict(FULL, **(full or {}))
    fast = dict(QUICK, **quick) if isinstance(quick, dict) else QUICK

    def default(key):
        show = (lambda v: ','.join(map(format_size, v))) if key == 'sizes' else str
        return f'default {show(full[key])}' + (f', quick {show(fast[key])}' if quick else '')
    if quick:
        parser.add_argument('--quick', action='store_true',
                            help='few small sizes and few trials (a smoke run, well under a minute)')
    if sizes:
        parser.add_argument('--sizes', type=parse_sizes, help='comma-separated sizes in bytes, e.g. '
                            f'4K,1M,256M ({default("sizes")})')
    parser.add_argument('--warmups', type=int, help=f'untimed runs per case ({default("warmups")})')
    parser.add_argument('--trials', type=int, help=f'timed runs per case ({default("trials")})')
    parser.add_argument('--timeout', type=float, default=timeout,
                        help='seconds a case (or the run) may take before the job is ended')
    parser.add_argument('--out', default=default_out, help='folder for JSON and PNG results')
    return parser


def resolve_quick(args, full=None, quick=None):
    """Fill the defaults that depend on --quick; explicit options always win."""
    fast = dict(QUICK, **(quick or {}))
    defaults = fast if getattr(args, 'quick', False) else dict(FULL, **(full or {}))
    for key, value in defaults.items():
        if getattr(args, key, False) is None:
            setattr(args, key, value)
    if args.warmups < 0 or args.trials < 1:
        raise SystemExit('--warmups must be >= 0 and --trials >= 1')
    return args


# ---------------------------------------------------------------- timing

def median(values):
    return statistics.median(values)


def spread(values):
    """{'min', 'median', 'max'} of some timings: the median is what tables compare, min and
    max tell whether the run was steady."""
    return {'min': min(values), 'median': median(values), 'max': max(values)}


def hidden_share(compute, exchange, step):
    """How much of the exchange a step hid behind compute, as a share of the most it could
    hide, from the medians: the one definition every table and the cost model use
    (docs/benchmarks.md)."""
    return (compute + exchange - step) / min(compute, exchange)


def machine_busy():
    """Seconds of CPU this machine has spent busy so far, all cores together (user, nice,
    system, irq and softirq from /proc/stat: the kernel's network work too, which no process
    is charged for)."""
    times = psutil.cpu_times()
    return sum(getattr(times, field, 0.0) for field in ('user', 'nice', 'system', 'irq', 'softirq'))


def process_cpu_s():
    """This process's user + system CPU seconds so far, every thread (getrusage)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed_run(op, comm=None, units=1, machine=False):
    """Collective: one run of op() on every rank of comm (default: every rank), released
    together by a barrier: (op's value, its sample): wall_s (the slowest rank's), units,
    cpu_s (this rank's CPU seconds), rank_cpu_s (every rank's, on rank 0) and busy_s (on rank
    0 with `machine`: machine_busy over the run). The one way the scripts time a run with its
    CPU (cpu_summary sums samples up)."""
    comm = world() if comm is None else comm
    comm.Barrier()
    busy = machine_busy() if machine and comm.rank == 0 else None
    cpu, start = process_cpu_s(), time.perf_counter()
    value = op()
    wall, cpu = time.perf_counter() - start, process_cpu_s() - cpu
    if busy is not None:
        busy = machine_busy() - busy
    return value, {'wall_s': comm.allreduce(wall, op=_mpi().MAX), 'units': units, 'cpu_s': cpu,
                   'rank_cpu_s': comm.gather(cpu, root=0), 'busy_s': busy}


def cpu_summary(samples):
    """The CPU of some timed runs (timed_run's samples, rank 0's): each rank's CPU ms a unit
    and, where the machine was counted, its busy share of every core; None without samples."""
    if not samples or samples[0]['rank_cpu_s'] is None:
        return None
    units, wall = sum(s['units'] for s in samples), sum(s['wall_s'] for s in samples)
    busy = [s['busy_s'] for s in samples]
    return {'rank_cpu_ms_per_unit': [sum(cpu) / units * 1e3 for cpu in zip(*[s['rank_cpu_s'] for s in samples])],
            'machine_busy': sum(busy) / (wall * os.cpu_count()) if None not in busy else None,
            'cores': os.cpu_count()}


def rss_mb():
    """This process's resident set size in MB (2**20 bytes): /proc/self/statm, by psutil."""
    return psutil.Process().memory_info().rss / 2 ** 20


def one_machine(comm):
    """Whether every rank of comm runs on this kernel (test hosts of testbed/ do: network
    namespaces of one machine), so that /proc/stat counts what all of them cost."""
    # The kernel's boot id, not psutil.boot_time(): two machines booted in the same second
    # would share a boot time, never a boot id.
    try:
        with open('/proc/sys/kernel/random/boot_id') as fh:
            boot = fh.read().strip()
    except OSError:
        boot = None
    boots = comm.allgather(boot)
    return boot is not None and len(set(boots)) == 1


def topology(comm, label):
    """Hosts (MPI processor names) and the ranks on each, with a label (--topology)."""
    names = comm.allgather(_mpi().Get_processor_name())
    per_host = {name: names.count(name) for name in dict.fromkeys(names)}
    return {'hosts': len(per_host), 'ranks_per_host': per_host, 'label': label}


def rotation(items, r):
    """Round r's order: every item once, starting at item r mod len(items), so that no item
    always follows the same one."""
    k = r % len(items)
    return items[k:] + items[:k]


def interleaved(ops, trials, warmups=0, time_one=None, comm=None):
    """{name: [one value per timed round]} of {name: op}: round r runs every op once, in
    rotation(names, r), so that load which drifts over the run slows every op alike; the
    first `warmups` rounds are not kept. time_one(name, op) times one run (default: the
    slowest rank's seconds, timed_run on comm)."""
    names_ = list(ops)
    if time_one is None:
        def time_one(name, op):
            return timed_run(op, comm)[1]['wall_s']
    kept = {name: [] for name in names_}
    for r in range(warmups + trials):
        for name in rotation(names_, r):
            value = time_one(name, ops[name])
            if r >= warmups:
                kept[name].append(value)
    return kept


def measure(comm, op, warmups, trials):
    """Seconds of each of `trials` runs of op() after `warmups` untimed ones, the slowest
    rank's, identical on every rank."""
    return interleaved({'op': op}, trials, warmups, comm=comm)['op']


def algbw(nbytes, seconds):
    """Algorithm bandwidth in GB/s."""
    return nbytes / seconds / 1e9


def busbw(alg_bw, nranks):
    """Allreduce bus bandwidth: what each link carries in a ring (nccl-tests' 2(n-1)/n)."""
    return alg_bw * 2 * (nranks - 1) / nranks


def summarize(times, nbytes, nranks):
    """Median latency, its min and max, and bandwidths of one case, as stored in the JSON."""
    stats = spread(times)
    alg = algbw(nbytes, stats['median'])
    return {'bytes': nbytes, 'latency_us': stats['median'] * 1e6, 'min_us': stats['min'] * 1e6,
            'max_us': stats['max'] * 1e6, 'algbw_GBps': alg, 'busbw_GBps': busbw(alg, nranks),
            'trials_us': [t * 1e6 for t in times]}


# ---------------------------------------------------------------- what is timed

def check_sum(values, expected, what):
    """The first result must be the sum over ranks: timing a wrong answer is worthless."""
    if not np.allclose(values, expected):
        raise RuntimeError(f'{what}: got {np.unique(values)[:5]}, expected {expected}')


def ranks_differ(arrays, comm=None):
    """Collective: None where every rank of comm holds the same bytes in ``arrays`` (a digest
    of each rank's, compared), else why not, the same on every rank."""
    comm = world() if comm is None else comm
    digest = hashlib.blake2b(digest_size=16)
    for array in arrays:
        digest.update(np.ascontiguousarray(array).tobytes())
    digests = comm.allgather(digest.hexdigest())
    return None if len(set(digests)) == 1 else f'weights differ across ranks (digests {digests})'


def checked_once(op, arrays, expected, what):
    """op, after one run that must leave `expected` (the sum) in arrays, ones before it; then
    zeroed, so that repeated in-place sums neither grow to inf nor change the work done."""
    op()
    numpy_arrays = isinstance(arrays[-1], np.ndarray)
    check_sum(arrays[-1] if numpy_arrays else arrays[-1].asnumpy(), expected, what)
    for array in arrays:
        array[:] = 0
    if not numpy_arrays:
        import mxnet as mx
        mx.nd.waitall()
    return op


def summed_op(reduce, nbytes, expected, what, count=1):
    """An op that runs reduce(buf) on `count` float32 buffers of nbytes each (checked_once)."""
    buffers = [np.ones(nbytes // 4, np.float32) for _ in range(count)]

    def op():
        for buf in buffers:
            reduce(buf)
    return checked_once(op, buffers, expected, what)


def pushpull_op(kv, keys, nbytes, expected=None):
    """pushpull every key in place, one call per key (priority -i, as Trainer passes), then
    wait for all; checked_once (the sum over ranks, or `expected`)."""
    import mxnet as mx
    arrays = [mx.nd.ones((nbytes // 4,), dtype='float32') for _ in keys]
    kv.init(list(keys), arrays)

    def op():
        for i, (key, array) in enumerate(zip(keys, arrays)):
            kv.pushpull(key, array, priority=-i)
        for array in arrays:
            array.wait_to_read()
    if expected is None:
        # 2-bit compression (a '+2bit=T' design) sends T for a value of 1 >= T, 0 below it.
        codec = getattr(getattr(kv, '_exchange', None), 'codec', None)   # MPIKVStore's
        sent = 1.0 if codec is None else (float(codec.threshold) if codec.threshold <= 1 else 0.0)
        expected = kv.num_workers * sent
    return checked_once(op, arrays, expected, f'{kv.type} pushpull')


# ---------------------------------------------------------------- mpi_kvstore's stores

def agree(error, comm=None):
    """Collective: every rank's error (or None) -> the first one, the same on all ranks."""
    comm = world() if comm is None else comm
    return next((e for e in comm.allgather(error) if e), None)


def designs(text):
    """--designs 'funneled,chained' -> a list; None -> every design mpi_kvstore has. A design
    may carry store options after '+' ('funneled+native_ops=0', for an A/B in one run);
    '+2bit=T' sets 2-bit gradient compression with threshold T."""
    import mpi_kvstore
    return names(text) if text else list(mpi_kvstore.DESIGNS)


def store_options(spec):
    """'funneled+native_ops=0' -> {'design': 'funneled', 'native_ops': '0'}; None -> {}."""
    if not spec:
        return {}
    name, *pairs = spec.split('+')
    return dict([('design', name)] + [tuple(p.split('=', 1)) for p in pairs])


def create_store(design, timeout, **extra):
    """Collective: (mpi_kvstore store, None) on every rank, or (None, why) on every rank.
    design None takes the default (MPI_KVSTORE_DESIGN, else funneled); see designs().
    `extra` store options add to the design's."""
    import mpi_kvstore
    options = dict(store_options(design), **extra)
    # A benchmark times fixed settings: across hosts the default search would switch them
    # inside the timed runs. A column that times the search's choice asks for autotune=1
    # and trains until it settles first (overlap's autotuned).
    options.setdefault('autotune', '0')
    two_bit = options.pop('2bit', None)
    with deadline(timeout, f'creating mpi_kvstore design {design or "default"!r}'):
        try:
            kv, why = mpi_kvstore.create('dist_mpi', **options), None
            if two_bit is not None:
                kv.set_gradient_compression({'type': '2bit', 'threshold': float(two_bit)})
        except Exception as exc:
            kv, why = None, f'{type(exc).__name__}: {exc}'
        why = agree(why)
    return (None, why) if why else (kv, None)


def make_trainer(kind, params, optimizer, kv=None, compression='none', **extra):
    """The trainers the benchmarks compare, made one way, SGD-like optimizer (name, {options}):
    'distributed', mpi_kvstore.DistributedTrainer on kv (the grouped exchange); 'gluon',
    gluon.Trainer on kv (one pushpull a parameter; the update on the rank; kv None: no
    exchange); 'horovod', horovod.mxnet's DistributedTrainer (compression 'fp16': its fp16).
    extra: more of DistributedTrainer's options (group_bytes).
    Returns (trainer, ranks): what step()'s batch is multiplied by, the rank count where the
    gradients are summed, 1 where Horovod averages them."""
    from mxnet import gluon

    import mpi_kvstore
    name, options = optimizer[0], dict(optimizer[1])
    if kind == 'distributed':
        return mpi_kvstore.DistributedTrainer(params, name, options, store=kv, **extra), kv.num_workers
    if kind == 'gluon':
        return (gluon.Trainer(params, name, options, kvstore=kv, update_on_kvstore=False if kv else None),
                kv.num_workers if kv is not None else 1)
    if kind == 'horovod':
        import horovod.mxnet as hvd
        wire = hvd.Compression.fp16 if compression == 'fp16' else hvd.Compression.none
        return hvd.DistributedTrainer(params, name, options, compression=wire), 1
    raise ValueError(f'no trainer {kind!r}: distributed, gluon or horovod')


# ---------------------------------------------------------------- output

def mpiexec_beside(python):
    """The mpiexec of python's environment (a Horovod venv's, for its jobs)."""
    return os.path.join(os.path.dirname(python), 'mpiexec')


def check_python(parser, python):
    """--horovod-python: an executable with mpiexec beside it (else parser.error), or None."""
    if python and not (os.access(python, os.X_OK) and os.access(mpiexec_beside(python), os.X_OK)):
        parser.error(f'--horovod-python {python}: not an executable with mpiexec beside it')


def rank0_print(*args, comm=None, **kwargs):
    if (world() if comm is None else comm).rank == 0:
        print(*args, flush=True, **kwargs)


def _version_of(module_name):
    try:
        return __import__(module_name).__version__
    except Exception as exc:
        return f'unavailable ({type(exc).__name__})'


def versions():
    """Everything needed to tell two result files apart."""
    MPI = _mpi()
    return {'python': platform.python_version(), 'numpy': _version_of('numpy'),
            'mxnet': _version_of('mxnet'), 'mpi4py': _version_of('mpi4py'),
            'mpi_kvstore': _version_of('mpi_kvstore'),
            'mpi_library': MPI.Get_library_version().strip(),
            'mpi_thread_level': MPI.Query_thread(), 'hostname': socket.gethostname(),
            'platform': platform.platform(), 'cpu_count': os.cpu_count()}


def _relevant_env():
    prefixes = ('OMP_', 'MXNET_', 'MPI_KVSTORE_', 'DMLC_', 'MPICH_', 'UCX_', 'FI_')
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(prefixes)}


def write_json(path, payload, config=None, comm=None):
    """Write payload plus versions, environment, rank count and configuration (rank 0 only)."""
    comm = world() if comm is None else comm
    if comm.rank != 0:
        return
    record = {'versions': versions(), 'env': _relevant_env(), 'nranks': comm.size,
              'config': config or {}, 'time': time.strftime('%Y-%m-%dT%H:%M:%S%z'), **payload}
    schema.check(record, path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    replace_json(path, record)


def replace_json(path, payload):
    """payload as JSON at path, written beside it and renamed over it: a reader never sees
    half a file, even if the job is killed (the root drivers save after every job)."""
    tmp = f'{path}.tmp'
    with open(tmp, 'w') as handle:
        json.dump(payload, handle, indent=1, default=str)
    os.replace(tmp, path)


class Run:
    """One run's bookkeeping: its arguments, the methods it skipped and why, what a deadline
    kills first (on_expire), and where results go: <out>/<name>_n<ranks>[_<label>].json
    and .png. write() saves what there is so far, so a killed job still leaves it, with the
    command line and the date the run started, which every table quoting it must state."""

    def __init__(self, name, args, label='', comm=None):
        self.name, self.args = name, args
        self.started = time.strftime('%Y-%m-%dT%H:%M:%S%z')
        self.comm = world() if comm is None else comm
        self.skipped, self.on_expire = {}, None
        base = os.path.join(args.out, f'{name}_n{self.comm.size}' + (f'_{label}' if label else ''))
        self.json_path, self.png_path = base + '.json', base + '.png'

    def skip(self, method, why):
        self.skipped[method] = why
        rank0_print(f'  skipped {method}: {why}', comm=self.comm)

    def time_ops(self, what, makers):
        """{name: [seconds of each timed round]} of the ops makers build ({name: make_op}),
        built and timed in interleaved rounds (--warmups, --trials) under one deadline."""
        rank0_print(f'measuring {what}: {", ".join(makers)} ...', comm=self.comm)
        with deadline(self.args.timeout, what, self.on_expire):
            ops = {name: make() for name, make in makers.items()}
            return interleaved(ops, self.args.trials, self.args.warmups, comm=self.comm)

    def write(self, payload, **config):
        """payload plus the benchmark's name and skipped methods; config: what the JSON's
        configuration adds to the arguments."""
        config = dict(vars(self.args), script=f'benchmarks/{self.name}.py',
                      nranks=self.comm.size, argv=sys.argv, date=self.started,
                      command=f'mpiexec -n {self.comm.size} python -m benchmarks.{self.name} '
                              + shlex.join(sys.argv[1:]), **config)
        write_json(self.json_path, {'benchmark': self.name, **payload, 'skipped': self.skipped},
                   config, self.comm)


# ---------------------------------------------------------------- failure handling

def run_main(main):
    """Run main(); an uncaught exception on any rank ends the whole job instead of leaving
    the other ranks waiting in a collective (what `python -m mpi4py` does)."""
    try:
        return main()
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        world().Abort(1)


def _expire(seconds, what, on_expire):
    sys.stderr.write(f'[rank {world().rank}] {what} took more than {seconds:.0f} s; '
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
