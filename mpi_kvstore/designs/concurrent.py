"""The concurrent design."""
import functools
import queue
import threading

from ..comm.mpiabi import MPI
from .base import comm_factory
from .negotiated import Negotiated, tighten_timer_slack

__all__ = ['Concurrent']

_STOP = object()


class Concurrent(Negotiated):
    """Several collectives in flight at once, from several threads.

    Thread level: MPI_THREAD_MULTIPLE. The negotiation thread and ``lanes``
    worker threads call MPI at the same time, each on its own duplicated
    communicator.

    Order: the negotiation thread agrees with the other ranks on what is ready
    (see negotiated.py) and cuts it into buckets; bucket number b goes to lane
    b mod lanes on every rank. Within a lane buckets run in that order, and lanes
    share no communicator, so each communicator sees one order on every rank.
    No deadlock: no lane waits on another, and no engine worker is blocked.
    """

    name = 'concurrent'
    thread_level = MPI.THREAD_MULTIPLE

    def __init__(self, comm, config, sink, timeline=None, table=None, make_comm=None,
                 shares=None):
        self._lanes = []
        make_comm = comm_factory(comm, config, table, make_comm)
        for i in range(config.lanes):
            lane = (make_comm(concurrent=True), queue.SimpleQueue())
            worker = threading.Thread(target=self._serve, args=lane,
                                      name='mpi_kvstore-lane%d' % i, daemon=True)
            self._lanes.append(lane + (worker,))
            worker.start()
        self._bucket = 0
        self._held = 0                      # bytes dispatched to lanes, not yet run
        self._room = threading.Condition()
        super().__init__(comm, config, sink, timeline, table, make_comm, shares)

    def dispatch(self, agreed):
        # The credit bounds the bytes the lanes hold, not only one dispatch: wait (here,
        # locally: what was taken is already fixed, the same on every rank) until the
        # lanes have room. No deadlock: the lanes run buckets every rank has dispatched.
        nbytes = sum(r.nbytes for r in agreed)
        credit = self.config.credit_bytes
        with self._room:   # counted with or without a credit: autotune may set one later
            if credit > 0:
                self._room.wait_for(lambda: not self._held or self._held + nbytes <= credit)
            self._held += nbytes
        for bucket in self.buckets(agreed):
            _, jobs, _ = self._lanes[self._bucket % len(self._lanes)]
            self._bucket += 1
            jobs.put(bucket)

    def _serve(self, comm, jobs):
        if self.timer_slack_ns:   # a lane's polled collectives sleep as the thread's do
            tighten_timer_slack(self.timer_slack_ns)
        while True:
            bucket = jobs.get()
            if bucket is _STOP:
                return
            if callable(bucket):   # set_progress: at the same bucket of this lane everywhere
                bucket()
                continue
            try:
                self.execute(bucket, comm)
            finally:
                with self._room:
                    self._held -= sum(r.nbytes for r in bucket)
                    self._room.notify_all()

    def set_progress(self, sleep_us):
        # In each lane's order, not now: a lane may still run buckets of earlier rounds,
        # and a blocking MPI call on one rank never matches a non-blocking one on another.
        for comm, jobs, _ in self._lanes:
            jobs.put(functools.partial(comm.set_progress, sleep_us))

    def close(self):
        super().close()
        for comm, jobs, worker in self._lanes:
            jobs.put(_STOP)
            worker.join(timeout=10)
            if not worker.is_alive():
                comm.free()
