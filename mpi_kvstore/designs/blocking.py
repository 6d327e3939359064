"""The blocking baseline."""
from ..comm.mpiabi import MPI
from .base import Design

__all__ = ['Blocking']


class Blocking(Design):
    """Synchronous, outside the engine: what a first port to MPI looks like.

    Thread level: MPI_THREAD_FUNNELED when the store is used from the main thread
    (MPI is only called from the caller's thread).

    Order: each call waits for its inputs (``asnumpy``), reduces host copies and
    writes the results back before returning, so collectives run in call order
    and nothing overlaps. It is here to measure the engine-embedded designs
    against.
    """

    name = 'blocking'
    thread_level = MPI.THREAD_FUNNELED

    synchronous = True
    in_engine = False

    def __init__(self, comm, config, sink, timeline=None, table=None, make_comm=None,
                 shares=None):
        super().__init__(comm, config, sink, timeline, table, make_comm, shares)
        self._comm = self.join_comm = self.make_comm()

    def _submit(self, reqs, priority):
        for req in reqs:
            if req.array is not None:
                req.attach(req.array.asnumpy().reshape(-1))
            if self.timeline:
                self.timeline.ready(req)
        self.agree_and_execute(reqs, self._comm)
        for req in reqs:  # a failed one's view is poisoned: write it back too
            if req.array is not None and req.view is not None:
                req.array[:] = req.view.reshape(req.shape)

    def close(self):
        self._comm.free()
