"""Engine ops with no Python in them: a numba ``@cfunc`` marks a call's collectives ready.

The funneled and concurrent designs push one engine op per call whose only job
is to say "these arrays are ready" and hand over their memory. As a ctypes
callback that op took the GIL and built a Python thread state on an engine
worker, where the training loop's backward runs. The ``@cfunc`` here is machine
code (numba compiles it once per process): it reads the op's completion
record, takes each array's row-major pointer inside the op with
``MXNDArrayToDLPack`` (an MKLDNN-layout array is refused there, and recorded),
marks the record ready and writes an eventfd. The communication thread, which
waits on that eventfd with the GIL released, reads the record and later
completes the op by calling the engine's callback itself.

A record is an int64 array owned by Python until the op completes::

    [STATE, CALLBACK, ENGINE, PARAM, COUNT, EVENTFD, SELF, ONE, pad, pad,
     per array: handle, DLManagedTensor* (0: refused), DLTensor (6 words: data,
                device, ..., byte_offset)]

NaiveEngine checks that an op completed before its function returned, which an op
completed later by another thread cannot do: there the designs keep the Python op.
"""
import ctypes
import os
import select

import numpy as np

from .libmxnet import address_of

__all__ = ['NativeOp', 'Waker', 'mark_ready_address']

STATE, CALLBACK, ENGINE, PARAM, COUNT, EVENTFD, SELF, ONE = range(8)
HEADER, SLOT = 10, 8          # words before the first array; words per array
_DATA, _DEVICE, _OFFSET = 2, 3, 7   # within a slot: DLTensor.data, .device, .byte_offset
_DL_TENSOR_BYTES = 48

_I64 = ctypes.c_int64
_libc = ctypes.CDLL(None)


def _c(restype, argtypes, address):
    """A C function at ``address`` that nopython code can call (int64 addresses only)."""
    return ctypes.CFUNCTYPE(restype, *argtypes)(address)


_to_dlpack = _c(ctypes.c_int, (_I64, _I64), address_of('MXNDArrayToDLPack'))
_dlpack_delete = _c(ctypes.c_int, (_I64,), address_of('MXNDArrayCallDLPackDeleter'))
_memcpy = _c(_I64, (_I64, _I64, _I64), ctypes.cast(_libc.memcpy, ctypes.c_void_p).value)
_write = _c(_I64, (ctypes.c_int, _I64, _I64), ctypes.cast(_libc.write, ctypes.c_void_p).value)

_compiled = []


def _compile():
    import numba  # noqa: WPS433 (compiling takes seconds: only when a store needs it)
    from numba import types

    # Not cache=True: numba cannot cache code that calls ctypes globals. It compiles
    # once per process instead (0.6 s here, measured in the closing note).
    @numba.cfunc(types.void(types.voidptr, types.voidptr, types.voidptr))
    def mark_ready(run_ctx, on_complete, param):
        count = numba.carray(param, HEADER, dtype=np.int64)[COUNT]
        rec = numba.carray(param, HEADER + SLOT * count, dtype=np.int64)
        done = numba.carray(on_complete, 3, dtype=np.int64)
        rec[CALLBACK], rec[ENGINE], rec[PARAM] = done[0], done[1], done[2]
        base = rec[SELF]
        for i in range(count):
            slot = HEADER + SLOT * i
            if _to_dlpack(rec[slot], base + 8 * (slot + 1)) != 0:
                continue            # refused (MKLDNN layout): its DLManagedTensor* stays 0
            _memcpy(base + 8 * (slot + 2), rec[slot + 1], _DL_TENSOR_BYTES)
            _dlpack_delete(rec[slot + 1])
        rec[STATE] = 1
        _write(rec[EVENTFD], base + 8 * ONE, 8)   # wakes the communication thread

    return mark_ready


def mark_ready_address():
    """The cfunc's address (compiled on first use in this process)."""
    if not _compiled:
        _compiled.append(_compile())
    return _compiled[0].address


class NativeOp:
    """The record of one engine op that marks ``arrays`` ready."""

    __slots__ = ('record', 'arrays', 'reqs')

    def __init__(self, arrays, reqs, eventfd):
        rec = np.zeros(HEADER + SLOT * len(arrays), dtype=np.int64)
        rec[COUNT], rec[EVENTFD], rec[SELF], rec[ONE] = len(arrays), eventfd, rec.ctypes.data, 1
        rec[HEADER::SLOT] = [a.handle.value for a in arrays]
        self.record, self.arrays, self.reqs = rec, arrays, reqs

    @property
    def ready(self):
        return self.record[STATE] == 1

    def callback(self):
        """(callback, engine, param) of the engine's completion record."""
        return int(self.record[CALLBACK]), int(self.record[ENGINE]), int(self.record[PARAM])

    def pointer(self, i):
        """(address, DLPack device type, device id) of array ``i``, as taken inside the op;
        None if the op could not read it."""
        slot = HEADER + SLOT * i
        if not self.record[slot + 1]:   # MXNDArrayToDLPack gave no tensor
            return None
        device = int(self.record[slot + _DEVICE])
        address = int(self.record[slot + _DATA]) + int(self.record[slot + _OFFSET])
        return address, device & 0xffffffff, device >> 32


class Waker:
    """An eventfd: native ops and Python threads write it; one thread waits on it."""

    def __init__(self):
        self.fd = os.eventfd(0)

    def notify(self):
        os.eventfd_write(self.fd, 1)

    def wait(self, timeout=None):
        """Until written (or ``timeout`` seconds), with the GIL released; drains it.

        One thread waits: a blocking read when there is no timeout (one syscall),
        else select, then a read that finds the counter non-zero.
        """
        if timeout is None or select.select([self.fd], [], [], timeout)[0]:
            os.eventfd_read(self.fd)

    def close(self):
        os.close(self.fd)
