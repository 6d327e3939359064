"""What an elastic world (world.py) reads of its launcher's notices, and what it tells its
stores from them.

The launcher writes signed files in the job's rendezvous directory (launch/rendezvous.py):
``lost-<id>`` for a worker that died, the notice of the world's members when host discovery
adds or removes workers, and ``gaveup-<generation>-<id>`` for a worker that gave up on a
forming (forming.give_up). :class:`Notices` reads them at most every ``NOTICE_EVERY`` s:
the lost workers end the world's waits (:meth:`Notices.check`, which the stores' threads
call too), and on rank 0 a new notice goes to the listeners (the state's next commit then
raises HostsUpdatedInterrupt on every rank).

After a re-forming, the stores on the world reset on the new communicator; until every one
of them has (:meth:`Notices.settled`), :meth:`Notices.check` also ends their waits once the
re-forming's deadline passes, so that a worker lost during the reset ends it too.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..launch import rendezvous
from ..store import job as store_job
from . import forming
from .exceptions import HorovodInternalError

__all__ = ['NOTICE_EVERY', 'Notices']

NOTICE_EVERY = 0.01    # seconds between looks for the launcher's notices


class Notices:
    """The launcher's notices, as World reads them. World provides what is declared here
    (and ``rank``); :meth:`_init_notices` sets the rest."""

    directory: str
    secret: str
    id: int
    ids: list[int]
    comm: Any
    generation: int
    joining: bool
    hosts_seen: int
    deadline: float
    _forming: set[int] | None

    def _init_notices(self) -> None:
        self.lost_ids: set[int] = set()
        self.listeners: list[Callable[[float, bool], Any]] = []
        self._reported = 0    # the newest notice handed to the listeners
        self._refused: set[str] = set()
        self._next_look = 0.0
        self._gave_up: set[int] = set()   # the workers that gave up on the forming under way
        self._settle_by: float | None = None    # the stores' reset must be done by then
        self._unsettled: dict = {}   # the stores' jobs not reset yet -> their old design

    def _look(self, force=False):
        """Read the launcher's notices (at most every NOTICE_EVERY s unless ``force``): the
        lost workers, and on rank 0 new members, which the listeners hear of."""
        now = time.monotonic()
        if not force and now < self._next_look:
            return
        self._next_look = now + NOTICE_EVERY
        self._gave_up = set() if self._forming is None or self.joining else set(
            forming.given_up(self.directory, self.secret, self.generation, self._refused)
        ) - {self.id}
        for worker in set(self.ids) | (self._forming or set()):
            if worker not in self.lost_ids and worker != self.id \
                    and self._announced_lost(worker):
                self.lost_ids.add(worker)
        if self.listeners and self.comm is not None and self.rank == 0:
            notice = rendezvous.read_hosts(self.directory, self.secret, self._refused)
            if notice is not None and notice['number'] > max(self.hosts_seen, self._reported):
                self._reported = notice['number']
                removed_only = set(notice['members']) <= set(self.ids)
                for listener in self.listeners:
                    listener(time.time(), removed_only)

    def _announced_lost(self, worker):
        return rendezvous.is_lost(self.directory, self.secret, worker, self._refused)

    def check(self, what: str = 'collective') -> None:
        """Raise HorovodInternalError if the launcher announced a lost worker (any thread
        may call it: the store's threads do, while their collectives wait)."""
        self._look()
        if self.lost_ids:
            raise HorovodInternalError('%s: worker(s) %s lost (the launcher says so)'
                                       % (what, sorted(self.lost_ids)))
        settle_by = self._settle_by
        if settle_by is not None and time.monotonic() > settle_by:
            raise HorovodInternalError('%s: the world re-formed %g s ago and its stores have '
                                       'not reset yet' % (what, self.deadline))

    def _bound_resets(self):
        """Bound the stores' reset (their waits' check) until the last one reset (settled)."""
        self._unsettled = {job: job.design for job in store_job.jobs_on(self)}
        self._settle_by = time.monotonic() + self.deadline

    def settled(self) -> None:
        """A store reset on the new world (its job calls it, hvd's reset once every store
        did): once every store on the world when it re-formed has reset (a new design) or
        closed, :meth:`check` no longer ends their waits at the re-forming's deadline."""
        if all(job.closed or job.design is not design
               for job, design in list(self._unsettled.items())):
            self._unsettled = {}
            self._settle_by = None
