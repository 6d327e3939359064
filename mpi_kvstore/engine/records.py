"""The Python side of the native engine ops (native.py, fuse.py): the table of C functions
they call through, building a record (layout.py declares it) and reading what the op took.
The negotiated designs' rounds of ready ops, and the eventfd that wakes the thread waiting
for them, are takeup.py's."""
import ctypes
import os
import threading

import numpy as np

from ..comm.mpiabi import c_api, c_datatype
from . import core as engine
from . import fuse, native
from . import layout as L  # the records' words: L.COUNT, L.A_DATA, L.F_MEMCPY...
from .arrays import copy_into
from .libmxnet import address_of

__all__ = ['CopyNow', 'fallbacks', 'mark_ready_address', 'run_chained_address',
           'follow_address', 'function_table', 'NativeOp', 'Prepared', 'ChainedPlan', 'ChainedOp',
           'KINDS']

# The collective kinds the compiled op runs, and its code for each; the others (Python
# collectives, the sharded optimizer's reduce-scatter and allgather) run in Python.
KINDS = {'allreduce': L.ALLREDUCE, 'bcast': L.BCAST, 'barrier': L.BARRIER}


class _State:
    """This process's table, and the chained ops that may hand over to Python."""

    __slots__ = ('table', 'address', 'entry', 'fallbacks', 'mark_ready')

    def __init__(self):
        self.table = None      # layout.TABLE_DTYPE in an int64 array, built on first use
        self.address = 0       # the table's address (a record's FNS word): .ctypes costs a few us a call
        self.entry = None      # the Python entry (core.python_entry) the table points to
        self.fallbacks = {}    # record address -> its ChainedOp (_on_python finishes it)
        self.mark_ready = 0    # mark_ready_address(), once known: asked on every call


_state = _State()


def fallbacks():
    """The dict of record address -> ChainedOp that a hand-over to Python finishes: an op
    taken again registers itself there (ChainedOp.again; designs/chained.py inlines it)."""
    return _state.fallbacks


def _run_in_python(address):
    op = _state.fallbacks.pop(address)   # a ChainedOp: no functools.partial made per call
    op._on_python(op)


def _address(fn):
    return ctypes.cast(fn, ctypes.c_void_p).value


def _fill(table, **entries):
    fields = table.view(L.TABLE_DTYPE)
    for name, value in entries.items():
        fields[name] = value


def function_table():
    """This process's table (int64 words, layout.TABLE_DTYPE), whose address every record
    carries; MPI's part is added once a chained op needs it, mpi4py being loaded by then."""
    if _state.table is None:
        libc = ctypes.CDLL(None)
        table = np.zeros(L.TABLE, dtype=np.int64)
        _state.entry = engine.python_entry(_run_in_python)
        cpu_context, prioritized, name = engine.native_push_constants()
        _fill(table, to_dlpack=address_of('MXNDArrayToDLPack'),
              dlpack_delete=address_of('MXNDArrayCallDLPackDeleter'),
              memcpy=_address(libc.memcpy), write=_address(libc.write),
              python=_address(_state.entry), usleep=_address(libc.usleep),
              pthread_self=_address(libc.pthread_self), push=address_of('MXEnginePushAsyncND'),
              madvise=_address(libc.madvise), cpu_context=cpu_context,
              prioritized=prioritized, name=name, one=1)
        _state.table, _state.address = table, table.ctypes.data
    return _state.table


def mark_ready_address():
    """The address of the funneled/concurrent op (native.py)."""
    if not _state.mark_ready:
        function_table()
        _state.mark_ready = native.address('mark_ready')
    return _state.mark_ready


def run_chained_address():
    """The address of the chained op (fuse.py)."""
    table = function_table()
    if not table[L.F_ALLREDUCE]:
        api = c_api()
        _fill(table, allreduce=api.allreduce, bcast=api.bcast, barrier=api.barrier,
              in_place=api.in_place, sum=api.sum, min=api.min, int32=api.int32,
              iallreduce=api.iallreduce, test=api.test)
    if not table[L.F_QUEUED]:
        table[L.F_QUEUED] = fuse.address('run_queued')
    return fuse.address('run_chained')


def follow_address():
    """The address of the op of a call that a burst's walk may run (fuse.py), which also
    links it after the op before it."""
    return fuse.address('follow')


class CopyNow:
    """Copies made at their push (native.py, copy_now): ``copy(array, out)`` fills the new
    NDArray ``out`` with ``array``'s values before it returns where ``array`` is readable
    then (nothing pending writes it) and both are row-major host memory: the collective
    pushed on ``out`` next finds it free (a burst of out-of-place calls fuses on chained).
    Else it pushes MXNet's copy into ``out`` (engine.arrays.copy_into), an op that waits for
    ``array`` as copy_of's did. One record for every copy: the op reads it only on the
    pushing thread, within the push, which holds the GIL (push.py)."""

    __slots__ = ('record', 'fn', 'param', 'reads', 'writes', 'name')

    def __init__(self):
        rec = self.record = np.zeros(L.COPY_WORDS, dtype=np.int64)
        rec[L.COPY_FNS] = _state.address or function_table().ctypes.data
        rec[L.COPY_SELF] = rec.ctypes.data
        self.fn = engine.native_fn(native.address('copy_now'))
        self.param = ctypes.c_void_p(rec.ctypes.data)
        self.reads, self.writes = _one_handle(), _one_handle()
        self.name = engine.encoded('mpi_kvstore_copy')

    def copy(self, array, out, nbytes):
        """Fill ``out`` (a new NDArray of ``array``'s shape, dtype and context: nothing
        pending on it) with ``array``'s ``nbytes``; True where done at the push."""
        rec = self.record
        src, dst = array.handle.value, out.handle.value
        rec[L.COPY_SRC], rec[L.COPY_DST], rec[L.COPY_NBYTES] = src, dst, nbytes
        rec[L.COPY_DONE] = 0
        rec[L.COPY_PUSHER] = threading.get_ident()   # pthread_self() on Linux
        self.reads.array[0], self.writes.array[0] = src, dst
        try:
            engine.push_inline_reading(self.fn, self.param, self.reads, self.writes, 0,
                                       self.name)
        finally:
            rec[L.COPY_PUSHER] = 0   # a queued one, run later elsewhere, does nothing
        if rec[L.COPY_DONE]:
            return True
        copy_into(array, out)   # after the queued op: both write ``out``
        return False


def _one_handle():
    """An engine.Handles of one handle, which the caller writes before each push."""
    handles = engine.Handles([])
    handles.count, handles.count_arg = 1, ctypes.c_int(1)
    return handles


class NativeOp:
    """The record of one engine op over ``arrays``, whose requests are ``reqs``."""

    __slots__ = ('record', 'arrays', 'reqs', 'keep', '_address')

    def __init__(self, arrays, reqs, eventfd, extra=0):
        rec = np.zeros(L.HEADER + L.SLOT * len(arrays) + extra, dtype=np.int64)
        rec[L.COUNT], rec[L.EVENTFD], rec[L.ONE] = len(arrays), eventfd, 1
        rec[L.SELF] = self._address = rec.ctypes.data
        rec[L.FNS] = _state.address or function_table().ctypes.data
        rec[L.HEADER + L.A_HANDLE:L.HEADER + L.SLOT * len(arrays):L.SLOT] = [
            a.handle.value for a in arrays]
        self.record, self.arrays, self.reqs, self.keep = rec, arrays, reqs, ()

    @property
    def address(self):
        return self._address

    def reusable(self, eventfd):
        """Whether a new op over the same arrays may take this record: every request of
        this op is done (its op ran, was taken up and completed long before), and it
        wakes the same eventfd."""
        for req in self.reqs:
            if not req.done:
                return False
        return self.record[L.EVENTFD] == eventfd

    def renew(self, reqs):
        """This record for a new op over the same arrays (see :meth:`reusable`): what the
        previous op wrote into it is cleared (its state, the engine's completion, each
        array's DLPack tensor, which a refused array leaves 0)."""
        rec = self.record
        rec[L.STATE] = L.PENDING
        if len(self.arrays) == 1:   # a word is cheaper to set than a slice
            rec[L.HEADER + L.A_MANAGED] = 0
        else:
            rec[L.HEADER + L.A_MANAGED::L.SLOT] = 0
        self.reqs = reqs

    @property
    def ready(self):
        return self.record[L.STATE] == L.READY

    @property
    def done(self):
        return self.record[L.STATE] == L.DONE

    def callback(self):
        """(callback, engine, param) of the engine's completion record."""
        rec = self.record
        return int(rec[L.CALLBACK]), int(rec[L.ENGINE]), int(rec[L.PARAM])

    def pointer(self, i):
        """(address, DLPack device type, device id) of array ``i``, as taken inside the op;
        None if the op could not read it."""
        slot = L.HEADER + L.SLOT * i
        item = self.record.item   # a Python int at once: read once per op on every call
        if not item(slot + L.A_MANAGED):   # MXNDArrayToDLPack gave no tensor
            return None
        device = item(slot + L.A_DEVICE)
        return item(slot + L.A_DATA) + item(slot + L.A_OFFSET), device & 0xffffffff, device >> 32


class Prepared:
    """What the repeated engine ops of one call over the very same arrays share (a store's
    prepared call, keys.Replay): the engine's handle array, built once, and the record of
    the last op, taken again once that op is done (:meth:`NativeOp.reusable`). ``owner``:
    the design that made it; a design takes only its own."""

    __slots__ = ('arrays', 'handles', 'owner', '_op', 'kept', 'moved')

    def __init__(self, arrays, owner):
        self.arrays, self.owner = list(arrays), owner
        self.handles = engine.Handles(self.arrays)
        self._op = None
        self.kept = None   # what the owner keeps for the repeats (the chained design's plan)
        self.moved = None  # the array of :meth:`move_to`, which requests are renewed on

    def move_to(self, array):
        """This call on ``array`` (of the same shape, dtype and place) in its one array's
        stead: an out-of-place call's new copy each call (store/collectives.py, _Copy).
        A new list, as an op in flight holds the old one (its completion keeps the array
        alive); the handle words rewritten here and in what the owner keeps
        (``kept.move_to``), which pushes read only while pushing."""
        self.moved = array
        self.arrays = [array]
        handle = array.handle.value
        self.handles.array[0] = handle
        if self.kept is not None:
            self.kept.move_to(handle)

    def op(self, reqs, eventfd):
        """The record of the next op over the arrays, for ``reqs``."""
        op = self._op
        if op is not None and op.reusable(eventfd):
            op.renew(reqs)
            if self.moved is not None:   # reusable: no op in flight reads its words
                op.arrays = self.arrays
                op.record[L.HEADER + L.A_HANDLE] = self.moved.handle.value
            return op
        op = self._op = NativeOp(self.arrays, reqs, eventfd)
        return op


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
    ``fuse``: (address, bytes) of the host buffer in which an op reduces the ops it runs
    fused with it (fuse.py), bytes 0: it runs none. A call of one allreduce bucket may do
    so (``leads``), and be run by an earlier op.
    """

    __slots__ = ('record', 'words', 'spans', 'keep', 'handles', 'nbytes', 'leads',
                 'follow_handles')

    def __init__(self, buckets, comm, message, eventfd, fusion, progress=(0, 0), poll_us=0,
                 fuse=(0, 0)):
        reqs = [r for bucket in buckets for r in bucket]
        arrays = [r.array for r in reqs if r.array is not None]
        rec = NativeOp(arrays, reqs, eventfd, extra=L.BSLOT * len(buckets)).record
        rec[L.SELF] = 0
        rec[L.COMM], rec[L.SIZE], rec[L.NBUCKETS] = comm.handle, comm.size, len(buckets)
        sleep_us, min_bytes = progress
        if sleep_us > 0:
            rec[L.PROGRESS_US] = max(1, int(sleep_us))
            rec[L.POLL_US] = max(1, int(poll_us))
        rec[L.HEADER + L.A_NBYTES:L.HEADER + L.SLOT * len(arrays):L.SLOT] = [
            r.nbytes for r in reqs if r.array is not None]
        if message is not None and comm.size > 1:
            rec[L.MSGLEN] = len(message)
            rec[L.MINE:L.MINE + L.MESSAGE_WORDS].view(np.int32)[:len(message)] = message
        keep, spans, first, start = [], [], 0, 0
        for b, bucket in enumerate(buckets):
            head = bucket[0]
            words = rec[L.HEADER + L.SLOT * len(arrays) + L.BSLOT * b:][:L.BSLOT]
            kind = KINDS[head.kind]
            arrays_here = sum(r.array is not None for r in bucket)
            nbytes = sum(r.nbytes for r in bucket)
            count = nbytes // head.dtype.itemsize if head.dtype else 0
            if kind == L.ALLREDUCE and rec[L.PROGRESS_US] and nbytes >= min_bytes:
                kind = L.ALLREDUCE_POLLED
            words[L.B_KIND], words[L.B_FIRST], words[L.B_ARRAYS], words[L.B_COUNT] = (
                kind, first, arrays_here, count)
            if head.dtype is not None:
                words[L.B_DTYPE] = c_datatype(head.dtype)
            words[L.B_ROOT] = head.root
            # the bucket's requests share average and factor (fusion._compatible)
            words[L.B_SCALE] = (L.SCALES[head.dtype] if head.average else
                                L.FACTORS[head.dtype] if head.factor != 1.0 else 0)
            words[L.B_FACTOR:L.B_FACTOR + 1].view(np.float64)[0] = head.factor
            if arrays_here > 1:
                buf = fusion(head.dtype, count)
                keep.append(buf)
                words[L.B_FUSION] = buf.ctypes.data
            first += arrays_here
            spans.append((start, start + len(bucket)))
            start += len(bucket)
        self.record, self.spans, self.keep = rec, spans, keep
        self.words = memoryview(rec)   # what ChainedOp.again copies (faster than numpy's)
        self.leads = bool(fuse[1] > 0 and rec[L.MSGLEN] and len(buckets) == 1
                          and rec[L.HEADER + L.SLOT * len(arrays) + L.B_KIND] in (
                              L.ALLREDUCE, L.ALLREDUCE_POLLED))
        if self.leads:
            rec[L.LEADS] = 1
            rec[L.FUSE_BUF], rec[L.FUSE_CAP] = fuse
        self.handles = None   # the engine's handle array, which the design builds once
        self.follow_handles = None  # the same without the chain: what ``follow`` is pushed with
        self.nbytes = sum(r.nbytes for r in reqs)   # the design decides by them whether inline


class ChainedOp(NativeOp):
    """One chained call, run by :func:`run_chained_address`: a copy of its plan's record.

    ``reqs`` in plan order; ``on_python(op)``: called on the engine thread when the op
    hands over (see layout.Stage); it must complete the op and call
    :meth:`finish_in_python`.
    """

    # Built on a call: only what the compiled op needs is made now; the buckets, which
    # only the rare Python paths read, are cut from the plan's spans when asked for. A
    # repeated call of a prepared call takes its last op's record again (:meth:`again`).
    # ``words``: the record as a memoryview, whose items read and write as Python ints in
    # a third of numpy's time: the words a call or a reap reads (issue 43)
    # ``follow``: the push of its follow op, made once (engine.inline_push), or None
    __slots__ = ('_spans', '_on_python', 'reaped', 'param', 'words', 'follow')

    def __init__(self, plan, reqs, arrays, on_python):  # (no super(): a copy)
        rec = plan.record.copy()
        self._address = rec[L.SELF] = rec.ctypes.data
        self.param = ctypes.c_void_p(self._address)   # as a push passes it (engine.push_op)
        self.record, self.arrays, self.reqs, self.keep = rec, arrays, reqs, plan.keep
        self.words, self.follow = memoryview(rec), None
        self._spans, self._on_python, self.reaped = plan.spans, on_python, False
        _state.fallbacks[self._address] = self

    def again(self, plan, reqs):
        """This op for the next call of ``plan`` (the one it was made from) with ``reqs``,
        once :meth:`forget` was called: its record copied from the plan's again, in place,
        so that its address (.ctypes, a few us) is known and no record is allocated. Safe
        as dropping it is: the reaper forgets an op only once it and every op before it are
        DONE, and no compiled code reads a record after that (fuse._complete)."""
        words = self.words
        words[:] = plan.words
        words[L.SELF] = self._address
        self.reqs, self.reaped = reqs, False
        _state.fallbacks[self._address] = self
        return self

    @property
    def buckets(self):
        """The call's requests cut into its plan's buckets."""
        return [self.reqs[a:b] for a, b in self._spans]

    @property
    def stage(self):
        """(Stage, bucket, MPI error code) of a hand-over."""
        rec = self.record
        return int(rec[L.STAGE]), int(rec[L.BUCKET]), int(rec[L.ERRCODE])

    def message(self):
        """The agreement message after the MIN (int32)."""
        words = self.record[L.MSG:L.MSG + L.MESSAGE_WORDS]
        return words.view(np.int32)[:self.record[L.MSGLEN]].copy()

    def pushed_from(self, thread, priority, after=None):
        """Pushed inline-when-ready from ``thread`` (pthread_self): on another thread the
        op goes on from the priority worker, at ``priority``; ``after``: the op its follow
        op links it after where it runs at once (then :meth:`linked_after` tells)."""
        rec = self.record
        rec[L.PUSHER], rec[L.PRIORITY] = thread, priority
        rec[L.AFTER] = 0 if after is None else after._address

    def linked_after(self, earlier):
        """Whether its follow op linked it after ``earlier`` (pushed_from's ``after``):
        False where that one's walk closed the link first (then :meth:`let_go`, and push
        it as a chained op). ``earlier``'s link is this op's once set: only the next call's
        op links there, and a walk only closes a link that is 0."""
        return earlier.record[L.NEXT] == self._address

    @property
    def started(self):
        """Its ``follow`` op ran at once: it holds the arrays for a burst's walk (fuse.py)."""
        return self.record[L.STARTED] != 0

    def let_go(self):
        """Complete its ``follow`` op, which holds its arrays, that no walk will run."""
        engine.Completion.native(*self.callback(), self.arrays).done()
        self.record[L.STARTED] = 0

    @property
    def held(self):
        """Its walk completes it: a hand-over to Python leaves that to the walk (HOLD)."""
        return self.record[L.HOLD] != 0

    def finish_in_python(self):
        self.record[L.STATE] = L.DONE
        os.eventfd_write(int(self.record[L.EVENTFD]), 1)

    def forget(self):
        """Reaped (Chained.reap): no hand-over can come, and :meth:`again` may take it."""
        _state.fallbacks.pop(self._address, None)
        self.reaped = True
