"""The dependency-chained design."""
import functools

import mxnet as mx

from .. import engine
from ..comm import MPI, Comm
from ..timeline import op_name
from .base import Design

__all__ = ['Chained']


class Chained(Design):
    """An engine dependency orders the collectives.

    Thread level: MPI_THREAD_SERIALIZED. Collectives run inside the engine ops,
    on whichever engine worker runs them, but never two at once.

    Order: every op also writes one private chain variable, so the engine runs
    them strictly in push order (the sequence order) on every rank, whatever
    order their data becomes ready in. An op is one call of the store: a list of
    keys fuses into buckets; separate calls are separate collectives. It cannot
    deadlock: op k waits only for data pushed before it and for op k-1, which
    every rank reaches. The price is head-of-line blocking: a key pushed early
    but produced late (gluon pushes the first layer first) holds back the rest.
    Each op first MIN-allreduces a 4-int fingerprint of its requests, so ranks
    that disagree fail loudly instead of summing different keys.
    """

    name = 'chained'
    thread_level = MPI.THREAD_SERIALIZED

    def __init__(self, comm, config, sink, timeline=None):
        super().__init__(comm, config, sink, timeline)
        self._comm = self.join_comm = Comm(comm)
        self._chain = mx.nd.zeros((1,))

    def _submit(self, reqs, priority):
        arrays = [r.array for r in reqs if r.array is not None]
        engine.push(functools.partial(self._run, reqs), mutable=arrays + [self._chain],
                    priority=priority, name=op_name(reqs[0].kind),
                    on_error=functools.partial(self._failed_in_engine, reqs))

    def _run(self, reqs, completion):
        try:
            for req in reqs:
                if self.timeline:
                    self.timeline.ready(req)
                self.attach(req)
            self.agree_and_execute(reqs, self._comm)
        finally:
            # Never with an error: the engine would set it on the chain variable
            # too and skip every later collective of this rank (see deferred.py).
            completion.done()

    def _failed_in_engine(self, reqs, err):
        self.fail_all(reqs, err)
        for req in reqs:
            req.finish()

    def close(self):
        self._comm.free()
