"""NCCL through ``cupy.cuda.nccl``: device buffers reduced by NCCL's own kernels.

The unique id goes from rank 0 to the others over MPI (the Comm's communicator); the
NCCL communicator is made under its device. NCCL kernels of different communicators on
one device must be launched in one order on every rank, so the concurrent design, whose
lanes run at once, never uses it. NCCL 2.28 refuses two ranks on one GPU ("invalid usage";
NCCL >= 2.30 can allow it with NCCL_MULTI_RANK_GPU_ENABLE=1): transports.choose checks
before any rank tries, so no rank waits in an NCCL init that another refused.
"""
import numpy as np

from .base import Transport, register

# NCCL's datatype enum (nccl.h), which cupy.cuda.nccl exposes under these names.
_NCCL_TYPES = {'int8': 'NCCL_INT8', 'uint8': 'NCCL_UINT8', 'int32': 'NCCL_INT32',
               'uint32': 'NCCL_UINT32', 'int64': 'NCCL_INT64', 'uint64': 'NCCL_UINT64',
               'float16': 'NCCL_FLOAT16', 'float32': 'NCCL_FLOAT32', 'float64': 'NCCL_FLOAT64'}


def _nccl():
    from cupy.cuda import nccl  # optional
    if not getattr(nccl, 'available', True):
        raise ImportError('this CuPy was built without NCCL')
    return nccl


@register
class NCCL(Transport):
    name = 'nccl'
    concurrent_safe = False

    @classmethod
    def usable(cls, comm):
        try:
            _nccl()
        except ImportError as err:
            return False, 'cupy.cuda.nccl is not available (%s)' % err
        return True, ''

    def __init__(self, comm, device):
        super().__init__(comm, device)
        import cupy  # optional dependency, loaded where used
        nccl = self._lib = _nccl()
        uid = nccl.get_unique_id() if comm.rank == 0 else None
        uid = comm.mpi.bcast(uid, root=0)
        with cupy.cuda.Device(device):
            self._nccl = nccl.NcclCommunicator(comm.size, uid, comm.rank)

    def _type(self, buf):
        name = _NCCL_TYPES.get(np.dtype(buf.dtype).name)
        if name is None:
            raise TypeError('NCCL has no type for %s' % buf.dtype)
        return getattr(self._lib, name)

    def allreduce(self, buf, algorithm='mpi'):
        self._nccl.allReduce(buf.data.ptr, buf.data.ptr, buf.size, self._type(buf),
                             self._lib.NCCL_SUM, self.stream.ptr)

    def bcast(self, buf, root):
        self._nccl.bcast(buf.data.ptr, buf.size, self._type(buf), root, self.stream.ptr)

    def reduce_scatter(self, send, recv, counts):
        kind, me = self._type(send), self.comm.rank
        if len(set(counts)) == 1:   # equal pieces: NCCL's own reduce-scatter
            self._nccl.reduceScatter(send.data.ptr, recv.data.ptr, counts[0], kind,
                                     self._lib.NCCL_SUM, self.stream.ptr)
            return
        # Uneven pieces (the shares of a bucket whose size the ranks do not divide): a
        # reduce of each piece to its rank, one group, so NCCL runs them as one launch. The
        # bytes are a reduce-scatter's; only the root's receive buffer is written.
        at = 0
        self._lib.groupStart()
        try:
            for rank, count in enumerate(counts):
                if count:
                    piece = send.data.ptr + at * send.itemsize
                    self._nccl.reduce(piece, recv.data.ptr if rank == me else piece, count,
                                      kind, self._lib.NCCL_SUM, rank, self.stream.ptr)
                at += count
        finally:
            self._lib.groupEnd()

    def allgather(self, buf, counts, displs):
        kind, me = self._type(buf), self.comm.rank
        size = buf.itemsize
        if len(set(counts)) == 1 and list(displs) == [r * counts[0] for r in range(len(counts))]:
            # in place: this rank's piece sits where NCCL puts it in the result
            self._nccl.allGather(buf.data.ptr + displs[me] * size, buf.data.ptr, counts[0],
                                 kind, self.stream.ptr)
            return
        self._lib.groupStart()   # uneven pieces: a broadcast from each piece's rank
        try:
            for rank, (count, at) in enumerate(zip(counts, displs)):
                if count:
                    self._nccl.bcast(buf.data.ptr + at * size, count, kind, rank,
                                     self.stream.ptr)
        finally:
            self._lib.groupEnd()

    def alltoall(self, send, recv):
        # Bytes, so any dtype goes (NCCL has no uint16); a send to self included, as
        # NCCL's own all-to-all example does, one group so that NCCL pairs them.
        width, ptrs = send.nbytes // self.comm.size, (send.data.ptr, recv.data.ptr)
        self._lib.groupStart()
        try:
            for peer in range(self.comm.size):
                self._nccl.send(ptrs[0] + peer * width, width, self._lib.NCCL_UINT8, peer,
                                self.stream.ptr)
                self._nccl.recv(ptrs[1] + peer * width, width, self._lib.NCCL_UINT8, peer,
                                self.stream.ptr)
        finally:
            self._lib.groupEnd()

    def finish(self):
        self.stream.synchronize()
        self._nccl.check_async_error()   # an error NCCL met inside its kernels

    def free(self):
        if getattr(self, '_nccl', None) is not None:
            self._nccl.destroy()
            self._nccl = None
