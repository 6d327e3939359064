"""The Python side of the native engine ops' records (native.py): building a record,
reading what the op took, and the eventfd that wakes the thread waiting for ops."""
import functools
import os
import select

import numpy as np

from ..comm.mpiabi import c_datatype
from .native import (
    _ARRAYS,
    _COUNT,
    _DATA,
    _DEVICE,
    _DTYPE,
    _FIRST,
    _FUSION,
    _KIND,
    _NBYTES,
    _OFFSET,
    _ROOT,
    _SCALE,
    ALLREDUCE,
    ALLREDUCE_POLLED,
    BARRIER,
    BCAST,
    BSLOT,
    BUCKET,
    CALLBACK,
    COMM,
    COUNT,
    DONE,
    ENGINE,
    ERRCODE,
    EVENTFD,
    FNS,
    HEADER,
    MINE,
    MSG,
    MSGLEN,
    NBUCKETS,
    ONE,
    PARAM,
    POLL_US,
    PRIORITY,
    PROGRESS_US,
    PUSHER,
    READY,
    SCALES,
    SELF,
    SIZE,
    SLOT,
    STAGE,
    STATE,
    _fallbacks,
    _functions,
)

__all__ = ['NativeOp', 'ChainedPlan', 'ChainedOp', 'Waker', 'KINDS']

# The collective kinds the compiled op runs, and its code for each; the others (Python
# collectives, the sharded optimizer's reduce-scatter and allgather) run in Python.
KINDS = {'allreduce': ALLREDUCE, 'bcast': BCAST, 'barrier': BARRIER}


class NativeOp:
    """The record of one engine op over ``arrays``, whose requests are ``reqs``."""

    __slots__ = ('record', 'arrays', 'reqs', 'keep')

    def __init__(self, arrays, reqs, eventfd, extra=0):
        rec = np.zeros(HEADER + SLOT * len(arrays) + extra, dtype=np.int64)
        rec[COUNT], rec[EVENTFD], rec[SELF], rec[ONE] = len(arrays), eventfd, rec.ctypes.data, 1
        rec[FNS] = _functions().ctypes.data
        rec[HEADER:HEADER + SLOT * len(arrays):SLOT] = [a.handle.value for a in arrays]
        self.record, self.arrays, self.reqs, self.keep = rec, arrays, reqs, ()

    @property
    def address(self):
        return int(self.record[SELF])

    @property
    def ready(self):
        return self.record[STATE] == READY

    @property
    def done(self):
        return self.record[STATE] == DONE

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


class ChainedPlan:
    """What every call of one shape shares: the record of its op with everything but the
    addresses filled in, its buckets as spans of the call's requests, and the fusion
    buffers it reduces in. Built once per shape (the design caches it), so a call copies
    a record instead of building one.

    ``buckets``: lists of requests as fusion.plan made them; ``message``: this rank's
    agreement message (agreement.group_message), or None when it runs alone;
    ``fusion(dtype, count)``: a host buffer for a fused bucket. Ops run one at a time
    (the chain), so every op of a plan may share its buffers. ``progress``: (longest
    sleep in us, smallest bucket in bytes) of polled allreduces (config's
    progress_sleep_us and progress_min_bytes; a sleep of 0: every MPI call blocks);
    where it polls, the agreement is polled too, with sleeps of up to ``poll_us``.
    """

    __slots__ = ('record', 'spans', 'keep', 'handles', 'nbytes')

    def __init__(self, buckets, comm, message, eventfd, fusion, progress=(0, 0), poll_us=0):
        reqs = [r for bucket in buckets for r in bucket]
        arrays = [r.array for r in reqs if r.array is not None]
        rec = NativeOp(arrays, reqs, eventfd, extra=BSLOT * len(buckets)).record
        rec[SELF] = 0
        rec[COMM], rec[SIZE], rec[NBUCKETS] = comm.handle, comm.size, len(buckets)
        sleep_us, min_bytes = progress
        if sleep_us > 0:
            rec[PROGRESS_US] = max(1, int(sleep_us))
            rec[POLL_US] = max(1, int(poll_us))
        rec[HEADER + _NBYTES:HEADER + SLOT * len(arrays):SLOT] = [
            r.nbytes for r in reqs if r.array is not None]
        if message is not None and comm.size > 1:
            rec[MSGLEN] = len(message)
            rec[MINE:MINE + 3].view(np.int32)[:] = message
        keep, spans, first, start = [], [], 0, 0
        for b, bucket in enumerate(buckets):
            head = bucket[0]
            words = rec[HEADER + SLOT * len(arrays) + BSLOT * b:][:BSLOT]
            kind = KINDS[head.kind]
            arrays_here = sum(r.array is not None for r in bucket)
            nbytes = sum(r.nbytes for r in bucket)
            count = nbytes // head.dtype.itemsize if head.dtype else 0
            if kind == ALLREDUCE and rec[PROGRESS_US] and nbytes >= min_bytes:
                kind = ALLREDUCE_POLLED
            words[_KIND], words[_FIRST], words[_ARRAYS], words[_COUNT] = (
                kind, first, arrays_here, count)
            if head.dtype is not None:
                words[_DTYPE] = c_datatype(head.dtype)
            words[_ROOT] = head.root
            words[_SCALE] = SCALES[head.dtype] if head.average else 0
            if arrays_here > 1:
                buf = fusion(head.dtype, count)
                keep.append(buf)
                words[_FUSION] = buf.ctypes.data
            first += arrays_here
            spans.append((start, start + len(bucket)))
            start += len(bucket)
        self.record, self.spans, self.keep = rec, spans, keep
        self.handles = None   # the engine's handle array, which the design builds once
        self.nbytes = sum(r.nbytes for r in reqs)   # the design decides by them whether inline


class ChainedOp(NativeOp):
    """One chained call, run by :func:`run_chained_address`: a copy of its plan's record.

    ``reqs`` in plan order; ``on_python(op)``: called on the engine thread when the op
    hands over (see :class:`Stage`); it must complete the op and call
    :meth:`finish_in_python`.
    """

    # Built on every call: only what the compiled op needs is made now; the buckets, which
    # only the rare Python paths read, are cut from the plan's spans when asked for.
    __slots__ = ('_address', '_spans')

    def __init__(self, plan, reqs, arrays, on_python):  # (no super(): a copy)
        rec = plan.record.copy()
        self._address = rec[SELF] = rec.ctypes.data
        self.record, self.arrays, self.reqs, self.keep = rec, arrays, reqs, plan.keep
        self._spans = plan.spans
        _fallbacks[self._address] = functools.partial(on_python, self)

    @property
    def address(self):
        return self._address

    @property
    def buckets(self):
        """The call's requests cut into its plan's buckets."""
        return [self.reqs[a:b] for a, b in self._spans]

    @property
    def stage(self):
        """(Stage, bucket, MPI error code) of a hand-over."""
        return int(self.record[STAGE]), int(self.record[BUCKET]), int(self.record[ERRCODE])

    def message(self):
        """The agreement message after the MIN (int32)."""
        return self.record[MSG:MSG + 3].view(np.int32).copy()

    def pushed_from(self, thread, priority):
        """Pushed inline-when-ready from ``thread`` (pthread_self): on another thread the
        op goes on from the priority worker, at ``priority``."""
        self.record[PUSHER], self.record[PRIORITY] = thread, priority

    def finish_in_python(self):
        self.record[STATE] = DONE
        os.eventfd_write(int(self.record[EVENTFD]), 1)

    def forget(self):
        _fallbacks.pop(self._address, None)


class Waker:
    """An eventfd: native ops and Python threads write it; one thread waits on it."""

    def __init__(self):
        self.fd = os.eventfd(0, os.EFD_NONBLOCK)

    def notify(self):
        os.eventfd_write(self.fd, 1)

    def wait(self, timeout=None):
        """Until written (or ``timeout`` seconds), with the GIL released; drains it.

        Non-blocking, so that where two threads wait, the one that finds the counter
        drained by the other goes back to its caller instead of blocking.
        """
        if select.select([self.fd], [], [], timeout)[0]:
            try:
                os.eventfd_read(self.fd)
            except BlockingIOError:
                pass

    def close(self):
        os.close(self.fd)
