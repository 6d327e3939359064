"""``import mpi_kvstore.horovod as hvd``: Horovod's MXNet API (``horovod.mxnet``) on the store.

A Horovod MXNet script runs with its import line changed to this one. The names, keywords
and numbers are Horovod's: reductions average by default, ``DistributedTrainer`` and
``DistributedOptimizer`` average the gradients over the processes (so ``trainer.step(local
batch size)`` trains the model one process would train on the whole batch), ranks are ranks
of the communicator given to :func:`init`, process sets are sub-communicators.

Underneath everything is an :class:`~mpi_kvstore.store.MPIKVStore`, which keeps MXNet's sum
semantics: averaging is done here, as Horovod itself does it on a CPU (a sum, and the
optimizer's ``rescale_grad`` divided by the number of processes).

Engine ops (asynchronous, ordered with the rest of the computation by MXNet's engine):
allreduce and grouped_allreduce with Average or Sum, broadcast, allgather of alike shapes,
reducescatter, and the trainers' gradient exchange. Synchronous (they wait for their input,
run one MPI call on numpy copies in collective order, and return a finished array): Min,
Max and Product, alltoall, the object functions. docs/coming-from-horovod.md maps every name.
"""
import logging
import os
import tempfile
import threading
import warnings

import mxnet as mx
import numpy as np
from mxnet import gluon

from . import functional
from .config import launcher_local_rank
from .mpiabi import MPI
from .store import MPIKVStore

__all__ = [
    'init', 'shutdown', 'is_initialized', 'rank', 'size', 'local_rank', 'local_size',
    'cross_rank', 'cross_size', 'mpi_threads_supported', 'mpi_enabled', 'mpi_built',
    'gloo_enabled', 'gloo_built', 'nccl_built', 'ddl_built', 'ccl_built', 'cuda_built',
    'rocm_built', 'Average', 'Sum', 'Adasum', 'Min', 'Max', 'Product',
    'allreduce', 'allreduce_', 'grouped_allreduce', 'grouped_allreduce_', 'allgather',
    'grouped_allgather', 'broadcast', 'broadcast_', 'alltoall', 'reducescatter',
    'grouped_reducescatter', 'broadcast_object', 'allgather_object', 'Compression',
    'broadcast_parameters', 'DistributedTrainer', 'DistributedOptimizer', 'ProcessSet',
    'global_process_set', 'add_process_set', 'remove_process_set', 'start_timeline',
    'stop_timeline', 'store',
]

log = logging.getLogger(__name__)

# Horovod's reduction ops, with Horovod's numbers (horovod.common.basics).
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
_OP_NAMES = {Average: 'Average', Sum: 'Sum', Adasum: 'Adasum', Min: 'Min', Max: 'Max',
             Product: 'Product'}
_MPI_OPS = {Min: 'MIN', Max: 'MAX', Product: 'PROD'}

_NOT_INITIALIZED = 'Horovod has not been initialized; use hvd.init().'
_lock = threading.RLock()
_state = {}
_named_once = []   # the ignored HOROVOD_* variables are named once a process, not once an init


# -- the environment --------------------------------------------------------------------------
def _seconds(text):
    return float(text)


def _on_off(text):
    return 'on' if text.strip().lower() in ('1', 'true', 'yes', 'on') else 'off'


# HOROVOD_* variable -> (store option, parse); MPI_KVSTORE_<OPTION> wins over it
_HONOURED = {
    'HOROVOD_FUSION_THRESHOLD': ('fusion_threshold', int),
    'HOROVOD_TIMELINE': ('timeline', str),
    'HOROVOD_HIERARCHICAL_ALLREDUCE': ('hierarchical', _on_off),
    'HOROVOD_STALL_CHECK_TIME_SECONDS': ('stall_warning', _seconds),
    'HOROVOD_STALL_SHUTDOWN_TIME_SECONDS': ('stall_abort', _seconds),
}
# Read here for what they mean, not passed to the store.
_HANDLED = ('HOROVOD_STALL_CHECK_DISABLE', 'HOROVOD_LOG_LEVEL')
_LOG_LEVELS = {'trace': logging.DEBUG, 'debug': logging.DEBUG, 'info': logging.INFO,
               'warning': logging.WARNING, 'error': logging.ERROR, 'fatal': logging.CRITICAL}


def environment_options(environ=None):
    """The store options that Horovod's environment variables ask for, and the HOROVOD_*
    variables that have no meaning here (sorted) -> (options, ignored). An
    ``MPI_KVSTORE_*`` variable of the same option wins over the Horovod one."""
    environ = os.environ if environ is None else environ
    options = {}
    for var, (option, parse) in _HONOURED.items():
        if var in environ and 'MPI_KVSTORE_%s' % option.upper() not in environ:
            try:
                options[option] = parse(environ[var])
            except ValueError as err:
                raise ValueError('%s=%r: %s' % (var, environ[var], err)) from err
    disable = environ.get('HOROVOD_STALL_CHECK_DISABLE', '').strip().lower()
    if disable in ('1', 'true', 'yes', 'on') and 'MPI_KVSTORE_STALL_WARNING' not in environ:
        options['stall_warning'] = 0.0
    if options.get('timeline', '').upper() == 'DYNAMIC':
        options['timeline'] = os.path.join(tempfile.gettempdir(),
                                           'mpi_kvstore-hvd-timeline-%d.json' % os.getpid())
    ignored = sorted(var for var in environ
                     if var.startswith('HOROVOD_') and var not in _HONOURED
                     and var not in _HANDLED)
    return options, ignored


def _apply_log_level(environ):
    level = environ.get('HOROVOD_LOG_LEVEL', '').strip().lower()
    if level in _LOG_LEVELS:
        logging.getLogger('mpi_kvstore').setLevel(_LOG_LEVELS[level])


# -- init and the process sets ---------------------------------------------------------------
class ProcessSet:
    """Horovod's process set: the ranks (of :func:`init`'s communicator) that run a collective
    together. Here it is a store on a sub-communicator, made when :func:`init` or
    :func:`add_process_set` registers it (collective on every process). Build it from a list
    of ranks or from an mpi4py communicator (``MPI.COMM_NULL`` on the processes outside)."""

    process_set_id = None
    ranks = None
    mpi_comm = None

    def __init__(self, ranks_or_comm):
        if isinstance(ranks_or_comm, MPI.Comm):
            self.mpi_comm = ranks_or_comm
        else:
            try:
                ranks = sorted(ranks_or_comm)
            except TypeError:
                raise ValueError('ProcessSet takes a list of ranks or an mpi4py communicator, '
                                 'not %r' % (ranks_or_comm,)) from None
            if any(not isinstance(r, (int, np.integer)) or isinstance(r, bool) for r in ranks):
                raise ValueError('ProcessSet: ranks must be ints, not %r' % (ranks,))
            self.ranks = [int(r) for r in ranks]
        self._store = None     # this process's store of the set (None outside it)
        self._stores = {}      # DistributedTrainer's stores by compression

    def size(self):
        """The number of processes in the set, or None before it is registered."""
        return None if self.process_set_id is None else len(self.ranks)

    def rank(self):
        """This process's rank inside the set, None outside it or before registration."""
        if self.process_set_id is None or not self.included():
            return None
        return self.ranks.index(rank())

    def included(self):
        """Whether this process belongs to the set (None before its ranks are known)."""
        if self.ranks is None:
            return None
        return rank() in self.ranks

    def __str__(self):
        return 'ProcessSet(process_set_id=%s, ranks=%s, mpi_comm=%s)' % (
            self.process_set_id, self.ranks, self.mpi_comm)

    __repr__ = __str__


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


def init(comm=None, process_sets=None, **options):
    """Start: a store on ``comm`` (default COMM_WORLD; an mpi4py communicator, or a list of
    COMM_WORLD ranks), and one for each of ``process_sets``. Collective on COMM_WORLD (or on
    ``comm``). Store options (mpi_kvstore.config) may be given as keywords; the HOROVOD_*
    variables the store has a meaning for are honoured (docs/coming-from-horovod.md), and the
    others named once in a log line. A second call while initialized does nothing."""
    with _lock:
        if _state.get('store') is not None:
            return
        if comm is None:
            comm = MPI.COMM_WORLD
        elif not isinstance(comm, MPI.Comm):
            ranks = sorted(int(r) for r in comm)
            world = MPI.COMM_WORLD
            sub = world.Split(0 if world.Get_rank() in ranks else MPI.UNDEFINED,
                              world.Get_rank())
            if sub == MPI.COMM_NULL:
                raise ValueError('hvd.init(comm=%s): COMM_WORLD rank %d is not in it'
                                 % (ranks, world.Get_rank()))
            comm = sub
        environ = os.environ
        _apply_log_level(environ)
        env_options, ignored = environment_options(environ)
        store_options = dict(env_options, **options)
        store_options['average'] = False   # the store sums; averaging happens here
        kv = MPIKVStore('dist_mpi', comm=comm, **store_options)
        if kv.timeline is not None and environ.get('HOROVOD_TIMELINE', '').upper() == 'DYNAMIC':
            kv.timeline.record_into(None)   # nothing is kept until start_timeline
        me, count = comm.Get_rank(), comm.Get_size()
        found = launcher_local_rank() if comm == MPI.COMM_WORLD else None
        if found is None:
            node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=me)
            found = (node.Get_rank(), node.Get_size())
            node.Free()
        cross = comm.Split(found[0], me)
        _state.update(store=kv, options=store_options, comm=comm, rank=me, size=count, local=found,
                      cross=(cross.Get_rank(), cross.Get_size()), sets={0: global_process_set},
                      next_id=1)
        cross.Free()
        global_process_set.ranks = list(range(count))
        global_process_set._store = kv
        global_process_set._stores = {}
        if me == 0:
            honoured = sorted(var for var in _HONOURED if var in environ)
            if honoured:
                log.info('mpi_kvstore.horovod: honouring %s as store options %s',
                         ', '.join(honoured), env_options)
            if ignored and not _named_once:
                _named_once.append(True)
                log.warning('mpi_kvstore.horovod: these Horovod variables have no meaning '
                            'here and are ignored: %s (docs/coming-from-horovod.md)',
                            ', '.join(ignored))
    if isinstance(process_sets, str):
        if process_sets.lower() != 'dynamic':
            raise ValueError("hvd.init: process_sets is a list of ProcessSets or 'dynamic', "
                             'not %r' % (process_sets,))
        process_sets = ()   # add_process_set works without it here
    for process_set in process_sets or ():
        add_process_set(process_set)


def _require_init():
    if _state.get('store') is None:
        raise ValueError(_NOT_INITIALIZED)


def add_process_set(process_set):
    """Register a process set (a ProcessSet or a list of ranks) and return it: a
    sub-communicator and a store on it for its members. Collective on every process, as
    in Horovod; the same ranks twice raise ValueError."""
    _require_init()
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    comm = _state['comm']
    me = _state['rank']
    if process_set.ranks is None:   # built from a communicator: learn its members
        inside = process_set.mpi_comm != MPI.COMM_NULL
        members = comm.allgather(me if inside else None)
        process_set.ranks = [r for r in members if r is not None]
    bad = [r for r in process_set.ranks if not 0 <= r < _state['size']]
    if bad or not process_set.ranks or len(set(process_set.ranks)) != len(process_set.ranks):
        raise ValueError('add_process_set: ranks %s must be distinct ranks in [0, %d)'
                         % (process_set.ranks, _state['size']))
    with _lock:
        for known in _state['sets'].values():
            if known is not process_set and known.ranks == process_set.ranks:
                raise ValueError('add_process_set: a process set of ranks %s exists already: %s'
                                 % (process_set.ranks, known))
    sub = comm.Split(0 if me in process_set.ranks else MPI.UNDEFINED, me)
    if sub != MPI.COMM_NULL:
        process_set._store = MPIKVStore('dist_mpi', comm=sub, **_store_options())
        sub.Free()   # the store keeps its own duplicate
    with _lock:
        process_set.process_set_id = _state['next_id']
        _state['next_id'] += 1
        _state['sets'][process_set.process_set_id] = process_set
    return process_set


def remove_process_set(process_set):
    """Close a registered process set's stores; True if it was registered (the global set is
    never removed). Collective on the set's members."""
    with _lock:
        if (process_set is global_process_set or process_set.process_set_id is None
                or _state.get('sets', {}).get(process_set.process_set_id) is not process_set):
            return False
        del _state['sets'][process_set.process_set_id]
    for kv in [process_set._store, *process_set._stores.values()]:
        if kv is not None:
            kv.close()
    process_set._store, process_set._stores = None, {}
    process_set.process_set_id = None
    return True


def _store_options():
    """The options of init's store (the environment's and init's keywords) for another store
    on these processes: without the timeline, which init's store alone writes."""
    return dict(_state['options'], timeline='')


def shutdown():
    """Finish every collective and close the stores; init() may start again."""
    with _lock:
        if _state.get('store') is None:
            return
        sets = list(_state['sets'].values())
        _state.clear()
    for process_set in sets:
        for kv in [process_set._store, *process_set._stores.values()]:
            if kv is not None:
                kv.close()
        process_set._store, process_set._stores = None, {}
        if process_set is not global_process_set:
            process_set.process_set_id = None
    global_process_set.ranks = []


def is_initialized():
    return _state.get('store') is not None


def store():
    """The store under :func:`init` (an MPIKVStore), for the rest of mpi_kvstore's API."""
    _require_init()
    return _state['store']


def rank():
    _require_init()
    return _state['rank']


def size():
    _require_init()
    return _state['size']


def local_rank():
    _require_init()
    return _state['local'][0]


def local_size():
    _require_init()
    return _state['local'][1]


def cross_rank():
    """This process's rank among the processes of the same local rank (one a node)."""
    _require_init()
    return _state['cross'][0]


def cross_size():
    """The number of processes of this process's local rank: the number of nodes."""
    _require_init()
    return _state['cross'][1]


# -- what this build has ----------------------------------------------------------------------
def mpi_built():
    return True


def mpi_enabled():
    return True


def mpi_threads_supported():
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def gloo_built():
    return False


def gloo_enabled():
    return False


def nccl_built():
    """0, as Horovod answers without NCCL: the store's NCCL transport (docs/gpu.md) runs on
    CuPy, not in an MXNet build of Horovod's kind."""
    return 0


def ddl_built():
    return False


def ccl_built():
    return False


def cuda_built():
    """Whether this MXNet was built with CUDA (the store then exchanges GPU arrays)."""
    return bool(mx.runtime.Features().is_enabled('CUDA'))


def rocm_built():
    return False


# -- timeline ---------------------------------------------------------------------------------
def start_timeline(file_path, mark_cycles=False):
    """Record the collectives from now on into ``file_path`` (one file a rank: ``.rankN``
    before the extension). As in Horovod, the timeline must be enabled at init:
    HOROVOD_TIMELINE=DYNAMIC, a path, or the store's timeline option."""
    _require_init()
    timeline = _state['store'].timeline
    if timeline is None:
        raise ValueError('Set HOROVOD_TIMELINE=DYNAMIC to enable dynamic timeline usage.')
    from .timeline import trace_path  # the store's own file naming
    timeline.record_into(trace_path(file_path, _state['rank'], _state['size']))


def stop_timeline():
    """Write the timeline recorded since start_timeline and stop filling that file."""
    _require_init()
    timeline = _state['store'].timeline
    if timeline is None:
        return
    timeline.write()
    timeline.record_into(None)


# -- argument checks --------------------------------------------------------------------------
def _op_of(op, average, what):
    if op is not None and average is not None:
        raise ValueError('%s: the op parameter supersedes average; give only one of them'
                         % what)
    if op is None:
        if average is None:
            return Average
        warnings.warn('Parameter `average` has been replaced with `op`', DeprecationWarning,
                      stacklevel=3)
        return Average if average else Sum
    if isinstance(op, bool) or op not in _OP_NAMES:
        raise ValueError('%s: unknown op %r; use one of hvd.Average, hvd.Sum, hvd.Min, hvd.Max, '
                         'hvd.Product' % (what, op))
    if op == Adasum:
        raise NotImplementedError(
            '%s: hvd.Adasum is not implemented by mpi_kvstore; use op=hvd.Average (the '
            'default, what DistributedTrainer and DistributedOptimizer do) or hvd.Sum'
            % what)
    return op


def _set_store(process_set, what, compression=None):
    """This process's store of ``process_set``; ValueError outside the set."""
    _require_init()
    if not isinstance(process_set, ProcessSet):
        raise ValueError('%s: process_set must be a ProcessSet, not %r' % (what, process_set))
    if process_set.process_set_id is None:
        raise ValueError('%s: %s is not registered: pass it to hvd.init(process_sets=[...]) '
                         'or hvd.add_process_set()' % (what, process_set))
    if process_set._store is None:
        raise ValueError('%s: rank %d is not in %s; only its ranks may call it'
                         % (what, _state['rank'], process_set))
    return process_set._store


def _set_root(process_set, root_rank, what):
    """The root's rank inside the set (root_rank is a rank of init's communicator)."""
    if isinstance(root_rank, bool) or not isinstance(root_rank, (int, np.integer)):
        raise ValueError('%s: root_rank must be an int, not %r' % (what, root_rank))
    if root_rank not in process_set.ranks:
        raise ValueError('%s: root_rank %d is not a rank of %s (ranks %s)'
                         % (what, root_rank, 'the job' if process_set is global_process_set
                            else 'the process set', process_set.ranks))
    return process_set.ranks.index(int(root_rank))


def _scale(tensor, factor):
    """tensor *= factor, in place, as an engine op (integer tensors scaled in float64)."""
    if factor == 1.0:
        return tensor
    if np.issubdtype(np.dtype(tensor.dtype), np.floating):
        tensor *= factor
    else:
        tensor[:] = (tensor.astype('float64') * factor).astype(tensor.dtype)
    return tensor


# -- reductions -------------------------------------------------------------------------------
def _mpi_reduce(kv, tensor, op):
    """Min, Max, Product: MPI_Allreduce of a numpy copy in collective order (synchronous)."""
    dtype = np.dtype(tensor.dtype)
    wire = np.float32 if dtype == np.float16 else dtype   # MPI has no half type
    data = np.ascontiguousarray(tensor.asnumpy(), dtype=wire)
    mpi_op = getattr(MPI, _MPI_OPS[op])

    def reduce(comm):
        out = np.empty_like(data)
        comm.Allreduce(data, out, op=mpi_op)
        return out

    result = kv.run_collective(reduce, 'hvd.allreduce.%s' % _OP_NAMES[op].lower())
    tensor[:] = mx.nd.array(result.astype(dtype), ctx=tensor.context, dtype=dtype)
    return tensor


def _allreduce_inplace(tensor, op, name, prescale_factor, postscale_factor, process_set, what):
    kv = _set_store(process_set, what)
    _scale(tensor, prescale_factor)
    if op in _MPI_OPS:
        _mpi_reduce(kv, tensor, op)
        return _scale(tensor, postscale_factor)
    kv.array_collective('allreduce', name or 'hvd.allreduce', tensor)
    factor = postscale_factor / len(process_set.ranks) if op == Average else postscale_factor
    return _scale(tensor, factor)


def allreduce_(tensor, average=None, name=None, priority=0, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set, op=None):
    """Horovod's in-place allreduce: ``postscale * op(prescale * tensor)`` over the set's
    processes; op defaults to Average. Returns ``tensor``. ``priority`` is accepted: these
    collectives run in call order."""
    op = _op_of(op, average, 'allreduce_')
    return _allreduce_inplace(tensor, op, name, prescale_factor, postscale_factor,
                              process_set, 'allreduce_')


def allreduce(tensor, average=None, name=None, priority=0, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set, op=None):
    """As :func:`allreduce_`, into a new NDArray; ``tensor`` is left as it was."""
    op = _op_of(op, average, 'allreduce')
    _set_store(process_set, 'allreduce')
    return _allreduce_inplace(tensor.copy(), op, name, prescale_factor, postscale_factor,
                              process_set, 'allreduce')


def grouped_allreduce_(tensors, average=None, name=None, priority=0, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set, op=None):
    """allreduce_ of each tensor of the list, in place; returns the list."""
    op = _op_of(op, average, 'grouped_allreduce_')
    base = name or 'hvd.grouped_allreduce'
    for i, tensor in enumerate(tensors):
        _allreduce_inplace(tensor, op, '%s.%d' % (base, i), prescale_factor, postscale_factor,
                           process_set, 'grouped_allreduce_')
    return tensors


def grouped_allreduce(tensors, average=None, name=None, priority=0, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set, op=None):
    """grouped_allreduce_ into new NDArrays; the inputs are left as they were."""
    op = _op_of(op, average, 'grouped_allreduce')
    if tensors:
        _set_store(process_set, 'grouped_allreduce')
    return grouped_allreduce_([t.copy() for t in tensors], None, name, priority,
                              prescale_factor, postscale_factor, process_set, op)


def reducescatter(tensor, op=Average, name=None, priority=0, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0):
    """The Average (default) or Sum over the set, cut along axis 0 in rank order (the first
    ``rows % size`` ranks get a row more): this rank's part, a new NDArray."""
    op = _op_of(op, None, 'reducescatter')
    if op not in (Average, Sum):
        raise ValueError('reducescatter: op must be hvd.Average or hvd.Sum, not hvd.%s'
                         % _OP_NAMES[op])
    kv = _set_store(process_set, 'reducescatter')
    if tensor.ndim == 0:
        raise ValueError('reducescatter does not support scalar inputs')
    source = _scale(tensor.copy(), prescale_factor) if prescale_factor != 1.0 else tensor
    part = functional.reducescatter(source, average=False, name=name or 'hvd.reducescatter',
                                    store=kv)
    factor = postscale_factor / len(process_set.ranks) if op == Average else postscale_factor
    return _scale(part, factor)


def grouped_reducescatter(tensors, op=Average, name=None, priority=0,
                          process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0):
    base = name or 'hvd.grouped_reducescatter'
    return [reducescatter(t, op, '%s.%d' % (base, i), priority, process_set, prescale_factor,
                          postscale_factor) for i, t in enumerate(tensors)]


# -- gathers and broadcasts -------------------------------------------------------------------
def allgather(tensor, name=None, priority=0, process_set=global_process_set):
    """Every set member's tensor concatenated along axis 0 in rank order (first dimensions
    may differ), a new NDArray."""
    kv = _set_store(process_set, 'allgather')
    return functional.allgather(tensor, name=name or 'hvd.allgather', store=kv)


def grouped_allgather(tensors, name=None, priority=0, process_set=global_process_set):
    base = name or 'hvd.grouped_allgather'
    return [allgather(t, '%s.%d' % (base, i), priority, process_set)
            for i, t in enumerate(tensors)]


def broadcast_(tensor, root_rank, name=None, priority=0, process_set=global_process_set):
    """Overwrite ``tensor`` with ``root_rank``'s (a rank of init's communicator); returns it."""
    kv = _set_store(process_set, 'broadcast_')
    root = _set_root(process_set, root_rank, 'broadcast_')
    return kv.array_collective('bcast', name or 'hvd.broadcast', tensor, root=root)


def broadcast(tensor, root_rank, name=None, priority=0, process_set=global_process_set):
    """``root_rank``'s tensor as a new NDArray on every member; ``tensor`` is left as it was."""
    kv = _set_store(process_set, 'broadcast')
    root = _set_root(process_set, root_rank, 'broadcast')
    return kv.array_collective('bcast', name or 'hvd.broadcast', tensor.copy(), root=root)


def alltoall(tensor, splits=None, name=None, priority=0, process_set=global_process_set):
    """Send ``splits[i]`` rows of ``tensor`` (in order, along axis 0) to the set's i-th rank
    and return the rows received, concatenated in rank order (the splits may add up to fewer
    rows than the tensor has, as in Horovod). Without ``splits`` the rows
    are cut into equal parts (their number must divide by the set's size) and the result
    alone is returned; with it, also the rows received from each rank (an int32 NDArray).
    Synchronous: MPI_Alltoallv of a numpy copy in collective order."""
    kv = _set_store(process_set, 'alltoall')
    count = len(process_set.ranks)
    if tensor.ndim == 0:
        raise ValueError('alltoall does not support scalar inputs')
    rows = tensor.shape[0]
    if splits is None:
        if rows % count:
            raise ValueError('alltoall: %d rows cannot be cut into %d equal parts; pass splits'
                             % (rows, count))
        sends = [rows // count] * count
    else:
        sends = [int(s) for s in (splits.asnumpy() if isinstance(splits, mx.nd.NDArray)
                                  else np.asarray(splits)).ravel()]
        if len(sends) != count or min(sends) < 0 or sum(sends) > rows:
            raise ValueError('alltoall: splits %s must hold %d counts >= 0 that add up to at '
                             'most the %d rows of the tensor' % (sends, count, rows))
    data = np.ascontiguousarray(tensor.asnumpy()[:sum(sends)])   # as Horovod, rows past
    # the splits' sum stay here
    row_bytes = data.itemsize * int(np.prod(data.shape[1:], dtype=np.int64))

    def exchange(comm):
        received = comm.alltoall(sends)
        out = np.empty((sum(received),) + data.shape[1:], dtype=data.dtype)
        send_counts = [s * row_bytes for s in sends]
        recv_counts = [r * row_bytes for r in received]
        comm.Alltoallv([data.view(np.uint8).ravel(), (send_counts, None), MPI.BYTE],
                       [out.view(np.uint8).ravel(), (recv_counts, None), MPI.BYTE])
        return out, received

    out, received = kv.run_collective(exchange, name or 'hvd.alltoall')
    result = mx.nd.array(out, ctx=tensor.context, dtype=tensor.dtype)
    if splits is None:
        return result
    return result, mx.nd.array(received, ctx=mx.cpu(), dtype='int32')


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """``root_rank``'s picklable object, returned on every member."""
    kv = _set_store(process_set, 'broadcast_object')
    root = _set_root(process_set, root_rank, 'broadcast_object')
    return functional.broadcast_object(obj, root=root, store=kv)


def allgather_object(obj, name=None, process_set=global_process_set):
    """A list of every member's picklable object, in rank order."""
    kv = _set_store(process_set, 'allgather_object')
    return functional.allgather_object(obj, store=kv)


# -- compression ------------------------------------------------------------------------------
class Compressor:
    """Horovod's interface: ``compress(tensor) -> (tensor, ctx)``, ``decompress(tensor, ctx)``.
    A compressor of this module also names what the store does for it in a trainer:
    ``store_compression`` (the wire cast, config's compression) and ``params``
    (set_gradient_compression's)."""

    name = 'none'
    store_compression = 'none'
    params = None

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class NoneCompressor(Compressor):
    """No compression (the default)."""


class FP16Compressor(Compressor):
    """Float gradients travel as float16. In a trainer the store casts on the wire and sums in
    float32 (Horovod sums float16); ``compress``/``decompress`` cast, as Horovod's do."""

    name = 'fp16'
    store_compression = 'fp16'

    @staticmethod
    def compress(tensor):
        if 'float' in str(np.dtype(tensor.dtype)):
            return tensor.astype('float16', copy=False), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        if 'float' in str(np.dtype(ctx)):
            return tensor.astype(ctx, copy=False)
        return tensor


class BF16Compressor(Compressor):
    """Float gradients travel as bfloat16, summed in float32 (the store's compression='bf16');
    not in Horovod's MXNet API. compress/decompress leave the tensor as it is: the store
    casts."""

    name = 'bf16'
    store_compression = 'bf16'


class TwoBitCompressor(Compressor):
    """MXNet's 2-bit compression with error feedback (set_gradient_compression, threshold
    0.5 unless given: ``Compression.twobit_threshold(t)``); not in Horovod. Only in a
    trainer: compress/decompress leave the tensor as it is."""

    name = '2bit'
    threshold = 0.5

    @classmethod
    def params_(cls):
        return {'type': '2bit', 'threshold': cls.threshold}


class Compression:
    """Gradient compression for DistributedTrainer: Horovod's ``none`` and ``fp16``, and the
    store's ``bf16`` and ``twobit`` (``twobit_threshold(t)`` for another threshold)."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
    twobit = TwoBitCompressor

    @staticmethod
    def twobit_threshold(threshold):
        """A 2-bit compressor of this threshold (> 0)."""
        if not float(threshold) > 0:
            raise ValueError('2-bit compression needs a threshold > 0, not %r' % (threshold,))
        return type('TwoBitCompressor', (TwoBitCompressor,), {'threshold': float(threshold)})


def _ours(compression):
    return isinstance(compression, type) and issubclass(compression, Compressor)


def _trainer_store(process_set, compression):
    """The store a trainer of this set and compression exchanges through (created once per
    kind, collectively on the set's members)."""
    base = _set_store(process_set, 'DistributedTrainer')
    if not _ours(compression) or compression.name == 'none':
        return base
    key = (compression.name, getattr(compression, 'threshold', None))
    kv = process_set._stores.get(key)
    if kv is None:
        # a communicator of the same members, duplicated in the store's collective order
        comm = base.run_collective(lambda comm: comm.Dup(), 'hvd.dup')
        kv = MPIKVStore('dist_mpi', comm=comm,
                        **dict(_store_options(), compression=compression.store_compression))
        comm.Free()   # the store keeps its own duplicate
        if compression.name == '2bit':
            kv.set_gradient_compression(compression.params_())
        process_set._stores[key] = kv
    return kv


# -- parameters, trainer, optimizer -----------------------------------------------------------
def _broadcast_after_init(param, root_rank, name):
    """Wrap a deferred parameter's initialisation so that root's values follow it, inside
    the first forward and before the data is used (every rank runs that forward)."""
    original = param._init_impl

    def init_then_broadcast(self, *args, **kwargs):
        original(*args, **kwargs)
        for i, array in enumerate(self.list_data()):
            broadcast_(array, root_rank, name='%s.%d' % (name, i))

    param._init_impl = init_then_broadcast.__get__(param)


def broadcast_parameters(params, root_rank=0, prefix=None):
    """Give every process ``root_rank``'s values: ``params`` is a ParameterDict or a dict of
    Parameters (Block.collect_params()), or a dict of NDArrays (Module.get_params()), broadcast
    in place in name order. A Parameter whose initialisation is deferred is broadcast when it
    is initialised. ``prefix`` names the collectives of one call apart from another's."""
    _require_init()
    if prefix is not None and not isinstance(prefix, str):
        raise ValueError('broadcast_parameters: prefix must be a str or None, not %r'
                         % (prefix,))
    if not isinstance(params, (dict, gluon.ParameterDict)):
        raise ValueError('invalid params of type: %s' % type(params))
    _set_root(global_process_set, root_rank, 'broadcast_parameters')
    if size() == 1:
        return
    prefix = prefix or ''
    for name, value in sorted(params.items(), key=lambda item: str(item[0])):
        full = 'hvd.param:%s%s' % (prefix, name)
        if isinstance(value, gluon.Parameter):
            if value._deferred_init:
                _broadcast_after_init(value, root_rank, full)
                continue
            for i, array in enumerate(value.list_data()):
                broadcast_(array, root_rank, name='%s.%d' % (full, i))
        elif isinstance(value, mx.nd.NDArray):
            broadcast_(value, root_rank, name=full)
        else:
            raise ValueError('broadcast_parameters: %r is a %s, not a Parameter or an NDArray'
                             % (name, type(value).__name__))


def _split_list(items, parts):
    """``items`` cut into ``parts`` runs of near-equal length, in order (the first runs get
    one more), empty runs left out."""
    return [run for run in np.array_split(np.arange(len(items)), parts) if len(run)]


# Bytes of gradients a pushpull when num_groups is 0 (as mpi_kvstore.DistributedTrainer).
GROUP_BYTES = 4 << 20


def _byte_groups(entries):
    """(key, grads) entries, last first, in runs of about GROUP_BYTES."""
    runs, run, total = [], [], 0
    for entry in reversed(entries):
        nbytes = entry[1][0].size * np.dtype(entry[1][0].dtype).itemsize
        if run and total + nbytes > GROUP_BYTES:
            runs.append(run)
            run, total = [], 0
        run.append(entry)
        total += nbytes
    if run:
        runs.append(run)
    return runs


class DistributedTrainer(gluon.Trainer):
    """Horovod's DistributedTrainer: a gluon.Trainer whose gradients are averaged over the
    processes of ``process_set``, so ``step(local batch size)`` trains as one process would on
    every process's batch together. Gradients are scaled by ``1/gradient_predivide_factor``
    before the sum and ``gradient_predivide_factor/size`` after (in the optimizer's
    rescale_grad, as Horovod does on a CPU).

    The exchange is the store's pushpull (engine ops, fused): ``num_groups=0`` in groups of
    about 4 MB, last layer first (mpi_kvstore.DistributedTrainer's order); ``num_groups=n``:
    the parameters cut into n near-equal groups, one pushpull each. ``compression``: a
    :class:`Compression` member (fp16, bf16: the store's wire cast; twobit: MXNet's 2-bit), or
    any Horovod-style compressor (compress, a sum, decompress). Unlike Horovod, the trainer
    also gives every process rank 0's parameters at its first step (gluon.Trainer's own
    broadcast), a no-op after broadcast_parameters."""

    def __init__(self, params, optimizer, optimizer_params=None, compression=Compression.none,
                 gradient_predivide_factor=1.0, prefix=None, num_groups=0,
                 process_set=global_process_set):
        if isinstance(optimizer, DistributedOptimizer):
            optimizer = optimizer._optimizer
            warnings.warn('DistributedTrainer does not take DistributedOptimizer as its '
                          'optimizer. We have unwrapped it for you.', stacklevel=2)
        if prefix is not None and not isinstance(prefix, str):
            raise ValueError('DistributedTrainer: prefix must be a str or None')
        if not float(gradient_predivide_factor) > 0:
            raise ValueError('DistributedTrainer: gradient_predivide_factor must be > 0, not %r'
                             % (gradient_predivide_factor,))
        if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 0:
            raise ValueError('DistributedTrainer: num_groups must be an int >= 0, not %r'
                             % (num_groups,))
        kv = _trainer_store(process_set, compression)
        self._custom = None if _ours(compression) else compression
        super().__init__(params, optimizer, optimizer_params,
                         kvstore=kv if kv.num_workers > 1 else None,
                         update_on_kvstore=False if kv.num_workers > 1 else None)
        self._predivide = float(gradient_predivide_factor)
        self._scale *= self._predivide / kv.num_workers
        self._prefix = prefix or ''
        self._num_groups = num_groups
        self._hvd_store = kv

    def _allreduce_grads(self):
        entries = [(i, param.list_grad()) for i, param in enumerate(self._params)
                   if param.grad_req != 'null']
        if self._predivide != 1.0:   # on one process too: rescale_grad holds the factor
            for _, grads in entries:
                for grad in grads:
                    grad *= 1.0 / self._predivide
        if not self._kvstore:
            return
        if self._custom is not None:
            self._allreduce_custom(entries)
            return
        if self._num_groups > 0:
            runs = [[entries[j] for j in run] for run in _split_list(entries, self._num_groups)]
        else:
            runs = _byte_groups(entries)
        for run in runs:
            keys = [key for key, _ in run]
            # gluon's convention: the lower the key, the higher the priority
            self._kvstore.pushpull(keys, [grads for _, grads in run], priority=-min(keys))

    def _allreduce_custom(self, entries):
        """A compressor of Horovod's kind: compress, sum, decompress, as Horovod does."""
        for key, grads in entries:
            for j, grad in enumerate(grads):
                compressed, ctx = self._custom.compress(grad)
                self._hvd_store.array_collective(
                    'allreduce', 'hvd.trainer:%s%d.%d' % (self._prefix, key, j), compressed)
                grad[:] = self._custom.decompress(compressed, ctx)


class DistributedOptimizer(mx.optimizer.Optimizer):
    """Horovod's DistributedOptimizer, for Module (``mod.fit(..., kvstore=None,
    optimizer=hvd.DistributedOptimizer(opt))``): each update first averages its gradients
    over the processes (a sum of ``grad / gradient_predivide_factor``, with the wrapped
    optimizer's rescale_grad multiplied by ``gradient_predivide_factor / size`` here, as
    Horovod does on a CPU), then runs the wrapped optimizer. Other attributes are the wrapped
    optimizer's. ``num_groups`` is accepted: each gradient is its own collective, and the
    store fuses those ready together."""

    def __init__(self, optimizer, gradient_predivide_factor=1.0, num_groups=0,
                 process_set=global_process_set):
        if not float(gradient_predivide_factor) > 0:
            raise ValueError('DistributedOptimizer: gradient_predivide_factor must be > 0')
        kv = _set_store(process_set, 'DistributedOptimizer')
        self._optimizer = optimizer
        self._predivide = float(gradient_predivide_factor)
        self._num_groups = num_groups
        self._process_set = process_set
        self._hvd_store = kv
        optimizer.rescale_grad *= self._predivide / kv.num_workers

    def __getattr__(self, item):
        if item.startswith('__') or item == '_optimizer':
            raise AttributeError(item)
        return getattr(self._optimizer, item)

    def create_state(self, index, weight):
        return self._optimizer.create_state(index, weight)

    def create_state_multi_precision(self, index, weight):
        return self._optimizer.create_state_multi_precision(index, weight)

    def _do_allreduce(self, index, grad):
        indices = list(index) if isinstance(index, (tuple, list)) else [index]
        grads = list(grad) if isinstance(grad, (tuple, list)) else [grad]
        for g in grads:   # on one process too: rescale_grad holds the factor
            _scale(g, 1.0 / self._predivide)
        if self._hvd_store.num_workers == 1:
            return
        for i, g in zip(indices, grads):
            self._hvd_store.array_collective('allreduce', 'hvd.opt:%s' % (i,), g)

    def update(self, index, weight, grad, state):
        self._do_allreduce(index, grad)
        self._optimizer.update(index, weight, grad, state)

    def update_multi_precision(self, index, weight, grad, state):
        self._do_allreduce(index, grad)
        self._optimizer.update_multi_precision(index, weight, grad, state)

    def set_learning_rate(self, lr):
        self._optimizer.set_learning_rate(lr)

    def set_lr_mult(self, args_lr_mult):
        self._optimizer.set_lr_mult(args_lr_mult)

    def set_wd_mult(self, args_wd_mult):
        self._optimizer.set_wd_mult(args_wd_mult)
