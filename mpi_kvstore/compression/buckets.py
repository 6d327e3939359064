"""What the codecs do to a bucket: its signature, its values in one float32 array, the
pieces a ring cuts it into, and where its buffers live."""
import zlib

import numpy as np

from .. import debug
from ..comm.collective import SIG_LIMIT
from ..comm.fusion import pieces

__all__ = ['sign']


def sign(sig, spec):
    """A request's signature, marked with the codec that runs it."""
    return zlib.crc32(('%d|%r' % (sig, spec)).encode()) % SIG_LIMIT


def float32_values(reqs, sizes, scale):
    """(the bucket's values times ``scale`` in one float32 host array, {req: error}): a
    request that cannot be read gives zeros there and fails; GPU buffers are copied down."""
    flat, failed, offset = np.zeros(sum(sizes), np.float32), {}, 0
    for req, size in zip(reqs, sizes):
        try:
            values = req.buffer().reshape(-1)
            if not isinstance(values, np.ndarray):
                values = values.get()
            np.multiply(values, scale, dtype=np.float32, out=flat[offset:offset + size])
        except Exception as err:
            failed[req] = err
            flat[offset:offset + size] = 0
        offset += size
    return flat, failed


def packed(spans):
    """(start, width, at) of each span, ``at`` its place in the piece packed contiguous."""
    at = 0
    for start, width in spans:
        yield start, width, at
        at += width


def ring_pieces(sizes, n):
    """Each of the ``n`` ring pieces as (start, width) spans of the bucket: piece i holds piece
    i of every request (each cut into n, larger pieces first), so that where a value starts
    its way round the ring depends on its key alone, not on which keys share its bucket."""
    spans, offset = [[] for _ in range(n)], 0
    for size in sizes:
        for i, (width, start) in enumerate(zip(*pieces(size, n))):
            if width:
                spans[i].append((offset + start, width))
        offset += size
    return spans


def device_module(reqs):
    """CuPy where the bucket's buffers are on a GPU (a bucket is on one side: its place is
    agreed, and reduce.py gives a failed GPU request device zeros), else None."""
    for req in reqs:
        buf = req.buffer()
        if buf is not None:
            if isinstance(buf, np.ndarray):
                return None
            return __import__(type(buf).__module__.split('.')[0])
    return None


def alltoall(comm, send, recv, nbytes):
    """Piece j of flat ``send`` to rank j, piece i of flat ``recv`` from rank i (one piece a
    rank, all of one size). Host buffers: MPI_Alltoall. Device buffers: the transport that
    the bucket's ``nbytes`` take, which reduce.py's scope chose by the same size and whose
    stream it made current, so the casts queued before and after are ordered with it
    (choosing by the halved buffer's size could pick another transport on another stream).
    Buffers on another device of this rank than the transport's go through copies there
    (routing.DeviceRouter.run, which waits for them)."""
    if isinstance(send, np.ndarray):
        comm.alltoall(send, recv)
        return
    transport = comm.device_transport(send.device.id, nbytes, 'alltoall')
    if transport.device != send.device.id:
        comm.router.run(send, lambda there, data, into: there.alltoall(data, into), recv,
                        op='alltoall', nbytes=nbytes)
        return
    debug.count('transport', transport.name)
    transport.alltoall(send, recv)


def host_empty(shape, dtype, device):
    """Host memory for MPI: pinned where it is copied to and from a GPU."""
    if device is None:
        return np.empty(shape, dtype)
    import cupyx  # optional dependency, loaded where used
    return cupyx.empty_pinned(shape, dtype)


def ceil_div(a, b):
    """ceil(a / b) for non-negative integers."""
    return -(-a // b)
