"""Priority-partitioned scheduling of agreed collectives: pure, no MPI, no engine.

The negotiated designs agree each round on which requests are ready on every rank. Here
those agreed requests become a queue of units that every rank holds alike:

- an allreduce larger than ``partition_bytes`` is cut into pieces (:class:`Piece`) of that
  size, contiguous views of its memory, so that a large low-priority gradient does not
  hold the link while a small high-priority one waits;
- so is a reduce-scatter or allgather of the sharded optimizer (:class:`SharePiece`): piece
  p holds part p of every rank's share, so each rank's share (fusion.share) stays where it
  is, whole, for the optimizer, and only the collective is cut;
- each dispatch takes the highest-priority units (fusion.order: priority, then push
  order, then piece) up to ``credit_bytes``; what is left waits for the next round, where
  requests agreed meanwhile may overtake it.

Both sizes count the bytes a unit puts on the wire (:func:`wire_bytes`): a compressed request
counts its codes, so that fp16 cuts pieces of twice the values and fits twice the values in
a credit. Counted in the uncompressed bytes, the pieces and the rounds ate a third of
fp16's gain across hosts (docs/scheduling.md).

Every rank cuts the same agreed requests the same way (their sizes are in the agreed
signature) and takes from the same queue, so every rank runs the same buckets in the same
order without a coordinator. docs/scheduling.md has the deadlock argument.
"""
import threading

import numpy as np

from .. import debug
from ..comm.collective import SIG_LIMIT
from ..comm.fusion import order, pieces, share

__all__ = ['Piece', 'SharePiece', 'cut', 'Knobs', 'Queue', 'wire_bytes']


def wire_bytes(req):
    """The bytes ``req`` (a request or a piece) puts on the wire: its codec's, where it is
    compressed, else its own."""
    codec = req.codec
    if codec is None or req.dtype is None or not codec.applies_to(req.dtype):
        return req.nbytes
    return codec.wire_bytes(req.nbytes, req.dtype)


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
    factor = property(lambda self: self.parent.factor)
    scale = property(lambda self: self.parent.scale)
    place = property(lambda self: self.parent.place)
    codec = property(lambda self: self.parent.codec)
    mirror = property(lambda self: self.parent.mirror)
    array = property(lambda self: self.parent.array)
    unit = property(lambda self: self.parent.unit)
    shape = property(lambda self: (self.stop - self.start,))
    extent = property(lambda self: self.stop - self.start)
    done = property(lambda self: self.parent.done)
    pieces = property(lambda self: self._cut.count)   # how many its request was cut into

    def describe(self):
        return '%s, piece %d (elements %d to %d)' % (self.parent.describe(), self.index,
                                                       self.start, self.stop)

    def buffer(self):
        return self.scratch if self.scratch is not None else self.view

    # what the designs and the reducer do to a request, as collective.Collective does it
    def fail(self, error):
        self.error = error

    def withdraw(self):
        if self.view is None and self.array is not None:
            self.scratch = np.zeros(self.extent, dtype=self.dtype)
        self.sig = (self.sig + SIG_LIMIT // 2) % SIG_LIMIT

    def use_scratch(self, scratch):
        self.scratch = scratch

    def complete(self):
        parent = self.parent
        with self._cut.lock:
            if self.error is not None and parent.error is None:
                parent.fail(self.error)
            self._cut.left -= 1
            last = self._cut.left == 0
        if last:
            parent.complete()


class SharePiece(Piece):
    """Part ``index`` of every rank's share of an agreed reduce-scatter or allgather (host
    memory): ``cuts`` = (counts, displacements) per rank, in elements of the request's flat
    buffer, which fusion.Shares lays out instead of the request's own cut. Its buffer is
    the request's whole buffer (``extent``); it reads and writes only its parts of it."""

    __slots__ = ('cuts',)

    kind = property(lambda self: self.parent.kind)
    in_place = property(lambda self: self.parent.in_place)
    extent = property(lambda self: self.parent.extent)

    def __init__(self, parent, index, cuts, shared):
        self.parent, self.index, self.cuts = parent, index, cuts
        self.nbytes = sum(cuts[0]) * parent.dtype.itemsize
        self.view, self.scratch = parent.view, parent.scratch
        self.error = None
        self.sig = parent.sig
        self.key = (parent.key, 'piece', index)
        self._cut = shared

    shape = property(lambda self: (sum(self.cuts[0]),))

    def describe(self):
        return '%s, piece %d of every share' % (self.parent.describe(), self.index)


def _cut_shares(req, partition_bytes, size, wire):
    """Pieces of about ``partition_bytes`` on the wire (``wire``: wire_bytes(req)) of a
    reduce-scatter or allgather over ``size`` ranks: piece p takes part p (fusion.share) of
    every rank's share, the same cut on every rank, since it depends on the agreed size
    alone."""
    counts, displs = pieces(req.nbytes // req.dtype.itemsize, size)
    count = min(-(-wire // partition_bytes), max(counts))   # none empty everywhere
    shared = _Cut(count)
    units = []
    for p in range(count):
        parts = [share(c, count, p) for c in counts]
        units.append(SharePiece(req, p, ([b - a for a, b in parts],
                                         [d + a for d, (a, _) in zip(displs, parts)]), shared))
    return units


def cut(req, partition_bytes, size=1):
    """``req`` as the units it is scheduled in: pieces of at most ``partition_bytes`` on the
    wire (an
    allreduce larger than that; a reduce-scatter or allgather of host memory over ``size``
    ranks, whole elements: SharePiece), else itself."""
    if partition_bytes <= 0 or req.dtype is None:
        return [req]
    wire = wire_bytes(req)
    if wire <= partition_bytes:
        return [req]
    if req.kind in ('reducescatter', 'allgather'):
        if size > 1 and req.place == 'cpu' and req.unit == 1:
            return _cut_shares(req, partition_bytes, size, wire)
        return [req]
    if req.kind != 'allreduce':
        return [req]
    count = req.nbytes // req.dtype.itemsize
    # Values a piece: partition_bytes on the wire (wire_bytes is linear in the values).
    step = max(1, partition_bytes * count // wire)
    bounds = list(range(0, count, step)) + [count]
    shared = _Cut(len(bounds) - 1)
    return [Piece(req, i, bounds[i], bounds[i + 1], shared) for i in range(len(bounds) - 1)]


class Knobs:
    """The ``partition_bytes`` and ``credit_bytes`` in use. Its owner changes them with
    :meth:`switch` (autotune's switch, at the same round on every rank); a :class:`Queue`
    reads them at each add and take, so nobody writes the queue's fields."""

    def __init__(self, partition_bytes=0, credit_bytes=0):
        self._partition_bytes = partition_bytes
        self._credit_bytes = credit_bytes

    @property
    def partition_bytes(self):
        return self._partition_bytes

    @property
    def credit_bytes(self):
        return self._credit_bytes

    def switch(self, partition_bytes, credit_bytes):
        self._partition_bytes = partition_bytes
        self._credit_bytes = credit_bytes


class Queue:
    """The agreed units not yet run; identical on every rank. ``knobs``: the
    :class:`Knobs` it cuts and credits by, read as they stand at each add and take."""

    def __init__(self, knobs, size=1):
        self._knobs = knobs
        self.size = size
        self._units = []

    @property
    def partition_bytes(self):
        return self._knobs.partition_bytes

    @property
    def credit_bytes(self):
        return self._knobs.credit_bytes

    def __len__(self):
        return len(self._units)

    def add(self, reqs):
        """Agreed requests join the queue, cut into pieces."""
        for req in reqs:
            units = cut(req, self.partition_bytes, self.size)
            if len(units) > 1:
                debug.count('schedule', 'pieces_cut')
            self._units.extend(units)

    def take(self):
        """The highest-priority units up to ``credit_bytes`` on the wire (at least one; 0:
        all), in order; the rest stay for the next round."""
        self._units.sort(key=order)
        if self.credit_bytes <= 0:
            taken, self._units = self._units, []
            return taken
        total, n = 0, 0
        for unit in self._units:
            size = wire_bytes(unit)
            if n and total + size > self.credit_bytes:
                break
            total += size
            n += 1
        taken, self._units = self._units[:n], self._units[n:]
        if self._units:
            debug.count('schedule', 'held_back')   # a dispatch that left work for later
        return taken
