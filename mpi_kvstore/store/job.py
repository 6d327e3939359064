"""One store's job: the design that runs its collectives, the requests not finished yet,
and the errors that wait for the user's thread.

Every unit of the store (exchange, optimizer, collectives) submits through :class:`Job`,
so that the error gate, the pending list the stall inspector reads and the order of
submission are kept in one place.
"""
import collections

import mxnet as mx

from ..engine import core as engine
from ..errors import MPIKVStoreError
from ..faults.abort import install_abort_hook
from ..faults.stall import StallInspector
from .contract import check_priority
from .deferred import DeferredErrors

__all__ = ['Job']


class Job:
    """The design of one store, its pending requests and its deferred errors.

    ``design(comm, config, sink, timeline, table, shares=shares)`` is built here, with this
    job's error queue as its sink and the store's shards.JoinedShares (or None).
    """

    def __init__(self, comm, config, design, timeline, table, shares=None):
        self.errors = DeferredErrors()
        self.pending = collections.deque()
        self.closed = False
        self.timeline = timeline
        self.design = design(comm, config, self.errors.record, timeline, table, shares=shares)
        install_abort_hook()  # a rank that raises must end the job, not hang the others
        self._inspector = StallInspector(comm, config, self.design, self.pending_now)

    def check_open(self):
        if self.closed:
            raise MPIKVStoreError('the store is closed: create a new one to go on')

    def begin(self, priority=0):
        """What every call checks first: an open store, an int priority, no error pending."""
        self.check_open()
        check_priority(priority)
        self.errors.raise_pending()

    def submit(self, reqs, priority):
        """Hand complete requests to the design, in call order."""
        self.check_open()
        self.design.reap()
        while self.pending and self.pending[0].done:
            self.pending.popleft()
        self.pending.extend(reqs)
        self.design.submit(reqs, priority)
        if self.design.synchronous:
            self.errors.raise_pending()

    def pending_now(self):
        """The collectives not finished yet (the stall inspector's thread asks)."""
        self.design.reap()
        return [req for req in list(self.pending) if not req.done]

    def wait(self):
        """Block until every collective pushed so far finished; raise what failed."""
        while self.pending:
            self.pending[0].wait()
            self.pending.popleft()
        self.errors.raise_pending()

    def shut(self):
        """Finish in-flight work and stop the threads; the caller then raises what failed
        (errors.raise_pending)."""
        for req in list(self.pending):
            req.wait(timeout=60)
        engine.consume_raised()  # the engine's copy of an error must not fail waitall
        mx.nd.waitall()
        engine.quiesce()
        self.closed = True
        self._inspector.stop()
        self.design.close()
        if self.timeline:
            self.timeline.write()
