"""Priority-partitioned scheduling of agreed collectives: pure, no MPI, no engine.

The negotiated designs agree each round on which requests are ready on every rank. Here
those agreed requests become a queue of units that every rank holds alike:

- an allreduce larger than ``partition_bytes`` is cut into pieces (:class:`Piece`) of that
  size, contiguous views of its memory, so that a large low-priority gradient does not
  hold the link while a small high-priority one waits;
- each dispatch takes the highest-priority units (fusion.order: priority, then push
  order, then piece) up to ``credit_bytes``; what is left waits for the next round, where
  requests agreed meanwhile may overtake it.

Every rank cuts the same agreed requests the same way (their sizes are in the agreed
signature) and takes from the same queue, so every rank runs the same buckets in the same
order without a coordinator. docs/scheduling.md has the deadlock argument.
"""
import threading

from . import debug
from .fusion import order

__all__ = ['Piece', 'cut', 'Queue']


class _Cut:
    """What the pieces of one request share: how many are left, and a lock (the concurrent
    design's lanes complete pieces from several threads)."""

    __slots__ = ('count', 'left', 'lock')

    def __init__(self, count):
        self.count = self.left = count
        self.lock = threading.Lock()


class Piece:
    """Elements [start, stop) of an agreed allreduce, scheduled, fused and reduced as a
    request of its own. The request completes once its last piece does, with the first
    error any piece had (its whole output is then poisoned, as for an unpartitioned one)."""

    __slots__ = ('parent', 'index', 'start', 'stop', 'nbytes', 'view', 'scratch', 'error',
                 'sig', 'key', '_cut')

    kind = 'allreduce'
    in_place = True

    def __init__(self, parent, index, start, stop, shared):
        self.parent, self.index, self.start, self.stop = parent, index, start, stop
        self.nbytes = (stop - start) * parent.dtype.itemsize
        self.view = None if parent.view is None else parent.view[start:stop]
        self.scratch = None if parent.scratch is None else parent.scratch[start:stop]
        self.error = None
        self.sig = parent.sig
        # Compression keeps state per key (2-bit's residual): a piece keeps its own, of its
        # size; the cut is the same every step, so each element keeps one residual.
        self.key = (parent.key, 'piece', index)
        self._cut = shared

    # what fusion, the reducer, codecs and the timeline read of a request
    seq = property(lambda self: self.parent.seq)
    priority = property(lambda self: self.parent.priority)
    dtype = property(lambda self: self.parent.dtype)
    average = property(lambda self: self.parent.average)
    place = property(lambda self: self.parent.place)
    codec = property(lambda self: self.parent.codec)
    mirror = property(lambda self: self.parent.mirror)
    array = property(lambda self: self.parent.array)
    shape = property(lambda self: (self.stop - self.start,))
    done = property(lambda self: self.parent.done)
    pieces = property(lambda self: self._cut.count)   # how many its request was cut into

    def describe(self):
        return '%s, piece %d (elements %d to %d)' % (self.parent.describe(), self.index,
                                                       self.start, self.stop)

    def buffer(self):
        return self.scratch if self.scratch is not None else self.view

    def complete(self):
        parent = self.parent
        with self._cut.lock:
            if self.error is not None and parent.error is None:
                parent.error = self.error
            self._cut.left -= 1
            last = self._cut.left == 0
        if last:
            parent.complete()


def cut(req, partition_bytes):
    """``req`` as the units it is scheduled in: pieces of at most ``partition_bytes`` (an
    allreduce larger than that), else itself."""
    if (partition_bytes <= 0 or req.kind != 'allreduce' or req.dtype is None
            or req.nbytes <= partition_bytes):
        return [req]
    count = req.nbytes // req.dtype.itemsize
    step = max(1, partition_bytes // req.dtype.itemsize)
    bounds = list(range(0, count, step)) + [count]
    shared = _Cut(len(bounds) - 1)
    return [Piece(req, i, bounds[i], bounds[i + 1], shared) for i in range(len(bounds) - 1)]


class Queue:
    """The agreed units not yet run; identical on every rank."""

    def __init__(self, partition_bytes=0, credit_bytes=0):
        self.partition_bytes = partition_bytes
        self.credit_bytes = credit_bytes
        self._units = []

    def __len__(self):
        return len(self._units)

    def add(self, reqs):
        """Agreed requests join the queue, cut into pieces."""
        for req in reqs:
            units = cut(req, self.partition_bytes)
            if len(units) > 1:
                debug.count('schedule', 'pieces_cut')
            self._units.extend(units)

    def take(self):
        """The highest-priority units up to ``credit_bytes`` (at least one; 0: all), in
        order; the rest stay for the next round."""
        self._units.sort(key=order)
        if self.credit_bytes <= 0:
            taken, self._units = self._units, []
            return taken
        total, n = 0, 0
        for unit in self._units:
            if n and total + unit.nbytes > self.credit_bytes:
                break
            total += unit.nbytes
            n += 1
        taken, self._units = self._units[:n], self._units[n:]
        if self._units:
            debug.count('schedule', 'held_back')   # a dispatch that left work for later
        return taken
