"""The communication backend: the only module that imports mpi4py.

A :class:`Comm` owns one duplicate of the user's communicator, so library
traffic never mixes with the user's own messages. Host buffers go to MPI as
they are; GPU (CuPy) buffers go to MPI directly where the MPI is CUDA-aware,
and are staged through host memory otherwise.
"""
import ctypes
import logging
import os
import time

import numpy as np
from mpi4py import MPI

__all__ = ['Comm', 'MPI', 'thread_level_name', 'provided_thread_level', 'cuda_aware',
           'c_api', 'c_datatype']

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


class CApi:
    """MPI's C entry points and constants, from the libmpi that mpi4py loaded, for native
    ops (native.py) to call without Python. Handles are passed as 64-bit ints: MPICH's
    are C ints (mpi4py returns them sign-extended; the callee reads the low 32 bits),
    Open MPI's are pointers."""

    def __init__(self):
        lib = ctypes.CDLL(_loaded_libmpi())
        address = lambda fn: ctypes.cast(fn, ctypes.c_void_p).value  # noqa: E731
        self.allreduce = address(lib.MPI_Allreduce)
        self.bcast = address(lib.MPI_Bcast)
        self.barrier = address(lib.MPI_Barrier)
        self.in_place = int(MPI.IN_PLACE)
        self.sum = _handle(MPI.SUM)
        self.min = _handle(MPI.MIN)
        self.int32 = _handle(MPI.INT)


def _handle(obj):
    """An MPI handle as a signed 64-bit int (mpi4py gives MPICH's sign-extended, unsigned)."""
    value = MPI._handleof(obj)
    return value - (1 << 64) if value >= 1 << 63 else value


def _loaded_libmpi():
    """Path of the MPI library mapped into this process (mpi4py loads it itself)."""
    with open('/proc/self/maps') as maps:
        for line in maps:
            path = line.split()[-1]
            if os.path.basename(path).startswith('libmpi') and '.so' in path:
                return path
    raise OSError('no libmpi is mapped into this process: native ops need the MPI '
                  'library that mpi4py loaded')


_c_api = []


def c_api():
    """The :class:`CApi` of this process (built on first use)."""
    if not _c_api:
        _c_api.append(CApi())
    return _c_api[0]


def c_datatype(dtype):
    """The MPI datatype handle mpi4py uses for numpy ``dtype`` (None if it has none)."""
    datatype = MPI._typedict.get(np.dtype(dtype).char)
    return None if datatype is None else _handle(datatype)


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
        self.handle = _handle(self.mpi)   # for native ops
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
