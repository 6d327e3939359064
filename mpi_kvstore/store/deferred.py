"""Errors of collectives that failed inside the engine, and what they leave behind.

A collective fails on a thread that is not the user's (an engine worker or a
communication thread). Three things then happen, in this order:

1. its output memory is *poisoned* before the engine op completes, so that no
   read returns a plausible wrong value: floating dtypes become NaN; signed
   integers the most negative value of the dtype; unsigned integers the largest
   (int32 -2147483648, uint8 255), never a sum of small gradients;
2. where the design's op writes only the collective's outputs (funneled,
   concurrent), the op completes with an error, so MXNet's own read of the
   output (``asnumpy``, ``wait_to_read``) raises it;
3. the error waits in a :class:`DeferredErrors` queue and is raised on the
   user's thread by the next store call, ``wait()`` or ``close()``; a process
   that exits with one never raised ends with a non-zero status (shutdown.py).
"""
import collections
import logging

from ..comm.poison import poison, poison_value
from ..engine import core as engine
from ..errors import CollectiveError, MPIKVStoreError

__all__ = ['DeferredErrors', 'poison', 'poison_value']

log = logging.getLogger(__name__)


class DeferredErrors:
    """Failed collectives, kept until the user's thread can raise them."""

    def __init__(self):
        self._queue = collections.deque()  # appended by other threads, drained by the user's
        # the same deque, truthy while anything waits: a repeated call tests it (one attribute
        # read) instead of calling raise_pending when nothing failed (issue 43)
        self.waiting = self._queue
        # errors raised as their own type, not as a CollectiveError (an elastic world's loss,
        # which elastic.run answers)
        self.keep_types = ()

    def record_error(self, where, err):
        """Keep ``err`` of ``where`` (a description) for the user's thread."""
        self._queue.append((where, err))

    def record(self, req, err):
        # Its words come once, when raised (or at exit, never raised: shutdown.py); a log of
        # them here too made each rank print a mismatch's message twice.
        log.error('mpi_kvstore: %s failed (%s); the next store call raises it',
                  req.describe(), type(err).__name__)
        self._queue.append((req.describe(), err))

    def take(self):
        """The exception that stands for every error recorded so far (None if none)."""
        errors = []
        while self._queue:
            errors.append(self._queue.popleft())
        if not errors:
            return None
        engine.consume_raised()
        where, err = errors[0]
        more = ' (and %d more failed collectives)' % (len(errors) - 1) if len(errors) > 1 else ''
        keep = isinstance(err, MPIKVStoreError) or isinstance(err, self.keep_types)
        cls = type(err) if keep else CollectiveError
        exc = cls('%s failed: %s%s' % (where, err, more))
        if err.__traceback__ is not None:   # raised in a thread: its traceback tells where
            exc.__cause__ = err
        else:   # made, never raised: its message, in ours, is all it says (not printed twice)
            exc.__context__, exc.__suppress_context__ = err, True
        return exc

    def raise_pending(self):
        if not self._queue:   # the common case: nothing failed
            return
        exc = self.take()
        if exc is not None:
            raise exc
