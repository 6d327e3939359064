"""The negotiation thread's compiled calls over all the native ops of a round.

Separate from native.py because they are a different kind of compiled code with another
caller: native.py's entry points are ``@cfunc`` functions that MXNet's engine calls on its
own threads, with no Python; these are ``njit`` functions that the negotiated designs'
thread calls from Python with the GIL held, one call for a whole round instead of one per
op (take_up and complete_ops through takeup.py, gather and scatter from designs/repeat.py):

- ``take_up``: reads every op's record (what ``mark_ready`` wrote) into one row each;
- ``complete_ops``: completes their engine ops;
- ``gather`` and ``scatter``: copy a bet's data in and out through kept addresses.

They compile in only layout.py's constants and ccall.py's calls, and numba keys its
on-disk cache by their own file: they close over a key of those files' source
(_source_key), so a change there compiles them again instead of loading stale code.
"""

import ctypes

import numba
from numba import types

from ..comm import ccall
from . import layout as L  # the records' words: L.STATE, L.CALLBACK, L.A_DATA...

__all__ = ['take_up', 'complete_ops', 'gather', 'scatter', 'TAKEN']

_SOURCES = (L, ccall)

_call_i64_3 = ccall.caller(64, (64, 64, 64))        # memcpy
_call_void_3 = ccall.caller(0, (64, 64, 64))        # the engine's completion callback
_i64 = ccall.typed_pointer(types.int64)

# take_up's words of an op, one row each: its record's state, the engine's completion
# (callback, engine, param), its arrays, and its first array's pointer as records.NativeOp's
# pointer reads it (managed: 0 where MXNDArrayToDLPack refused it; address; device word).
TAKEN = ('state', 'callback', 'engine', 'param', 'count', 'managed', 'address', 'device')
_T_STATE, _T_CALLBACK, _T_ENGINE, _T_PARAM, _T_COUNT, _T_MANAGED, _T_ADDRESS, _T_DEVICE = (
    range(len(TAKEN)))


def _round_functions(key):
    """The compiled calls, by position: closures over ``key`` (the source of _SOURCES),
    which numba's cache keys them by."""
    def take_up(addresses, out):
        """Each record at ``addresses`` read into its row of ``out`` (TAKEN); -> how many are
        ready. The state is read first: mark_ready writes the rest before it."""
        _ = key
        ready = 0
        for i in range(addresses.shape[0]):
            rec = numba.carray(_i64(addresses[i]), L.HEADER + L.SLOT)
            row = out[i]
            row[_T_STATE] = rec[L.STATE]
            if row[_T_STATE] != L.READY:
                continue
            ready += 1
            row[_T_CALLBACK], row[_T_ENGINE], row[_T_PARAM] = (
                rec[L.CALLBACK], rec[L.ENGINE], rec[L.PARAM])
            row[_T_COUNT] = rec[L.COUNT]
            row[_T_MANAGED] = 0
            if rec[L.COUNT] > 0:
                row[_T_MANAGED] = rec[L.HEADER + L.A_MANAGED]
                row[_T_ADDRESS] = rec[L.HEADER + L.A_DATA] + rec[L.HEADER + L.A_OFFSET]
                row[_T_DEVICE] = rec[L.HEADER + L.A_DEVICE]
        return ready

    def complete_ops(words, rows):
        """Complete, without error, the engine ops of ``rows`` of ``words`` (take_up's)."""
        _ = key
        for i in rows:
            _call_void_3(words[i, _T_CALLBACK], (words[i, _T_ENGINE], words[i, _T_PARAM], 0))

    def gather(buf, addresses, nbytes, memcpy):
        """The memory at ``addresses`` (``nbytes`` each) one after the other into ``buf``,
        by ``memcpy`` (libc's: numba copies a slice element by element)."""
        _ = key
        at = buf.ctypes.data
        for i in range(addresses.shape[0]):
            _call_i64_3(memcpy, (at, addresses[i], nbytes[i]))
            at += nbytes[i]

    def scatter(buf, addresses, nbytes, memcpy):
        """``buf`` back to the memory at ``addresses``, as gather took it."""
        _ = key
        at = buf.ctypes.data
        for i in range(addresses.shape[0]):
            _call_i64_3(memcpy, (addresses[i], at, nbytes[i]))
            at += nbytes[i]
    return take_up, complete_ops, gather, scatter


_COPY = types.void(types.uint8[::1], types.int64[::1], types.int64[::1], types.int64)
_ROUND_SIGNATURES = (types.int64(types.int64[::1], types.int64[:, ::1]),
                     types.void(types.int64[:, ::1], types.int64[::1]), _COPY, _COPY)
_round = []      # [(take_up, complete_ops, gather, scatter)], compiled or loaded once
_memcpy = []     # libc's memcpy, by address


def _round_calls():
    if not _round:
        _memcpy.append(ctypes.cast(ctypes.CDLL(None).memcpy, ctypes.c_void_p).value)
        fns = _round_functions(_source_key())
        _round.append(tuple(numba.njit(sig, cache=True)(fn)
                            for sig, fn in zip(_ROUND_SIGNATURES, fns)))
    return _round[0]


def take_up(addresses, out):
    """Read the records at ``addresses`` (int64) into ``out`` (len(addresses) x len(TAKEN)
    int64, one row per record, see TAKEN) in one compiled call; -> how many are ready."""
    return _round_calls()[0](addresses, out)


def complete_ops(words, rows):
    """Complete the engine ops of ``rows`` (int64) of ``words`` (take_up's ``out``), without
    error, in one compiled call (the GIL held, as engine.Completion.native's callback)."""
    _round_calls()[1](words, rows)


def gather(buf, addresses, nbytes):
    """Copy host memory at ``addresses`` (int64), ``nbytes`` (int64) each, one after the
    other into ``buf`` (bytes, uint8), in one compiled call."""
    _round_calls()[2](buf, addresses, nbytes, _memcpy[0])


def scatter(buf, addresses, nbytes):
    """The reverse of :func:`gather`: ``buf`` back to the memory at ``addresses``."""
    _round_calls()[3](buf, addresses, nbytes, _memcpy[0])


def _source_key():
    return ccall.source_key(module.__file__ for module in _SOURCES)
