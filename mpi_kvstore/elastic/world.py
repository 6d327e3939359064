"""A world of separately launched workers that loses members and re-forms in memory.

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
"""
from __future__ import annotations

import logging
import os
import pickle
import time
from typing import Any

import numpy as np

from ..comm.mpiabi import MPI
from ..launch import rendezvous
from .exceptions import HorovodInternalError

__all__ = ['World']

log = logging.getLogger(__name__)

POLL = 0.0005          # seconds between Tests of a pending collective
NOTICE_EVERY = 0.01    # seconds between looks for the launcher's notices
HANDSHAKE_TIMEOUT = 10.0


class World:
    """This worker's view of the elastic world: ``comm`` (an intracommunicator), ``rank``,
    ``size`` and ``ids`` (the workers' ids by rank). Build it with :meth:`from_environment`
    (the launcher's variables), then :meth:`form`."""

    def __init__(self, directory: str, secret: str, worker: int, expected: int,
                 deadline: float = 30.0, timeout: float = 120.0) -> None:
        self.directory, self.secret, self.id = directory, secret, int(worker)
        self.expected, self.deadline, self.timeout = int(expected), deadline, timeout
        self.generation = 0
        self.comm: Any = None
        self.ids: list[int] = []
        self.lost_ids: set[int] = set()
        self._refused: set[str] = set()
        self._next_look = 0.0

    @classmethod
    def from_environment(cls, **kwargs: Any) -> World:
        """The world the launcher described in this worker's environment."""
        env = os.environ
        missing = [name for name in (rendezvous.DIR_ENV, rendezvous.SECRET_ENV,
                                     rendezvous.ID_ENV, rendezvous.NP_ENV) if not env.get(name)]
        if missing:
            raise RuntimeError('mpi_kvstore elastic: not started by an elastic launcher (%s '
                               'unset)' % ', '.join(missing))
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
        """Form the first world: worker 0 accepts workers 1, 2, ... one at a time."""
        self._form(list(range(self.expected)), key=self.id)

    def reform(self, wait_for_loss: bool = True) -> None:
        """Re-form the world from the survivors (every worker of the old world whose loss
        the launcher did not announce): the oldest becomes rank 0. ``wait_for_loss=False``
        (a host update, not a loss) re-forms at once with the workers not announced lost."""
        ends = time.monotonic() + self.timeout
        self._look(force=True)
        while wait_for_loss and not self.lost_ids:   # which worker is gone, the launcher says
            if time.monotonic() > ends:
                raise RuntimeError('mpi_kvstore elastic: a collective stalled, and the '
                                   'launcher announced no lost worker in %g s' % self.timeout)
            time.sleep(NOTICE_EVERY)
            self._look(force=True)
        survivors = [worker for worker in self.ids if worker not in self.lost_ids]
        if self.id not in survivors:
            raise RuntimeError('mpi_kvstore elastic: this worker was announced lost')
        self.generation += 1
        log.info('mpi_kvstore elastic: re-forming the world from %d survivor(s) of %d '
                 '(generation %d)', len(survivors), len(self.ids), self.generation)
        # the old communicator is abandoned, not freed: a collective with the lost peer may
        # still be pending on it, and freeing it could wait for that peer
        self._form(survivors, key=survivors.index(self.id))

    def _form(self, order, key):
        """The world of the workers ``order`` (its first accepts the others, in turn: two
        processes connecting to one port at once crashed MPICH's accept), ranked by ``key``."""
        started = time.monotonic()
        root = order[0]
        path = rendezvous.port_path(self.directory, self.generation)
        if self.id == root:
            world = MPI.COMM_SELF.Dup()
            port = MPI.Open_port()
        else:
            port = self._published_port(path, root, started)
            inter = MPI.COMM_SELF.Connect(port, root=0)
            if not self._answer(inter):
                raise RuntimeError('mpi_kvstore elastic: the world refused this worker')
            world = inter.Merge(high=True)
        while world.Get_size() < len(order):
            if self.id == root:   # whose turn it is to connect
                rendezvous.write_signed(path, self.secret, {
                    'port': port, 'root': root, 'generation': self.generation,
                    'admit': order[world.Get_size()]})
            inter = world.Accept(port, root=0)
            admitted = self._challenge(inter) if world.Get_rank() == 0 else None
            admitted = world.bcast(admitted, root=0)
            if admitted:
                world = inter.Merge(high=False)
            else:
                inter.Free()
        if self.id == root:
            MPI.Close_port(port)
        self.comm = world.Split(0, key)
        self.ids = self.comm.allgather(self.id)
        self.lost_ids = set()
        log.info('mpi_kvstore elastic: world %d formed: %d worker(s) %s in %.3f s',
                 self.generation, len(self.ids), self.ids, time.monotonic() - started)

    def _published_port(self, path, root, started):
        while True:
            found = rendezvous.read_signed(path, self.secret, self._refused)
            if (found and found.get('root') == root and found.get('admit') == self.id
                    and found.get('generation') == self.generation):
                return found['port']
            if time.monotonic() - started > self.timeout:
                raise RuntimeError('mpi_kvstore elastic: no port from worker %d in %g s'
                                   % (root, self.timeout))
            time.sleep(0.002)

    def _challenge(self, inter):
        """The root's side: whether the process behind ``inter`` holds the job's secret."""
        nonce = os.urandom(16).hex()
        inter.send(nonce, dest=0)
        request = inter.irecv(source=0)
        ends = time.monotonic() + HANDSHAKE_TIMEOUT
        answered, reply = request.test()
        while not answered and time.monotonic() < ends:
            time.sleep(0.001)
            answered, reply = request.test()
        good = (answered and isinstance(reply, dict)
                and rendezvous.verify(self.secret, reply.get('mac'), 'join', nonce,
                                      reply.get('id')))
        if not answered:
            request.Cancel()
        if not good:
            log.warning('mpi_kvstore elastic: refused a process that connected to the port '
                        'without the job\'s secret (%s)',
                        'no answer' if not answered else 'a wrong signature')
        inter.send(bool(good), dest=0)
        return bool(good)

    def _answer(self, inter):
        nonce = inter.recv(source=0)
        inter.send({'id': self.id, 'mac': rendezvous.sign(self.secret, 'join', nonce, self.id)},
                   dest=0)
        return inter.recv(source=0)

    # -- losses ----------------------------------------------------------------------------
    def _look(self, force=False):
        """Read the launcher's notices (at most every NOTICE_EVERY s unless ``force``)."""
        now = time.monotonic()
        if not force and now < self._next_look:
            return
        self._next_look = now + NOTICE_EVERY
        for worker in self.ids:
            if worker in self.lost_ids or worker == self.id:
                continue
            found = rendezvous.read_signed(rendezvous.lost_path(self.directory, worker),
                                           self.secret, self._refused)
            if found and found.get('lost') == worker:
                self.lost_ids.add(worker)

    def check(self, what: str = 'collective') -> None:
        """Raise HorovodInternalError if the launcher announced a lost worker (any thread
        may call it: the store's threads do, while their collectives wait)."""
        self._look()
        if self.lost_ids:
            raise HorovodInternalError('%s: worker(s) %s lost (the launcher says so)'
                                       % (what, sorted(self.lost_ids)))

    def _wait(self, request, what):
        ends = time.monotonic() + self.deadline
        while not request.Test():
            self._look()
            if self.lost_ids:
                raise HorovodInternalError('%s: worker(s) %s lost (the launcher says so)'
                                           % (what, sorted(self.lost_ids)))
            if time.monotonic() > ends:
                raise HorovodInternalError('%s: no answer in %g s' % (what, self.deadline))
            time.sleep(POLL)

    # -- collectives -------------------------------------------------------------------------
    def allreduce(self, array: np.ndarray) -> np.ndarray:
        """The element-wise sum of every worker's ``array`` (HorovodInternalError when a
        worker is lost)."""
        array = np.ascontiguousarray(array)
        out = np.empty_like(array)
        self._wait(self.comm.Iallreduce(array, out, op=MPI.SUM), 'allreduce')
        return out

    def bcast_object(self, obj: Any) -> Any:
        """Rank 0's picklable ``obj`` on every worker (HorovodInternalError when a worker is
        lost)."""
        data = pickle.dumps(obj, protocol=4) if self.rank == 0 else b''
        length = np.array([len(data)], dtype=np.int64)
        self._wait(self.comm.Ibcast(length, root=0), 'bcast')
        buffer = np.frombuffer(data, dtype=np.uint8).copy() if self.rank == 0 else \
            np.empty(int(length[0]), dtype=np.uint8)
        self._wait(self.comm.Ibcast(buffer, root=0), 'bcast')
        return obj if self.rank == 0 else pickle.loads(buffer.tobytes())
