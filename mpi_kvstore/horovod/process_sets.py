"""Horovod's process sets on the store: a set is a store on a sub-communicator of init's,
registered under a number (0: the global set) in init's state (_state.py), which basics.py's
init, shutdown and reform_world start and end."""
from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import numpy as np

from ..comm import abandoned
from ..comm.mpiabi import MPI
from ..store.kvstore import MPIKVStore
from ._state import _lock, _require_init, _state

log = logging.getLogger(__name__)


def _rank() -> int:
    """hvd.rank(), which is basics.py's: basics imports this module, not the other way."""
    _require_init()
    return _state['rank']


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
        return self.ranks.index(_rank())

    def included(self) -> bool | None:
        """Whether this process belongs to the set (None before its ranks are known)."""
        if self.ranks is None:
            return None
        return _rank() in self.ranks

    def __str__(self) -> str:
        return 'ProcessSet(process_set_id=%s, ranks=%s, mpi_comm=%s)' % (
            self.process_set_id, self.ranks, self.mpi_comm)

    __repr__ = __str__


global_process_set = ProcessSet([])
"""The process set of every process of :func:`init`'s communicator (the collectives' default)."""
global_process_set.process_set_id = 0


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
            process_set._store = MPIKVStore('dist_mpi', comm=sub, **store_options())
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
    close(process_set)
    return True


def store_options() -> dict[str, Any]:
    """The options of init's store (the environment's and init's keywords) for another store
    on these processes: without the timeline, which init's store alone writes, and on init's
    elastic world if there is one."""
    return dict(_state['options'], timeline='', world=_state.get('world'))


def close(process_set: ProcessSet, quiet: str | None = None) -> None:
    """Close ``process_set``'s stores and take its number back (the global set keeps its 0).
    ``quiet``: where a store fails to close, log it with these words and go on (the error
    being answered says more); None: raise."""
    for kv in [process_set._store, *process_set._stores.values()]:
        if kv is None:
            continue
        if quiet is None:
            kv.close()
            continue
        try:
            kv.close()
        except Exception as err:
            log.info('mpi_kvstore.horovod: closing %r%s: %s', kv, quiet, err)
    process_set._store, process_set._stores = None, {}
    if process_set is not global_process_set:
        process_set.process_set_id = None


def close_all(sets: Iterable[ProcessSet], quiet: str | None = None) -> None:
    """Close ``sets`` (:func:`close`), the global set among them, whose ranks end too: shutdown
    and a failed init."""
    for process_set in sets:
        close(process_set, quiet)
    global_process_set.ranks = []


def end_sets() -> None:
    """Unregister and close every set but the global one: the world they were made in was
    re-formed (reform_world), and their ranks meant the old one."""
    with _lock:
        dropped = [p for i, p in _state['sets'].items() if i != 0]
        _state['sets'] = {0: global_process_set}
        # numbered from 1 again on every rank, as a newcomer's init numbers them: a set's
        # number is its Create_group's tag (_members_comm), and a set given up on (a lost
        # member) left its members one behind the ranks outside it
        _state['next_id'] = 1
    for process_set in dropped:
        log.warning('mpi_kvstore.horovod: %s ended with the world it was made in', process_set)
        close(process_set, '')   # the loss it raises is the one being answered
