"""What runs around a bucket's collective, outside the schedulers: fusion into one flat
buffer, the reduction by the transport, averaging, the copy back, and for device buffers
the device, the stream and the synchronisation before the engine op completes.

A design agrees with the other ranks on what runs and in which buckets (fusion.plan), then
hands each bucket here. No MXNet here: the GPU tests drive it with CuPy arrays alone.

Device buckets (place 'gpu', which every rank agreed on) run under ``cupy.cuda.Device`` of
their buffers, on the transport's stream: fusion, the collective, averaging and the copy
back are queued there in order, and the stream is synchronised before the bucket
completes, because MXNet's next op on the output may run on any stream. MXNet itself
completes an op only once its GPU work is done, so a single buffer needs no
synchronisation before the collective; a fused one is synchronised by the transport
(staged: its copy down; CUDA-aware MPI: before MPI reads) or ordered on the stream (NCCL).

A rank whose own step fails (fusion, reading an array) still takes part, with zeros of
the agreed size in the agreed place (device zeros for a device bucket): the other ranks
are in the collective, and skipping it would pair this rank's next collective with their
current one.
"""
import contextlib
import logging

import numpy as np

from .fusion import BufferPool, Shares

__all__ = ['Reducer', 'scale']

log = logging.getLogger(__name__)


class Reducer:
    """Runs allreduce and broadcast buckets on a Comm.

    ``size``: the number of ranks. ``fail(req, err)``: how the design fails a request;
    ``fail_all(reqs, err)``: how it fails requests on this rank alone (it gives them host
    zeros and spoils their signature).
    """

    def __init__(self, size, fail, fail_all):
        self.size = size
        self._fail = fail
        self._fail_all = fail_all
        self._pools = {}   # one per communicator: lanes of the concurrent design run at once

    def allreduce(self, bucket, comm):
        if any(r.codec is not None for r in bucket):
            self._coded(bucket, comm)
            return
        if self.size == 1:     # the sum over one rank, and its average, is the data itself
            return
        with _scope(bucket, comm) as device:
            _zeros_in_place(bucket, device)
            if len(bucket) == 1:
                buf = bucket[0].buffer()
                comm.allreduce(buf)
                self._average(bucket[0], buf)
                return
            flat = self._fuse(bucket, comm, device)
            comm.allreduce(flat)
            self._average(bucket[0], flat)
            offset = 0
            for req in bucket:
                view = req.buffer()
                view[...] = flat[offset:offset + view.size]
                offset += view.size

    def bcast(self, req, comm):
        if self.size == 1:
            return
        with _scope([req], comm, 'broadcast') as device:
            _zeros_in_place([req], device)
            comm.bcast(req.buffer(), req.root)

    def reduce_scatter(self, bucket, comm):
        """After it, this rank's share (fusion.share) of each request's flat buffer holds the
        sum over the ranks (the mean with ``average``); the rest of the buffer is as it was.

        A bucket of several requests travels in one MPI_Reduce_scatter: every request's
        share r is packed, in bucket order, into rank r's piece of one flat buffer. A
        compressed bucket goes to its codec (a wire cast sends 16-bit floats, on a GPU
        too: WireCast.reduce_scatter). Device buffers go through their transport (NCCL,
        staged through pinned host memory, or a CUDA-aware MPI), on its stream. Which of
        these runs: :func:`shares_route`.
        """
        if self.size == 1:
            return
        route = shares_route(bucket)
        if route == 'allreduce':
            self.allreduce(bucket, comm)
            return
        # a codec's device shares travel by all-to-all (compression.buckets.alltoall)
        op = 'alltoall' if route == 'coded' else 'reducescatter'
        with _scope(bucket, comm, op) as device:   # nothing for a host bucket
            _zeros_in_place(bucket, device)
            self._reduce_scatter(bucket, comm)

    def _reduce_scatter(self, bucket, comm):
        views = [r.buffer() for r in bucket]
        layout, me = Shares(bucket, self.size), comm.rank
        codec = bucket[0].codec   # fused requests share a dtype, hence a codec
        if codec is not None:
            failed = codec.reduce_scatter(bucket, comm)
            for j, start, stop, _ in layout.spans(me):
                req = bucket[j]
                if req in failed:
                    if req.error is None:
                        self._fail(req, failed[req])
                else:
                    self._average(req, views[j][start:stop])
            return
        if layout.direct:
            send = views[0]
        else:
            send = self._pool(comm, 'send').get(views[0], sum(layout.counts))
            for r in range(self.size):
                for j, start, stop, at in layout.spans(r):
                    at += layout.displs[r]
                    send[at:at + stop - start] = views[j][start:stop]
        mine = self._pool(comm, 'share').get(views[0], layout.counts[me])
        comm.reduce_scatter(send, mine, layout.counts)
        self._average(bucket[0], mine)
        for j, start, stop, at in layout.spans(me):
            views[j][start:stop] = mine[at:at + stop - start]

    def allgather(self, bucket, comm):
        """Every rank's share (fusion.share) of each request's flat buffer into every rank's
        buffer: the inverse of :meth:`reduce_scatter`'s cut, one MPI_Allgatherv a bucket."""
        if self.size == 1:
            return
        if bucket[0].place != 'cpu':   # through the transport, on its stream
            with _scope(bucket, comm, 'allgather') as device:
                _zeros_in_place(bucket, device)
                self._allgather(bucket, comm)
            return
        self._allgather(bucket, comm)

    def _allgather(self, bucket, comm):
        layout, me = Shares(bucket, self.size), comm.rank
        views = [r.buffer() for r in bucket]
        if len(views) == 1:
            comm.allgather_in_place(views[0], *layout.cuts[0])
            return
        flat = self._pool(comm, 'send').get(views[0], sum(layout.counts))
        for j, start, stop, at in layout.spans(me):
            at += layout.displs[me]
            flat[at:at + stop - start] = views[j][start:stop]
        comm.allgather_in_place(flat, layout.counts, layout.displs)
        for r in range(self.size):
            for j, start, stop, at in layout.spans(r):
                at += layout.displs[r]
                views[j][start:stop] = flat[at:at + stop - start]

    def _pool(self, comm, use):
        return self._pools.setdefault((id(comm), use), BufferPool())

    def _coded(self, bucket, comm):
        """A bucket with compressed requests: each codec exchanges its own (compression/;
        on the bucket's device for GPU arrays), the rest are reduced as usual. Buckets and
        codecs are agreed, so every rank makes the same calls in the same order."""
        codecs = []
        for req in bucket:
            if req.codec is not None and req.codec not in codecs:
                codecs.append(req.codec)
        with _scope(bucket, comm) as device:
            _zeros_in_place(bucket, device)
            for codec in codecs:
                reqs = [r for r in bucket if r.codec is codec]
                failed = codec.exchange(reqs, comm)
                for req in reqs:
                    if req in failed:
                        if req.error is None:
                            self._fail(req, failed[req])
                    else:
                        self._average(req, req.buffer())
        plain = [r for r in bucket if r.codec is None]
        if plain:
            self.allreduce(plain, comm)

    def _fuse(self, bucket, comm, device):
        """The bucket's data in one flat buffer; zeros of the agreed size if that fails here."""
        count = sum(r.nbytes for r in bucket) // bucket[0].dtype.itemsize
        try:
            views = [r.buffer() for r in bucket]
            pool = self._pools.setdefault(id(comm), BufferPool())
            flat = pool.get(views[0], count)
            _xp(flat).concatenate(views, out=flat)
            return flat
        except Exception as err:
            self._fail_all(bucket, err)
            return _zeros(count, bucket[0].dtype, device)

    def _average(self, req, buf):
        if self.size > 1:
            scale(buf, req.average, req.factor, self.size)


def scale(buf, average, factor, size):
    """The scaling of a reduced buffer in place, after the sum, as the native op's does
    (engine/native.py scale): a float buffer multiplied once by ``factor`` (divided by
    ``size`` with ``average``) in its own precision, float16 in float32 (as Horovod; the
    native op runs no float16); an integer one floor-divided by
    ``size`` with ``average``, then multiplied by ``factor`` in float64 and truncated
    towards zero, as Horovod's integer scaling does."""
    if buf.dtype.kind == 'f':
        if average:
            factor /= size
        elif factor == 1.0:
            return
        if buf.dtype.itemsize == 2:
            # float16 in float32, by the factor in float32, as Horovod scales it (numpy would
            # round the factor to float16 first: 1/3 then differs in 1 element of 3 by an ulp)
            buf[...] = buf.astype(np.float32) * np.float32(factor)
        else:
            buf *= factor
        return
    if average:
        buf //= size
    if factor != 1.0:
        buf[...] = (buf.astype(np.float64) * factor).astype(buf.dtype)


def shares_route(bucket):
    """How a reduce-scatter bucket runs, the same on every rank (its place and codec are
    agreed): 'coded' by its codec's reduce_scatter (host memory, or device memory where the
    codec says ``device_shares``: the wire casts), 'plain' by the transport's or MPI's
    reduce-scatter, or 'allreduce' for a compressed device bucket whose codec
    reduce-scatters host memory only (2-bit): the whole bucket is allreduced by the codec,
    twice the bytes, and every share then holds its sum."""
    codec = bucket[0].codec   # fused requests share a dtype, hence a codec
    if codec is None:
        return 'plain'
    if bucket[0].place != 'cpu' and not getattr(codec, 'device_shares', False):
        return 'allreduce'
    return 'coded'


def _xp(array):
    return np if isinstance(array, np.ndarray) else __import__(type(array).__module__.split('.')[0])


def _zeros(count, dtype, device):
    if device is None:
        return np.zeros(count, dtype=dtype)
    import cupy  # optional dependency, loaded where used
    return cupy.zeros(count, dtype=dtype)   # on the current device: _scope's


def _zeros_in_place(bucket, device):
    """A device bucket's failed requests send device zeros, as the others send device data
    (fail_all gave them host zeros: it does not know the device)."""
    if device is None:
        return
    for req in bucket:
        if isinstance(req.scratch, np.ndarray):
            req.use_scratch(_zeros(req.scratch.size, req.scratch.dtype, device))


def device_of(bucket):
    """The CUDA device of a device bucket: its buffers', else (every read failed) the
    device of its arrays' MXNet context, else the current one."""
    for req in bucket:
        buf = req.buffer()
        if buf is not None and not isinstance(buf, np.ndarray):
            return buf.device.id
    for req in bucket:
        context = getattr(req.array, 'context', None)
        if context is not None:
            return context.device_id
    import cupy  # optional dependency, loaded where used
    return cupy.cuda.runtime.getDevice()


@contextlib.contextmanager
def _scope(bucket, comm, op='allreduce'):
    """Host bucket: nothing (yields None). Device bucket: its device current, the stream
    of the transport that ``op`` takes for the bucket's size current where that transport
    is on that device (else a stream of the device's own, synchronised before the
    collective), and every queued operation finished on the way out, failed or not.
    Yields the device id."""
    if bucket[0].place == 'cpu':
        yield None
        return
    import cupy  # optional dependency, loaded where used
    device = device_of(bucket)
    # by the bucket's agreed op and size: the transport its collective will take (tune's
    # table), so the work queued here is ordered on that transport's stream
    transport = comm.device_transport(device, sum(r.nbytes for r in bucket), op)
    with cupy.cuda.Device(device):
        own = transport.device == device
        stream = transport.stream if own else _stream(device)
        try:
            with stream:
                yield device
        finally:
            if own:
                transport.finish()
            else:
                stream.synchronize()


_streams = {}


def _stream(device):
    import cupy  # optional dependency, loaded where used
    found = _streams.get(device)
    if found is None:
        found = _streams[device] = cupy.cuda.Stream()
    return found
