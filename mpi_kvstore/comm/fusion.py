"""Fusion planning: pure, no MPI, no engine.

Every rank calls :func:`plan` with the same agreed requests in the same order,
so every rank derives the same buckets.
"""
import numpy as np

__all__ = ['plan', 'fusable', 'pieces', 'share', 'Shares', 'BufferPool', 'FUSABLE']


class BufferPool:
    """Reusable flat buffers, one per (array module, device, dtype): numpy for host memory,
    CuPy for each GPU's; each grows to the largest count asked for, and holds at least
    ``minimum`` elements. ``allocate(count, dtype)``, where given, makes them instead (the
    staged transport's pinned host buffers)."""

    def __init__(self, allocate=None, minimum=1024):
        self._buffers = {}
        self._allocate = allocate
        self._minimum = minimum

    def get(self, like, count):
        """``count`` elements of a buffer like ``like`` (its module, device and dtype)."""
        module = type(like).__module__.split('.')[0]
        device = like.device.id if module == 'cupy' else None
        key = (module, device, like.dtype.str)
        buf = self._buffers.get(key)
        if buf is None or buf.size < count:
            size = max(count, self._minimum)
            if self._allocate is not None:
                buf = self._allocate(size, like.dtype)
            elif device is None:
                buf = np.empty(size, dtype=like.dtype)
            else:
                xp = __import__(module)
                with xp.cuda.Device(device):
                    buf = xp.empty(size, dtype=like.dtype)
            self._buffers[key] = buf
        return buf[:count]

    def clear(self):
        self._buffers.clear()


FUSABLE = ('allreduce', 'reducescatter', 'allgather')


def fusable(req, threshold):
    return req.kind in FUSABLE and 0 < req.nbytes <= threshold and threshold > 0


def _compatible(a, b):
    """Agreed metadata only (place is in the signature): a rank whose engine op could not
    read an array must plan the same buckets as the others."""
    return (a.kind == b.kind and a.dtype == b.dtype and a.average == b.average
            and a.factor == b.factor and a.place == b.place)


def order(req):
    """Higher priority first (gluon passes -index: the first layer is needed first), then
    push order, then a piece's place in its request (schedule.Piece). All are the same on
    every rank, so the order is too."""
    return -req.priority, req.seq, getattr(req, 'index', 0)


def plan(requests, threshold, device_threshold=None):
    """Group requests, in :func:`order`, into buckets of at most ``threshold`` bytes
    (``device_threshold`` for GPU arrays, where given).

    Neighbouring compatible allreduces share a bucket; anything else travels alone.
    """
    buckets, current, size = [], [], 0
    for req in sorted(requests, key=order):
        limit = (device_threshold if device_threshold is not None and req.place != 'cpu'
                 else threshold)
        if not fusable(req, limit):
            if current:
                buckets.append(current)
                current, size = [], 0
            buckets.append([req])
            continue
        if current and (size + req.nbytes > limit or not _compatible(current[0], req)):
            buckets.append(current)
            current, size = [], 0
        current.append(req)
        size += req.nbytes
    if current:
        buckets.append(current)
    return buckets


def share(count, width, index):
    """[start, stop) of piece ``index`` of ``count`` elements cut into ``width`` near-equal,
    contiguous pieces, the larger ones first: the same cut on every rank."""
    small, extra = divmod(count, width)
    start = index * small + min(index, extra)
    return start, start + small + (index < extra)


def pieces(count, width, unit=1):
    """(counts, displacements) of ``count`` elements cut into ``width`` near-equal pieces,
    the larger ones first (:func:`share`): a reduce-scatter's shares. ``unit``: elements
    that stay together (a row: Horovod's reducescatter cuts along the first axis)."""
    bounds = [share(count // unit, width, i) for i in range(width)]
    return ([(stop - start) * unit for start, stop in bounds],
            [start * unit for start, _ in bounds])


class Shares:
    """A bucket's requests cut into ``width`` shares each (:func:`pieces`), laid out rank
    major in one flat buffer: share 0 of every request in bucket order, then share 1, ...:
    the send buffer of a fused reduce-scatter, the buffer of a fused allgather.

    ``reqs`` need ``nbytes``, ``dtype`` and ``unit`` (collective.Collective), or ``cuts``
    of their own (schedule.SharePiece: part of every rank's share). ``cuts[j]``: request
    j's (counts, displacements); ``counts[r]``, ``displs[r]``: rank r's chunk of the flat
    buffer. ``direct``: one request whose own buffer is that flat buffer, so MPI can read
    it where it is."""

    def __init__(self, reqs, width):
        own = [getattr(r, 'cuts', None) for r in reqs]
        self.cuts = [c if c is not None else pieces(r.nbytes // r.dtype.itemsize, width, r.unit)
                     for r, c in zip(reqs, own)]
        self.direct = len(reqs) == 1 and own[0] is None
        self.counts = [sum(c[r] for c, _ in self.cuts) for r in range(width)]
        self.displs = [sum(self.counts[:r]) for r in range(width)]

    def spans(self, rank):
        """[(j, start, stop, at)]: request j's elements [start, stop) are rank ``rank``'s
        share, at offset ``at`` of that rank's chunk."""
        found, at = [], 0
        for j, (counts, displs) in enumerate(self.cuts):
            found.append((j, displs[rank], displs[rank] + counts[rank], at))
            at += counts[rank]
        return found
