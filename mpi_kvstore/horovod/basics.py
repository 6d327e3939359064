"""Horovod's basics on the store: init, ranks, what this build has, and the timeline
(mpi_kvstore.horovod's docstring says more; process_sets.py has the process sets,
environment.py reads the HOROVOD_* variables)."""
from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Any

import mxnet as mx

from ..comm import topology
from ..comm.mpiabi import MPI
from ..comm.timeline import trace_path
from ..config import launcher_local_rank
from ..elastic.exceptions import HorovodInternalError
from ..elastic.world import World
from ..launch import rendezvous
from ..store.job import lost_world
from ..store.kvstore import MPIKVStore
from ._state import _lock, _require_init, _state
from .environment import HONOURED, apply_log_level, environment_options
from .process_sets import ProcessSet, add_process_set, close_all, end_sets, global_process_set

log = logging.getLogger(__name__)

NDArray = Any   # MXNet ships no type hints

# Horovod's reduction ops, with Horovod's numbers (horovod.common.basics).
Average = 0
"""The reduction op: the mean over the processes (the default ``op``)."""
Sum = 1
"""The reduction op: the sum over the processes."""
Adasum = 2
"""Horovod's Adasum op: not implemented here (a NotImplementedError names the ops that are)."""
Min = 3
"""The reduction op: the element-wise minimum over the processes (synchronous)."""
Max = 4
"""The reduction op: the element-wise maximum over the processes (synchronous)."""
Product = 5
"""The reduction op: the element-wise product over the processes (synchronous)."""
_OP_NAMES = {Average: 'Average', Sum: 'Sum', Adasum: 'Adasum', Min: 'Min', Max: 'Max',
             Product: 'Product'}
_MPI_OPS = {Min: 'MIN', Max: 'MAX', Product: 'PROD'}

_named_once: list[bool] = []   # the ignored HOROVOD_* variables are named once a process, not once an init
# (world, whether to re-form it) that a failed init formed, for the next init (_undo)
_left_world: list[tuple[Any, bool]] = []


# -- init ----------------------------------------------------------------------------------
def init(comm: MPI.Comm | Iterable[int] | None = None,
         process_sets: Iterable[ProcessSet | Iterable[int]] | str | None = None,
         **options: Any) -> None:
    """Start: a store on ``comm`` (default COMM_WORLD; an mpi4py communicator, or a list of
    COMM_WORLD ranks), and one for each of ``process_sets``. Collective on COMM_WORLD (or on
    ``comm``). Store options (mpi_kvstore.config) may be given as keywords; the HOROVOD_*
    variables the store has a meaning for are honoured (docs/coming-from-horovod.md), and the
    others named once in a log line. A second call while initialized does nothing. An init
    that raises leaves hvd as it found it (not initialized; what it made is closed), and a
    later init may start again."""
    if isinstance(process_sets, str):
        if process_sets.lower() != 'dynamic':
            raise ValueError("hvd.init: process_sets is a list of ProcessSets or 'dynamic', "
                             'not %r' % (process_sets,))
        process_sets = ()   # add_process_set works without it here
    with _lock:
        if _state.get('store') is not None:
            return
        made = None   # the communicator init splits from a list of ranks, freed on a failure
        world = None
        try:
            if comm is None:
                world = _elastic_world()
                comm = MPI.COMM_WORLD if world is None else world.comm
            elif not isinstance(comm, MPI.Comm):
                made = comm = _split(comm)
            _start(comm, world, options)
        except BaseException as err:
            _undo(world, made, err)
            raise
    try:
        for process_set in process_sets or ():
            add_process_set(process_set)
    except BaseException as err:
        with _lock:
            _undo(world, made, err)
        raise


def _split(ranks: Iterable[int]) -> MPI.Comm:
    """init's communicator of the COMM_WORLD ranks ``ranks`` (not an elastic world)."""
    ranks = sorted(int(r) for r in ranks)
    everyone = MPI.COMM_WORLD
    sub = everyone.Split(0 if everyone.Get_rank() in ranks else MPI.UNDEFINED,
                         everyone.Get_rank())
    if sub == MPI.COMM_NULL:
        raise ValueError('hvd.init(comm=%s): COMM_WORLD rank %d is not in it'
                         % (ranks, everyone.Get_rank()))
    return sub


def _start(comm: MPI.Comm, world: Any, options: dict) -> None:
    """init's store on ``comm`` (on ``world``, an elastic one, or None) and its ranks, into
    the state."""
    environ = os.environ
    apply_log_level(environ)
    env_options, ignored = environment_options(environ)
    store_options = dict(env_options, **options)
    store_options['average'] = False   # the store sums; averaging happens here
    kv = MPIKVStore('dist_mpi', comm=comm, world=world, **store_options)
    global_process_set._store, global_process_set._stores = kv, {}
    _state.update(store=kv, options=store_options, world=world, sets={0: global_process_set},
                  next_id=1)
    if kv.timeline is not None and environ.get('HOROVOD_TIMELINE', '').upper() == 'DYNAMIC':
        kv.timeline.record_into(None)   # nothing is kept until start_timeline
    # After the store, as reform_world (a newcomer's init meets the others' reset). On an
    # elastic world bounded by the world's timeout, as the store's first build: its ranks
    # may come to init apart.
    _identify(comm, None if world is None else world.waiter('the ranks on each host',
                                                             world.timeout))
    if _state['rank'] == 0:
        honoured = sorted(var for var in HONOURED if var in environ)
        if honoured:
            log.info('mpi_kvstore.horovod: honouring %s as store options %s',
                     ', '.join(honoured), env_options)
        if ignored and not _named_once:
            _named_once.append(True)
            log.warning('mpi_kvstore.horovod: these Horovod variables have no meaning '
                        'here and are ignored: %s (docs/coming-from-horovod.md)',
                        ', '.join(ignored))


def _undo(world: Any, made: Any, err: BaseException) -> None:
    """After a failed init: close every store it made, free the communicator it split, and
    leave the state as before the call. An elastic world it formed is kept for the next
    init (forming a first world again would meet nobody): re-formed there when the failure
    was the world's (HorovodInternalError: a worker lost, or a wait past its deadline, may
    have left requests pending on its communicator), reused as it is otherwise."""
    sets = [global_process_set, *(p for i, p in _state.get('sets', {}).items() if i != 0)]
    _state.clear()
    close_all(sets, ' after a failed init')   # the error init raises says more
    if made is not None:
        made.Free()
    if world is not None and world.comm is not None:
        _left_world[:] = [(world, isinstance(err, HorovodInternalError))]
        log.warning('mpi_kvstore.horovod: init failed (%s); the next init %s', err,
                    're-forms its world' if _left_world[0][1] else 'goes on with its world')


def _identify(comm: MPI.Comm, wait: Any = None) -> None:
    """This process's ranks and sizes in ``comm`` (global, local and cross), into the state.
    ``wait``: an elastic world's World.waiter. There they come from one allgather of the
    hosts whose waits end when a worker is lost or at the deadline: node_comm's Split_type
    and Split are blocking MPI calls, which a peer lost there leaves waiting forever."""
    me, count = comm.Get_rank(), comm.Get_size()
    if wait is None:
        found = launcher_local_rank() if comm == MPI.COMM_WORLD else None
        if found is None:
            node = topology.node_comm(comm)
            found = (node.Get_rank(), node.Get_size())
            node.Free()
        cross = comm.Split(found[0], me)
        crossed = (cross.Get_rank(), cross.Get_size())
        cross.Free()
    else:
        placed = topology.places(comm, wait)
        found, crossed = placed[:2], placed[2:]
    _state.update(comm=comm, rank=me, size=count, local=found, cross=crossed)
    global_process_set.ranks = list(range(count))


def _elastic_world() -> Any:
    """The world of ``python -m mpi_kvstore run --elastic``, formed (None outside it): the
    one a failed init left (_undo), re-formed if it must be, or a first one."""
    if not os.environ.get(rendezvous.DIR_ENV):
        return None
    if _left_world:
        world, reform = _left_world.pop()
        if reform:
            try:
                world.reform(wait_for_loss=bool(world.lost_ids))
            except HorovodInternalError:   # lost again: the init after this one tries anew
                _left_world.append((world, True))
                raise
            world.settled()   # no store to reset: the failed init closed its own
        return world
    world = World.from_environment()
    world.form()
    return world


def elastic_world() -> Any:
    """init's elastic world (mpi_kvstore.elastic.world.World), or None on a fixed MPI world."""
    _require_init()
    return _state.get('world')


def reform_world() -> None:
    """Re-form init's elastic world from its survivors (after a lost worker) or with every
    worker (after a host update), and run every store of the global set on it: hvd.rank(),
    hvd.size() and the stores' ranks follow the new world. The other process sets end:
    their ranks meant the old world. Every process of the new world calls it at once."""
    _require_init()
    world = _state['world']
    kv = _state['store']
    lost = bool(world.lost_ids) or lost_world() is not None
    world.reform(wait_for_loss=lost)
    end_sets()
    kv.reset(world.comm, lost)
    for other in global_process_set._stores.values():
        if other is not kv:
            other.reset(world.comm, lost)
    _identify(world.comm, world.waiter('the ranks on each host'))   # the re-forming's deadline


def world_bcast_object() -> Any:
    """The elastic world's broadcast of a Python object (polled, ended by a lost worker with
    HorovodInternalError), or None on a fixed MPI world."""
    world = _state.get('world')
    return None if world is None else world.bcast_object


def shutdown() -> None:
    """Finish every collective and close the stores; init() may start again."""
    with _lock:
        if _state.get('store') is None:
            return
        sets = list(_state['sets'].values())
        _state.clear()
    close_all(sets)


def is_initialized() -> bool:
    """Whether :func:`init` has run (and :func:`shutdown` not since)."""
    return _state.get('store') is not None


def store() -> MPIKVStore:
    """The store under :func:`init` (an MPIKVStore), for the rest of mpi_kvstore's API."""
    _require_init()
    return _state['store']


def rank() -> int:
    """This process's rank in :func:`init`'s communicator."""
    _require_init()
    return _state['rank']


def size() -> int:
    """The number of processes in :func:`init`'s communicator."""
    _require_init()
    return _state['size']


def local_rank() -> int:
    """This process's index among the processes of its node: pick a GPU with it."""
    _require_init()
    return _state['local'][0]


def local_size() -> int:
    """The number of processes on this process's node."""
    _require_init()
    return _state['local'][1]


def cross_rank() -> int:
    """This process's rank among the processes of the same local rank (one a node)."""
    _require_init()
    return _state['cross'][0]


def cross_size() -> int:
    """The number of processes of this process's local rank: the number of nodes."""
    _require_init()
    return _state['cross'][1]


# -- what this build has ----------------------------------------------------------------------
def mpi_built() -> bool:
    """True: every collective here runs on MPI."""
    return True


def mpi_enabled() -> bool:
    """True: every collective here runs on MPI."""
    return True


def mpi_threads_supported() -> bool:
    """Whether MPI was started with MPI_THREAD_MULTIPLE."""
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def gloo_built() -> bool:
    """False: there is no Gloo here."""
    return False


def gloo_enabled() -> bool:
    """False: there is no Gloo here."""
    return False


def nccl_built() -> int:
    """0, as Horovod answers without NCCL: the store's NCCL transport (docs/gpu.md) runs on
    CuPy, not in an MXNet build of Horovod's kind."""
    return 0


def ddl_built() -> bool:
    """False: there is no IBM DDL here."""
    return False


def ccl_built() -> bool:
    """False: there is no oneCCL here."""
    return False


def cuda_built() -> bool:
    """Whether this MXNet was built with CUDA (the store then exchanges GPU arrays)."""
    return bool(mx.runtime.Features().is_enabled('CUDA'))


def rocm_built() -> bool:
    """False: there is no ROCm here."""
    return False


# -- timeline ---------------------------------------------------------------------------------
def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Record the collectives from now on into ``file_path`` (one file a rank: ``.rankN``
    before the extension). As in Horovod, the timeline must be enabled at init:
    HOROVOD_TIMELINE=DYNAMIC, a path, or the store's timeline option."""
    _require_init()
    timeline = _state['store'].timeline
    if timeline is None:
        raise ValueError('Set HOROVOD_TIMELINE=DYNAMIC to enable dynamic timeline usage.')
    timeline.record_into(trace_path(file_path, _state['rank'], _state['size']))


def stop_timeline() -> None:
    """Write the timeline recorded since start_timeline and stop filling that file."""
    _require_init()
    timeline = _state['store'].timeline
    if timeline is None:
        return
    timeline.write()
    timeline.record_into(None)

