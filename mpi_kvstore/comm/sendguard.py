"""Sends to a lost peer stay pending: libmpi's PLT slots for UCX's sends point at compiled
wrappers that turn UCX's error status into "done at once".

MPICH's UCX endpoints have no error handling: once UCX has seen a peer's connection fail, a
send to it returns an error at once, and MPICH's send then reads the request it never made
(MPICH 5.0.2: a segmentation fault inside MPI_Iallreduce, the first collective a survivor
starts on the old world after the peer's loss reached UCX and before the launcher's notice
reached the survivor). The guard makes such a send look done at once (UCX's NULL): its
collective then stays pending, waiting on the dead peer as with a peer lost silently, and
the deadline or the launcher's notice ends it (the survivor's World keeps the request).

The bottom of comm: it imports no MPI. ``mpiabi`` calls :func:`guard_if_asked` once mpi4py
has started MPI (and mapped UCX), so that every process of an elastic job is guarded before
its first collective.
"""
import ctypes
import logging
import os
import struct
import threading

__all__ = ['GUARD_ENV', 'guard_failed_sends', 'guard_if_asked', 'guarded']

GUARD_ENV = 'MPI_KVSTORE_GUARD_SENDS'   # launch.rendezvous.GUARD_ENV, which workers.py sets
_UCS_ERR_LAST = -100   # ucs_status_t: UCS_PTR_IS_ERR(p) is (uintptr_t)p >= (uintptr_t)-100
_GUARDED = {'ucp_tag_send_nbx': 5, 'ucp_tag_send_sync_nbx': 5, 'ucp_am_send_nbx': 7}
_guards: dict = {}
_GUARD_LOCK = threading.Lock()
_log = logging.getLogger(__name__)


def guard_failed_sends():
    """Make libmpi's UCX sends to a failed endpoint stay pending instead of failing (the
    module's docstring): each of ``_GUARDED`` in libmpi's PLT calls a compiled wrapper that
    hands UCX's error status back as "done at once". The names guarded (empty where this MPI
    does not use UCX, or where it cannot be done: logged); every call after the first returns
    the same."""
    with _GUARD_LOCK:
        if 'names' not in _guards:
            try:
                _guards['names'] = _install_guards()
            except Exception as exc:   # numba's errors too: the job runs unguarded
                _log.warning('mpi_kvstore: sends to a lost peer are not guarded (%s): a '
                             'survivor may crash in MPI starting a collective with it', exc)
                _guards['names'] = ()
        return _guards['names']


def guard_if_asked(environ=None):
    """:func:`guard_failed_sends` where ``environ`` (default os.environ) sets GUARD_ENV to
    '1' (launch/workers.py does for elastic workers; a user's 0 keeps it off)."""
    if (os.environ if environ is None else environ).get(GUARD_ENV) == '1':
        guard_failed_sends()


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

