"""Last words: the line a rank writes when a fatal signal ends it inside MPI or the store.

A segmentation fault in MPI's transport (UCX on a connection that a cut link killed, say)
ends the process before Python runs again: the launcher reports a signal number, if it
still hears from that host at all, and nothing says what the rank was waiting for.
Python cannot run in such a handler, so the handler here is machine code (a numba
``cfunc``) that calls only async-signal-safe functions: ``write``, ``creat``, ``close``,
``sigaction`` and ``raise``. It writes

    mpi_kvstore: rank 0 of 2 on h0 (pid 4242): Segmentation fault (signal 11) inside MPI
    or the store; at the stall inspector's last look (every 1 s) this rank had pushed 12
    collectives, the newest it saw collective #11 (allreduce of key 3, ...); it waited
    on none

to stderr and, under the supervisor, to ``fatal.<rank>.txt`` in its folder
(supervision.FATAL: the launcher loses a cut host's output, the supervisor reads the
file), then puts back the handler it replaced and raises the signal again. That handler is Python's faulthandler,
enabled here first, which prints every thread's Python stack and hands on to the
default action: the process dies of its signal (not through MXNet's handler, which
calls exit() and can hang there).

The text after the semicolon is what the stall inspector last saw (:func:`say`, from its
thread, at most once a period). It sits in one of two fixed buffers; the handler reads
the address and length the last ``say`` published, so a signal during a ``say`` writes
the old line or the new one, at worst cut short, and never reads outside a buffer.
"""
import ctypes
import faulthandler
import os
import signal
import threading

import llvmlite.binding as llvm
import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ..launch import supervision

__all__ = ['install', 'say', 'installed', 'SIGNALS']

# What a fault or a library's abort raises; SIGKILL and SIGTERM cannot or need not be caught.
SIGNALS = (signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT)
TEXT_BYTES = 2048          # per buffer; a longer line is cut
_NSIG = 65
_SIGACTION_BYTES = 256     # room for one struct sigaction (glibc: 152 bytes on LP64)
_PREFIX_BYTES = 256        # per signal: the line up to the inspector's words
_SA_FLAGS_AT = 136         # glibc LP64: handler (8), sa_mask (128), then sa_flags
_SA_ONSTACK, _SA_NODEFER = 0x08000000, 0x40000000
_SYMBOL = 'mpi_kvstore_last_words'   # the table's address, for the compiled handler
# Table words (int64):
(_WRITE, _SIGACTION, _RAISE, _CREAT, _CLOSE, _OLD, _PREFIXES, _PREFIX_LENGTHS, _TEXT,
 _TEXT_LENGTH, _RECORD_PATH, _TABLE) = range(12)

_lock = threading.Lock()
_state = {}   # what the handler reads must live as long as the process: held here


# -- the handler (compiled once, cached on disk by numba, loaded by install) --------------
@intrinsic
def _table_address(typingctx):
    """The address llvm.add_symbol gave _SYMBOL: the table lives in this process's memory,
    and the cached machine code finds it by name, not by a constant."""
    def codegen(context, builder, signature, args):
        table = builder.module.globals.get(_SYMBOL)
        if table is None:
            table = ir.GlobalVariable(builder.module, ir.IntType(64), name=_SYMBOL)
            table.linkage = 'external'
        return builder.ptrtoint(table, ir.IntType(64))
    return types.int64(), codegen


@intrinsic
def _call(typingctx, fn, a, b, c):
    """The C function at address ``fn`` with three integer (or pointer) arguments; the
    functions called take at most three, and extra register arguments are ignored."""
    def codegen(context, builder, signature, args):
        fnty = ir.FunctionType(ir.IntType(64), [ir.IntType(64)] * 3)
        return builder.call(builder.inttoptr(args[0], fnty.as_pointer()), list(args[1:]))
    return types.int64(types.int64, types.int64, types.int64, types.int64), codegen


@intrinsic
def _int64_pointer(typingctx, address):
    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))
    return types.CPointer(types.int64)(types.int64), codegen


def _handler(signum):
    table = numba.carray(_int64_pointer(_table_address()), _TABLE)
    prefix = table[_PREFIXES] + signum * _PREFIX_BYTES
    prefix_length = numba.carray(_int64_pointer(table[_PREFIX_LENGTHS]), _NSIG)[signum]
    text, length = table[_TEXT], table[_TEXT_LENGTH]
    _call(table[_WRITE], 2, prefix, prefix_length)
    _call(table[_WRITE], 2, text, length)
    if table[_RECORD_PATH]:
        fd = _call(table[_CREAT], table[_RECORD_PATH], 0o644, 0)
        if fd >= 0:
            _call(table[_WRITE], fd, prefix, prefix_length)
            _call(table[_WRITE], fd, text, length)
            _call(table[_CLOSE], fd, 0, 0)
    # The replaced handler takes over as the signal arrives again (SA_NODEFER).
    _call(table[_SIGACTION], signum, table[_OLD] + signum * _SIGACTION_BYTES, 0)
    _call(table[_RAISE], signum, 0, 0)


# -- Python's side ------------------------------------------------------------------------
def installed():
    return bool(_state)


def install(rank, size, host):
    """Enable faulthandler and this handler for SIGNALS, once per process. Under the
    supervisor the line also goes to supervision.FATAL % rank in its folder."""
    with _lock:
        if _state:
            return
        libc = ctypes.CDLL(None, use_errno=True)
        libc.sigaction.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        _stack_faulthandler(libc.sigaction)
        table = np.zeros(_TABLE, dtype=np.int64)
        llvm.add_symbol(_SYMBOL, table.ctypes.data)
        table[[_WRITE, _SIGACTION, _RAISE, _CREAT, _CLOSE]] = [
            _address(libc.write), _address(libc.sigaction), _address(libc['raise']),
            _address(libc.creat), _address(libc.close)]
        old = np.zeros((_NSIG, _SIGACTION_BYTES), dtype=np.uint8)
        prefixes, lengths = _prefixes(rank, size, host)
        texts = np.zeros((2, TEXT_BYTES), dtype=np.uint8)
        table[[_OLD, _PREFIXES, _PREFIX_LENGTHS]] = [
            old.ctypes.data, prefixes.ctypes.data, lengths.ctypes.data]
        folder = supervision.active()
        path = None
        if folder:
            path = np.frombuffer(os.path.join(folder, supervision.FATAL % rank).encode() + b'\0',
                                 dtype=np.uint8).copy()
            table[_RECORD_PATH] = path.ctypes.data
        _state.update(table=table, old=old, prefixes=prefixes, lengths=lengths, texts=texts,
                      path=path, slot=0, libc=libc)
        _publish('the stall inspector had not looked yet (or does not run: stall_warning and '
                 'stall_abort are 0)')
        action = np.zeros(_SIGACTION_BYTES, dtype=np.uint8)
        # Compiled (or loaded from numba's cache) only now: linking needs _SYMBOL defined.
        handler = numba.cfunc(types.void(types.int32), cache=True)(_handler)
        _state['handler'] = handler
        action[:8] = np.frombuffer(np.int64(handler.address).tobytes(), dtype=np.uint8)
        action[_SA_FLAGS_AT:_SA_FLAGS_AT + 4] = np.frombuffer(
            np.int32(_SA_ONSTACK | _SA_NODEFER).tobytes(), dtype=np.uint8)
        for sig in SIGNALS:
            if libc.sigaction(int(sig), action.ctypes.data, old[int(sig)].ctypes.data) != 0:
                raise OSError(ctypes.get_errno(), 'sigaction(%s) failed' % sig.name)


def _stack_faulthandler(sigaction):
    """faulthandler, enabled now, on top of the default action. Not on top of what other
    libraries installed: MXNet's handler prints 'Segmentation fault: 11' and calls exit(),
    whose atexit handlers and engine threads hung a chained store's rank that had faulted
    (90 s, until the test's timeout). A faulted rank must die of its signal, which the
    launcher reports and which ends the job."""
    faulthandler.disable()   # one enabled earlier may sit under another library's handler
    default = np.zeros(_SIGACTION_BYTES, dtype=np.uint8)   # SIG_DFL, no flags
    for sig in SIGNALS:
        sigaction(int(sig), default.ctypes.data, None)
    faulthandler.enable(all_threads=True)


def say(text):
    """What the handler writes after the prefix, from now on (a no-op before install)."""
    with _lock:
        if _state:
            _publish(text)


def _publish(text):
    data = (text.rstrip('\n') + '\n').encode('utf-8', 'replace')[:TEXT_BYTES]
    slot = 1 - _state['slot']   # the one the handler is not pointed at
    texts, table = _state['texts'], _state['table']
    texts[slot, :len(data)] = np.frombuffer(data, dtype=np.uint8)
    table[_TEXT_LENGTH] = 0                   # never a length longer than the text it meets
    table[_TEXT] = texts[slot].ctypes.data
    table[_TEXT_LENGTH] = len(data)
    _state['slot'] = slot


def _prefixes(rank, size, host):
    prefixes = np.zeros((_NSIG, _PREFIX_BYTES), dtype=np.uint8)
    lengths = np.zeros(_NSIG, dtype=np.int64)
    for sig in SIGNALS:
        line = ('mpi_kvstore: rank %d of %d on %s (pid %d): %s (signal %d) inside MPI or the '
                'store; ' % (rank, size, host, os.getpid(), signal.strsignal(sig), sig))
        data = line.encode("utf-8", "replace")[:_PREFIX_BYTES]
        prefixes[int(sig), :len(data)] = np.frombuffer(data, dtype=np.uint8)
        lengths[int(sig)] = len(data)
    return prefixes, lengths


def _address(fn):
    return ctypes.cast(fn, ctypes.c_void_p).value
