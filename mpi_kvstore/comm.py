"""The communication backend: the only module that imports mpi4py.

A :class:`Comm` owns one duplicate of the user's communicator, so library
traffic never mixes with the user's own messages. Host buffers go to MPI as
they are; GPU (CuPy) buffers go to MPI directly where the MPI is CUDA-aware,
and are staged through host memory otherwise.
"""
import logging
import time

import numpy as np
from mpi4py import MPI

__all__ = ['Comm', 'MPI', 'thread_level_name', 'provided_thread_level', 'cuda_aware']

log = logging.getLogger(__name__)

_LEVEL_NAMES = {MPI.THREAD_SINGLE: 'MPI_THREAD_SINGLE', MPI.THREAD_FUNNELED: 'MPI_THREAD_FUNNELED',
                MPI.THREAD_SERIALIZED: 'MPI_THREAD_SERIALIZED',
                MPI.THREAD_MULTIPLE: 'MPI_THREAD_MULTIPLE'}


def thread_level_name(level):
    return _LEVEL_NAMES.get(level, str(level))


def provided_thread_level():
    return MPI.Query_thread()


def cuda_aware():
    query = getattr(MPI, 'Query_cuda_support', None)
    try:
        return bool(query()) if query else False
    except MPI.Exception:
        return False


def _is_device(buf):
    return not isinstance(buf, np.ndarray)


class _Staged:
    """A GPU buffer copied to host for an MPI without CUDA support, and back."""

    def __init__(self, buf):
        self.device = buf
        self.host = buf.get()

    def back(self):
        self.device.set(self.host)


class Comm:
    """Collectives on one duplicated communicator."""

    def __init__(self, comm):
        self.mpi = comm.Dup()
        self.rank = self.mpi.Get_rank()
        self.size = self.mpi.Get_size()
        self._cuda_aware = None

    def _prepare(self, buf):
        if not _is_device(buf):
            return buf, None
        if self._cuda_aware is None:
            self._cuda_aware = cuda_aware()
        import cupy  # noqa: WPS433 (present, since buf is a CuPy array)
        # CuPy work on this buffer must be finished before MPI touches it.
        cupy.cuda.get_current_stream().synchronize()
        if self._cuda_aware:
            return buf, None
        staged = _Staged(buf)
        return staged.host, staged

    def allreduce(self, buf):
        data, staged = self._prepare(buf)
        if self.size > 1:
            self.mpi.Allreduce(MPI.IN_PLACE, data, op=MPI.SUM)
        if staged:
            staged.back()

    def bcast(self, buf, root):
        data, staged = self._prepare(buf)
        if self.size > 1:
            self.mpi.Bcast(data, root=root)
        if staged:
            staged.back()

    def barrier(self):
        self.mpi.Barrier()

    def start_min(self, msg):
        """Non-blocking elementwise MIN of an int32 message, in place."""
        return self.mpi.Iallreduce(MPI.IN_PLACE, msg, op=MPI.MIN)

    def check_min(self, msg):
        self.mpi.Allreduce(MPI.IN_PLACE, msg, op=MPI.MIN)

    def free(self):
        try:
            if not MPI.Is_finalized():
                self.mpi.Free()
        except MPI.Exception:
            log.debug('communicator free failed', exc_info=True)


def wait_polling(request, poll_us):
    """Wait for an MPI request without pinning a core: spin briefly, then sleep.

    Ranks reach a negotiation at different times; a blocking wait would spin
    a core that the other rank's backward pass needs.
    """
    start = time.perf_counter()
    sleep = 1e-6
    while not request.Test():
        if time.perf_counter() - start < 50e-6:
            continue
        time.sleep(sleep)
        sleep = min(sleep * 2, poll_us * 1e-6)
