"""A world of separately launched workers that loses and gains members in memory.

Each worker is its own ``mpiexec -n 1`` launch, so the death of one does not end the others.
They meet through an MPI port (``Open_port`` / ``Accept`` / ``Connect``, then ``Merge``): the
root opens it and publishes it in the job's rendezvous directory, signed with the job's
secret (launch/rendezvous.py); a process that connects must answer a challenge with that
secret before it is merged, so a stranger is refused, logged, and the world goes on forming.

A SIGKILLed peer leaves the survivors' collectives waiting with no error from MPI. So every
collective here is nonblocking, and its wait ends with :class:`HorovodInternalError` when the
launcher announces a lost worker (a signed ``lost-<id>`` file) or when ``deadline`` seconds
pass. :meth:`World.reform` then re-forms the world from the survivors: the oldest (the lowest
rank of the old world) becomes rank 0, the others keep their order.

The launcher's host discovery adds and removes workers: it starts a newcomer, which says it
is ready and waits to be admitted, then writes a signed notice of the world's members. Rank 0
hands it to the listeners (the state), so the next commit raises HostsUpdatedInterrupt on
every rank; :meth:`World.reform` then admits the newcomers after the old members, and a
worker left out leaves. A worker that dies while the root waits for it in ``Accept`` cannot
be waited out (the accept has no deadline: forming.py): the launcher connects a stand-in in
its place (standin.py), signed with the secret, and the world forms without it.

Every step of a forming ends (forming.py): at ``deadline``, or when the launcher announces a
member of the forming world lost, with HorovodInternalError, so that ``elastic.run`` re-forms
again without it; a worker that gives up on a forming says so (forming.give_up), and the
others in it give up too. A re-forming given up on leaves the launcher's notice to the next
one, which admits its newcomers again. The launcher's notices are read in notices.py, which
also bounds the stores' reset after :meth:`World.reform` (``check``, ``settled``).
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..comm import abandoned
from ..comm.mpiabi import MPI
from ..launch import rendezvous
from . import forming, leave
from .exceptions import HorovodInternalError
from .forming import ADMIT, REFUSED
from .notices import NOTICE_EVERY, Notices

__all__ = ['World', 'HostMemo']

log = logging.getLogger(__name__)

CONNECT_MARGIN = 5.0   # s past MPI's connect timeout before a joining worker gives up on it


class World(Notices):
    """This worker's view of the elastic world: ``comm`` (an intracommunicator), ``rank``,
    ``size`` and ``ids`` (the workers' ids by rank). Build it with :meth:`from_environment`
    (the launcher's variables), then :meth:`form`.

    ``listeners``: functions ``f(timestamp, removed_only)`` called on rank 0 when the
    launcher announces new members (``state.on_hosts_updated``: the state's next commit then
    raises HostsUpdatedInterrupt on every rank)."""

    def __init__(self, directory: str, secret: str, worker: int, expected: int,
                 deadline: float = 30.0, timeout: float = 120.0, joining: bool = False,
                 min_np: int = 1) -> None:
        self.directory, self.secret, self.id = directory, secret, int(worker)
        self.expected, self.deadline, self.timeout = int(expected), deadline, timeout
        self.joining, self.min_np = bool(joining), max(1, int(min_np))
        self.generation = -1 if self.joining else 0
        self.comm: Any = None
        self.ids: list[int] = []
        self.hosts_seen = 0   # the number of the launcher's notice this world formed on
        self._forming: set[int] | None = None   # the members of the world being formed
        self._hosts = HostMemo(self)
        self._init_notices()

    @classmethod
    def from_environment(cls, **kwargs: Any) -> World:
        """The world the launcher described in this worker's environment."""
        env = os.environ
        missing = [name for name in (rendezvous.DIR_ENV, rendezvous.SECRET_ENV,
                                     rendezvous.ID_ENV, rendezvous.NP_ENV) if not env.get(name)]
        if missing:
            raise RuntimeError('mpi_kvstore elastic: not started by an elastic launcher (%s '
                               'unset)' % ', '.join(missing))
        kwargs.setdefault('joining', env.get(rendezvous.JOIN_ENV) == '1')
        kwargs.setdefault('min_np', int(env.get(rendezvous.MIN_NP_ENV) or 1))
        if env.get(rendezvous.TIMEOUT_ENV):   # the launcher's wait, and a margin for its end
            kwargs.setdefault('timeout', float(env[rendezvous.TIMEOUT_ENV]) + 30.0)
        return cls(env[rendezvous.DIR_ENV], env[rendezvous.SECRET_ENV],
                   int(env[rendezvous.ID_ENV]), int(env[rendezvous.NP_ENV]), **kwargs)

    @property
    def rank(self) -> int:
        """This worker's rank in the current world."""
        return self.comm.Get_rank()

    @property
    def size(self) -> int:
        """The number of workers in the current world."""
        return self.comm.Get_size()

    # -- forming ---------------------------------------------------------------------------
    def form(self) -> None:
        """Form the first world (worker 0 accepts workers 1, 2, ... one at a time), or, for a
        worker the launcher started later, join the running world when it re-forms."""
        if self.joining:
            rendezvous.write_signed(rendezvous.ready_path(self.directory, self.id),
                                    self.secret, {'ready': self.id})
            while True:   # a forming given up on: wait for the root's next one
                try:
                    self._form(None)
                    break
                except HorovodInternalError as err:
                    log.warning('mpi_kvstore elastic: worker %d was not admitted (%s); '
                                'waiting for the next forming', self.id, err)
                    self.joining = True
        else:
            self._form(list(range(self.expected)))
        self._wait_for_min_np()

    def reform(self, wait_for_loss: bool = True) -> None:
        """Re-form the world. After a lost worker (announced by the launcher): from the
        survivors, the oldest as rank 0. Otherwise from the members of the launcher's newest
        notice, as rank 0 read it: the old members in their order, then the newcomers; a
        worker left out leaves the job (SystemExit(0)). ``wait_for_loss``: whether a world
        that cannot agree waits for the launcher to name the lost worker (False: re-form at
        once with the workers not announced lost)."""
        ends = time.monotonic() + self.timeout
        self._look(force=True)
        notice, seen = None, self.hosts_seen
        if not self.lost_ids:
            try:
                notice = self._bcast(rendezvous.read_hosts(self.directory, self.secret,
                                                           self._refused)
                                     if self.rank == 0 else None, self.deadline)
            except HorovodInternalError:
                self._await_loss(ends, wait_for_loss)
        if self.lost_ids:
            order = [worker for worker in self.ids if worker not in self.lost_ids]
            if self.id not in order:
                raise RuntimeError('mpi_kvstore elastic: this worker was announced lost')
            why = 'the loss of worker(s) %s' % sorted(self.lost_ids)
            leave.without_finalize()   # MPI_Finalize could crash on the lost peer's endpoints
            abandoned.keep(self.comm)   # never freed, not even by mpi4py's garbage collection
        else:
            # the notice counts as seen once a world formed on it: a forming given up on
            # leaves it to the next reform, which admits its newcomers again
            order, why = list(self.ids), 'a reset'
            if notice is not None and notice['number'] > self.hosts_seen:
                seen = notice['number']
                order = self._order(notice['members'])
                why = "the launcher's notice %d" % notice['number']
            if self.id not in order:
                log.info('mpi_kvstore elastic: worker %d left out by the host discovery '
                         '(notice %d): leaving the job', self.id, seen)
                raise SystemExit(0)
        self.generation += 1
        log.info('mpi_kvstore elastic: re-forming the world after %s: %d worker(s) of %d '
                 '(generation %d)', why, len(order), len(self.ids), self.generation)
        # the old communicator is abandoned, not freed: a collective with the lost peer may
        # still be pending on it, and freeing it could wait for that peer
        self._settle_by, self._unsettled = None, {}
        self._form(order, seen)
        self._wait_for_min_np()
        self._bound_resets()
        self._reached('formed')

    def _order(self, members):
        """The old members among ``members`` in their order, then the newcomers."""
        return ([worker for worker in self.ids if worker in members]
                + sorted(worker for worker in members if worker not in self.ids))

    def _await_loss(self, ends, wait):
        while wait and not self.lost_ids:   # which worker is gone, the launcher says
            if time.monotonic() > ends:
                raise RuntimeError('mpi_kvstore elastic: a collective stalled, and the '
                                   'launcher announced no lost worker in %g s' % self.timeout)
            time.sleep(NOTICE_EVERY)
            self._look(force=True)

    def _wait_for_min_np(self):
        """Below the launcher's --min-np, wait for a notice that brings workers in."""
        ends = time.monotonic() + self.timeout
        while self.size < self.min_np:
            log.warning('mpi_kvstore elastic: %d worker(s), fewer than --min-np %d: waiting '
                        'for the launcher to add workers', self.size, self.min_np)
            notice = None
            if self.rank == 0:
                while notice is None and time.monotonic() < ends:
                    found = rendezvous.read_hosts(self.directory, self.secret, self._refused)
                    if found is not None and found['number'] > self.hosts_seen:
                        notice = found
                    else:
                        time.sleep(NOTICE_EVERY)
            notice = self._bcast(notice, max(ends - time.monotonic(), 0.0) + self.deadline)
            if notice is None:
                raise RuntimeError('mpi_kvstore elastic: %d worker(s), fewer than --min-np %d, '
                                   'and none came in %g s' % (self.size, self.min_np,
                                                              self.timeout))
            order = self._order(notice['members'])
            if self.id not in order:
                raise SystemExit(0)
            self.generation += 1
            self._form(order, notice['number'])

    def _form(self, order, seen=None):
        """The world of the workers ``order`` in that rank order, on the launcher's notice
        ``seen`` (default: the current world's): its first (the root) accepts the others one
        at a time (two processes connecting to one port at once crashed MPICH's accept).
        ``order`` None: this worker connects when the root admits it. A worker announced
        lost, or one the launcher's stand-in answers for, is left out. Every step is bounded
        (the module's docstring); one given up on raises HorovodInternalError, and tells the
        others in the forming (forming.give_up)."""
        started = time.monotonic()
        is_root = order is not None and order[0] == self.id
        pending = list(order[1:]) if is_root else []
        members = [self.id] if is_root else None   # the root's list of the merged workers
        # the workers whose loss ends this forming: those merged so far (the root for one
        # that waits to be admitted; a worker being admitted is not: a stand-in answers for it)
        self._forming = {order[0]} if order is not None else None
        self._gave_up = set()
        world = None
        try:
            if is_root:
                world = MPI.COMM_SELF.Dup()
                port = forming.open_port()   # never closed (its docstring says why)
            else:
                port = self._published_port(started)
                log.debug('mpi_kvstore elastic: connects (generation %d)', self.generation)
                world = forming.call(lambda: forming.connect(port, self.id, self.secret,
                                                             self.deadline),
                                     'joining the world',
                                     # MPI's connect ends first (its own timeout): a connect
                                     # given up on while still in MPI would hold MPICH's lock
                                     # and block this process's next connect
                                     self._why('joining the world',
                                               self.deadline + CONNECT_MARGIN),
                                     stale=lambda: forming.newer_port(
                                         self.directory, self.secret, self.generation,
                                         self._refused), every=NOTICE_EVERY)
            self._reached('joined')
            while True:   # the root says who comes next, or that the world is whole
                admit, merged = forming.bcast(
                    world, (self._next(pending), members) if is_root else None,
                    self._why('the admission', self.deadline))
                self._forming = set(merged)
                if admit is None:
                    break
                world, verdict = self._admit(world, port, admit, is_root)
                if is_root and verdict != REFUSED:
                    pending.pop(0)
                if is_root and verdict == ADMIT:
                    members.append(admit)
            self._reached('admitted')
            # Split(0, rank) keeps the order: a duplicate, which MPI has in nonblocking form
            comm, request = world.Idup()
            forming.wait(request, self._why('the new communicator', self.deadline), keep=(comm,))
            self._reached('duplicated')
            seen = self.hosts_seen if seen is None else seen
            generation, seen = forming.bcast(comm, (self.generation, seen),
                                             self._why('the generation', self.deadline))
            ids = forming.allgather_ints(comm, self.id, self._why('the ids', self.deadline))
        except BaseException as err:
            abandoned.keep(world)   # a collective given up on may still be pending on it
            if isinstance(err, HorovodInternalError) and not self.joining:
                forming.give_up(self.directory, self.secret, self.generation, self.id, err)
            raise
        finally:
            self._forming = None
        self.comm, self.generation, self.hosts_seen, self.ids = comm, generation, seen, ids
        self.lost_ids = set()
        self._reported = self.hosts_seen
        if is_root:
            rendezvous.write_signed(rendezvous.formed_path(self.directory), self.secret, {
                'generation': self.generation, 'ids': ','.join(map(str, self.ids)),
                'time': '%.6f' % time.time()})
        log.info('mpi_kvstore elastic: world %d formed: %d worker(s) %s in %.3f s',
                 self.generation, len(self.ids), self.ids, time.monotonic() - started)

    def _admit(self, world, port, admit, is_root):
        """Every member's side of admitting worker ``admit``: (the world with it merged
        in, or the same world; the root's verdict)."""
        if is_root:
            fields = {'port': port, 'root': self.id, 'generation': self.generation,
                      'admit': admit}
            rendezvous.write_signed(rendezvous.port_path(self.directory, self.generation),
                                    self.secret, fields)
            rendezvous.write_signed(rendezvous.current_port_path(self.directory),
                                    self.secret, fields)
        # the newcomer takes its time to start (the launcher's stand-in answers for one
        # that died first): the job's timeout, and the members' losses
        what = 'accepting worker %d' % admit
        log.debug('mpi_kvstore elastic: accepts worker %d (generation %d)', admit,
                  self.generation)
        inter, verdict = forming.call(lambda: forming.accept(world, port, admit, self.secret),
                                      what, self._why(what, self.timeout))
        log.debug('mpi_kvstore elastic: accepted a connection for worker %d', admit)
        verdict = forming.bcast(world, verdict, self._why('the verdict', self.deadline))
        if verdict != ADMIT:
            inter.Free()
            return world, verdict
        self._forming.add(admit)
        what = 'merging worker %d' % admit
        merged = forming.call(lambda: inter.Merge(high=False), what,
                              self._why(what, self.deadline), keep=(inter,))
        abandoned.keep(world)   # the old one stays MPI's: a member lost later may hold it
        return merged, verdict

    def bounded(self, call: Callable[[], Any], what: str, deadline: float | None = None,
                keep: tuple = ()) -> Any:
        """``call()``, a blocking MPI call on the world (hvd's Create_group of a process
        set, which MPI has in blocking form only), in a thread of its own: HorovodInternalError
        once ``deadline`` seconds (default the world's) pass or the launcher announces a
        worker lost, the thread and ``keep`` kept (forming.call)."""
        return forming.call(call, what, self._why(what, self.deadline if deadline is None
                                                  else deadline), keep=keep)

    def waiter(self, what: str, deadline: float | None = None) -> Callable[..., None]:
        """A wait ``wait(request, keep=())`` for the nonblocking requests of ``what`` on the
        world outside its forming (a store's build: its agreed options and host count):
        HorovodInternalError once the launcher announces a worker lost or ``deadline``
        seconds (default the world's) pass from this call, ``request`` and ``keep`` kept.
        It carries the world's ``memo`` of the hosts (topology.host_facts)."""
        failed = self._why(what, self.deadline if deadline is None else deadline)

        def wait(request: Any, keep: tuple = ()) -> None:
            forming.wait(request, failed, keep)
        wait.memo = self._hosts   # type: ignore[attr-defined]
        return wait

    def allgather_ints(self, value: int, what: str, deadline: float | None = None) -> list:
        """Every worker's int ``value`` in rank order, waited as :meth:`waiter` waits."""
        return forming.allgather_ints(self.comm, value, self._why(
            what, self.deadline if deadline is None else deadline))

    def _reached(self, step: str) -> None:
        """A step of the forming reached ('joined', 'admitted', 'duplicated'; 'formed': the end
        of a re-forming, before the stores' reset): a hook for tests that make a worker die
        there."""

    def _why(self, what, deadline):
        """For forming.py: a function that says why a wait for ``what`` must end (a member
        of the forming world lost, or ``deadline`` seconds past), or None. Reads the
        launcher's notices first: a wait that completes at once must not skip them (rank 0
        hands new members to the listeners there)."""
        ends = time.monotonic() + deadline
        self._look()

        def failed():
            self._look()
            why = self._ended()
            if why or time.monotonic() > ends:
                return '%s: %s' % (what, why or 'no answer in %g s' % deadline)
            return None
        return failed

    def _ended(self):
        """Why the forming under way ends (a member lost, or one that gave up), or None."""
        lost = self.lost_ids if self._forming is None else self.lost_ids & self._forming
        if lost:
            return 'worker(s) %s lost (the launcher says so)' % sorted(lost)
        if self._gave_up:
            return 'worker(s) %s gave up on this forming' % sorted(self._gave_up)
        return None

    def _next(self, pending):
        """The root's next worker to admit: the first of ``pending`` not announced lost."""
        while pending and self._announced_lost(pending[0]):
            log.warning('mpi_kvstore elastic: worker %d was lost before it joined; the world '
                        'forms without it', pending.pop(0))
        return pending[0] if pending else None

    def _published_port(self, started):
        """The port the root published for this worker; HorovodInternalError if the
        launcher announces the root lost meanwhile. A port of a later generation serves
        too: the root formed the world again after a member it had merged was lost."""
        path = rendezvous.current_port_path(self.directory)
        while True:
            self._look()
            if self._ended():
                raise HorovodInternalError('waiting for the port: %s' % self._ended())
            found = rendezvous.read_signed(path, self.secret, self._refused)
            if found and found.get('admit') == self.id and (
                    found.get('generation') > self.generation if self.joining
                    else found.get('generation') >= self.generation):
                self.generation = found['generation']
                self.joining = False
                return found['port']
            if time.monotonic() - started > self.timeout:
                raise RuntimeError('mpi_kvstore elastic: worker %d was not admitted to the '
                                   'world in %g s' % (self.id, self.timeout))
            time.sleep(0.002)

    def _wait(self, request, what, keep=()):
        """Poll ``request`` until it completes; HorovodInternalError (``request`` and
        ``keep`` kept: MPI may still write into them) when a worker is lost or ``deadline``
        seconds pass."""
        forming.wait(request, self._why(what, self.deadline), keep)

    def _bcast(self, obj, deadline):
        saved, self.deadline = self.deadline, deadline
        try:
            return self.bcast_object(obj)
        finally:
            self.deadline = saved

    # -- collectives -------------------------------------------------------------------------
    def allreduce(self, array: np.ndarray) -> np.ndarray:
        """The element-wise sum of every worker's ``array`` (HorovodInternalError when a
        worker is lost)."""
        array = np.ascontiguousarray(array)
        out = np.empty_like(array)
        self._wait(self.comm.Iallreduce(array, out, op=MPI.SUM), 'allreduce', keep=(array, out))
        return out

    def bcast_object(self, obj: Any) -> Any:
        """Rank 0's picklable ``obj`` on every worker (HorovodInternalError when a worker is
        lost)."""
        return forming.bcast(self.comm, obj, self._why('bcast', self.deadline))


class HostMemo:
    """The hosts and cores of the world's communicator of the moment, which
    topology.host_facts gathers once for it (World.waiter hands this over): a store's build
    counts the hosts from them and hvd's identification places its ranks by them, so an
    init or a reset gathers them once, not once a store and again for hvd. Kept for the
    world's communicator only: it is never freed (a re-forming abandons it), so its handle
    never names another communicator later, as a freed process set's could."""

    def __init__(self, world: World) -> None:
        self._world = world
        self._kept: tuple[Any, Any] | None = None   # (the communicator, its facts)

    def get(self, comm: Any) -> Any:
        """The facts gathered on ``comm``, if it is the world's communicator, else None."""
        kept = self._kept
        if kept is None or not self._current(comm) or comm != kept[0]:
            return None
        return kept[1]

    def put(self, comm: Any, facts: Any) -> None:
        """Keep ``facts``, gathered on ``comm``, if it is the world's communicator."""
        if self._current(comm):
            self._kept = (comm, facts)

    def _current(self, comm):
        world = self._world.comm
        return world is not None and comm == world
