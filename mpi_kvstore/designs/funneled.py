"""The funneled design."""
from ..comm.mpiabi import MPI
from .negotiated import Negotiated

__all__ = ['Funneled']


class Funneled(Negotiated):
    """One communication thread makes every MPI call.

    Thread level: MPI_THREAD_SERIALIZED. Only one thread ever calls MPI, but it
    is not the thread that initialised MPI, which FUNNELED would require.

    Order: engine ops only mark requests ready; the thread agrees with the other
    ranks on which are ready everywhere (see negotiated.py) and runs them in
    sequence order, fusing neighbours into buckets. It cannot deadlock: it never
    blocks an engine worker, and every collective it starts is one every rank
    has agreed to start.
    """

    name = 'funneled'
    thread_level = MPI.THREAD_SERIALIZED

    def __init__(self, comm, config, sink, timeline=None, table=None, make_comm=None,
                 shares=None):
        super().__init__(comm, config, sink, timeline, table, make_comm, shares)
        self._data = self._control  # one thread, one order: one communicator suffices

    def dispatch(self, agreed):
        self.execute_all(agreed, self._data)

    def set_progress(self, sleep_us):
        self._data.set_progress(sleep_us)   # between rounds: the thread's only communicator
