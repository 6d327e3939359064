"""Horovod's basics on the store: init and the process sets, ranks, what this build has,
and the timeline (mpi_kvstore.horovod's docstring says more; environment.py reads the
HOROVOD_* variables)."""
from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable
from typing import Any

import mxnet as mx
import numpy as np

from ..comm import abandoned, topology
from ..comm.mpiabi import MPI
from ..comm.timeline import trace_path
from ..config import launcher_local_rank
from ..elastic.exceptions import HorovodInternalError
from ..elastic.world import World
from ..launch import rendezvous
from ..store.job import lost_world
from ..store.kvstore import MPIKVStore
from .environment import HONOURED, apply_log_level, environment_options

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

_NOT_INITIALIZED = 'Horovod has not been initialized; use hvd.init().'
_lock = threading.RLock()
_state: dict[str, Any] = {}
_named_once: list[bool] = []   # the ignored HOROVOD_* variables are named once a process, not once an init
# (world, whether to re-form it) that a failed init formed, for the next init (_undo)
_left_world: list[tuple[Any, bool]] = []


# -- init and the process sets ---------------------------------------------------------------
class ProcessSet:
    """Horovod's process set: the ranks (of :func:`init`'s communicator) that run a collective
    together. Here it is a store on a sub-communicator, made when :func:`init` or
    :func:`add_process_set` registers it (collective on every process). Build it from a list
    of ranks or from an mpi4py communicator (``MPI.COMM_NULL`` on the processes outside)."""

    process_set_id: int | None = None
    """The set's number (0: the global set), None until it is registered."""
    ranks: list[int] | None = None
    """The set's ranks (of :func:`init`'s communicator), in order."""
    mpi_comm: Any = None
    """The mpi4py communicator the set was built from, if it was."""

    def __init__(self, ranks_or_comm: Iterable[int] | MPI.Comm) -> None:
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
        self._store: MPIKVStore | None = None   # this process's store of the set (None outside)
        self._stores: dict[Any, MPIKVStore] = {}   # DistributedTrainer's stores by compression

    def size(self) -> int | None:
        """The number of processes in the set, or None before it is registered."""
        if self.process_set_id is None or self.ranks is None:
            return None
        return len(self.ranks)

    def rank(self) -> int | None:
        """This process's rank inside the set, None outside it or before registration."""
        if self.process_set_id is None or self.ranks is None or not self.included():
            return None
        return self.ranks.index(rank())

    def included(self) -> bool | None:
        """Whether this process belongs to the set (None before its ranks are known)."""
        if self.ranks is None:
            return None
        return rank() in self.ranks

    def __str__(self) -> str:
        return 'ProcessSet(process_set_id=%s, ranks=%s, mpi_comm=%s)' % (
            self.process_set_id, self.ranks, self.mpi_comm)

    __repr__ = __str__


global_process_set = ProcessSet([])
"""The process set of every process of :func:`init`'s communicator (the collectives' default)."""
global_process_set.process_set_id = 0


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
    for process_set in sets:
        for store in [process_set._store, *process_set._stores.values()]:
            if store is not None:
                try:
                    store.close()
                except Exception as failed:   # the error init raises says more
                    log.info('mpi_kvstore.horovod: closing %r after a failed init: %s',
                             store, failed)
        process_set._store, process_set._stores = None, {}
        if process_set is not global_process_set:
            process_set.process_set_id = None
    global_process_set.ranks = []
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
    with _lock:
        dropped = [p for i, p in _state['sets'].items() if i != 0]
        _state['sets'] = {0: global_process_set}
        # numbered from 1 again on every rank, as a newcomer's init numbers them: a set's
        # number is its Create_group's tag (_members_comm), and a set given up on (a lost
        # member) left its members one behind the ranks outside it
        _state['next_id'] = 1
    for process_set in dropped:
        log.warning('mpi_kvstore.horovod: %s ended with the world it was made in', process_set)
        for store in [process_set._store, *process_set._stores.values()]:
            if store is not None:
                try:
                    store.close()
                except Exception as err:   # the loss it raises is the one being answered
                    log.info('mpi_kvstore.horovod: closing %r: %s', store, err)
        process_set._store, process_set._stores = None, {}
        process_set.process_set_id = None
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


def _require_init() -> None:
    if _state.get('store') is None:
        raise ValueError(_NOT_INITIALIZED)


def add_process_set(process_set: ProcessSet | Iterable[int]) -> ProcessSet:
    """Register a process set (a ProcessSet or a list of ranks) and return it: a
    sub-communicator and a store on it for its members. Collective on every process, as
    in Horovod; the same ranks twice raise ValueError. On an elastic world every wait of it
    ends with HorovodInternalError once a worker is lost or the world's timeout passes (as
    init's), and only the set's members make its communicator."""
    _require_init()
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    comm, me, world = _state['comm'], _state['rank'], _state.get('world')
    if process_set.ranks is None:   # built from a communicator: learn its members
        inside = process_set.mpi_comm != MPI.COMM_NULL
        if world is None:
            members = comm.allgather(me if inside else None)
        else:
            members = world.allgather_ints(me if inside else -1, "the process set's members",
                                           world.timeout)
        process_set.ranks = [r for r in members if r is not None and r >= 0]
    bad = [r for r in process_set.ranks if not 0 <= r < _state['size']]
    if bad or not process_set.ranks or len(set(process_set.ranks)) != len(process_set.ranks):
        raise ValueError('add_process_set: ranks %s must be distinct ranks in [0, %d)'
                         % (process_set.ranks, _state['size']))
    with _lock:
        for known in _state['sets'].values():
            if known is not process_set and known.ranks == process_set.ranks:
                raise ValueError('add_process_set: a process set of ranks %s exists already: %s'
                                 % (process_set.ranks, known))
        number = _state['next_id']
    if world is None:
        sub = comm.Split(0 if me in process_set.ranks else MPI.UNDEFINED, me)
    else:
        sub = _members_comm(world, comm, process_set.ranks, number)
    if sub != MPI.COMM_NULL:
        try:
            process_set._store = MPIKVStore('dist_mpi', comm=sub, **_store_options())
        except BaseException:
            if world is None:
                sub.Free()
            else:   # the build's requests given up on may still be pending on it
                abandoned.keep(sub)
            raise
        sub.Free()   # the store keeps its own duplicate
    with _lock:
        process_set.process_set_id = number
        _state['next_id'] = number + 1
        _state['sets'][number] = process_set
    return process_set


def _members_comm(world: Any, comm: MPI.Intracomm, ranks: list[int], number: int) -> MPI.Comm:
    """The communicator of the process set ``ranks`` of ``comm`` on an elastic world
    (COMM_NULL outside it). Create_group is collective over the set's members only (a
    Split, over every rank, would wait for a worker outside the set too), and MPI has it in
    blocking form only: it runs in a thread of its own (World.bounded), which a lost worker
    or the world's timeout gives up on, with the group it reads. One so left blocks no later
    communicator (MPICH 5.0.2): survivors that gave up on a set with a lost worker re-form
    their world (tests/test_hvd_elastic_sets.py), and 2 of 3 mpiexec ranks that gave up on
    one their third never joined then made an Idup, a Create_group, a Split and a Dup."""
    if comm.Get_rank() not in ranks:
        return MPI.COMM_NULL
    everyone = comm.Get_group()
    group = everyone.Incl(ranks)
    everyone.Free()
    # the tag tells the set apart from one made at once on the same communicator
    sub = world.bounded(lambda: comm.Create_group(group, tag=number),
                        'the process set %s' % (ranks,), world.timeout, keep=(group,))
    group.Free()
    return sub


def remove_process_set(process_set: ProcessSet) -> bool:
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
    on these processes: without the timeline, which init's store alone writes, and on init's
    elastic world if there is one."""
    return dict(_state['options'], timeline='', world=_state.get('world'))


def shutdown() -> None:
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

