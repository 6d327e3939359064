"""Engine ops with no Python in them: numba ``@cfunc`` functions that MXNet's engine calls.

As ctypes callbacks, the designs' engine ops took the GIL and built a Python
thread state on an engine worker, where the training loop's backward runs. The
functions here are machine code (numba compiles them once per process). Both
take each array's row-major pointer inside the op with ``MXNDArrayToDLPack``:
an MKLDNN-layout array is refused there, and recorded, so the pointer is never
one taken before the op ran.

- ``mark_ready`` (funneled, concurrent): marks the record ready and
  writes an eventfd. The communication thread, waiting on that eventfd with the
  GIL released, reads the record and later completes the op by calling the
  engine's callback itself.
- ``run_chained`` (chained): runs the call's collectives itself
  through MPI's C entry points (mpiabi.CApi): the agreement (an int32
  MIN-allreduce, as in agreement.py), then each bucket (fused by memcpy into a
  buffer Python reserved, reduced, averaged, copied back), then completes the
  op and writes an eventfd. Whatever it cannot do natively it hands to Python
  (records.ChainedOp's ``on_python``) at a named stage, on the same engine thread, before it
  completes: an array it could not read in place or that lives on a GPU, an
  agreement that shows a mismatch or a joined rank, an MPI error. Those are the
  rare paths; the Python side finishes the collective exactly as its Python op
  would have, and completes. Pushed inline-when-ready (kAsync), it runs on the pushing
  thread when its arrays are ready then; on any other thread (the engine's normal CPU
  worker, which runs compute) it pushes the rest of the op (``run_queued``) to the
  priority worker instead and returns (docs/designs.md, chained).
  A burst fuses: an op offers, in its agreement, the ops pushed after it whose arrays were
  free when they were pushed (``probe``, pushed just before each, runs at once exactly
  then); every rank runs the MIN of the counts offered, cut where a signature differs, as
  allreduces of up to fusion_threshold bytes, and marks each op it ran, whose own engine op
  then only completes (it runs after, behind the chain).

The records they read are declared in layout.py; records.py builds them, and the table
of C functions they call through. The negotiation thread's compiled calls over a round's
ops, called from Python, are in rounds.py.

NaiveEngine runs every op inline on the pushing thread, which holds the GIL
(libmxnet.py) and, for mark_ready, checks that the op completed before its
function returned: there the designs keep their Python op.
"""

import numba
import numpy as np
from numba import types

from ..comm import agreement, ccall, progress
from . import arrays
from . import layout as L  # the records' words: L.COUNT, L.A_DATA, L.F_MEMCPY...

__all__ = ['address']

_DL_CPU, _DL_CUDA_HOST = 1, 3         # dlpack.h's device types of host memory
# numba keys a cached function by its own file and bytecode, not by the other files whose
# constants and code it compiles in: the entry points close over these files' source
# (_entry_points), so that a change in one compiles them again instead of loading stale
# machine code. The functions they call are not cached on their own for the same reason:
# the entry points' cache holds them.
_SOURCES = (L, ccall, arrays, progress, agreement)


# -- compiled code ------------------------------------------------------------------------
_call_i32_2 = ccall.caller(32, (64, 64))            # MXNDArrayToDLPack(handle, out)
_call_i32_1 = ccall.caller(32, (64,))               # MXNDArrayCallDLPackDeleter, MPI_Barrier
_call_i64_3 = ccall.caller(64, (64, 64, 64))        # memcpy
_call_write = ccall.caller(64, (32, 64, 64))        # write(fd, buf, n)
_call_void_1 = ccall.caller(0, (64,))               # the Python entry (core.python_entry)
_call_void_3 = ccall.caller(0, (64, 64, 64))        # the engine's completion callback
_call_allreduce = ccall.caller(32, (64, 64, 32, 64, 64, 64))
_call_iallreduce = ccall.caller(32, (64, 64, 32, 64, 64, 64, 64))
_call_madvise = ccall.caller(32, (64, 64, 32))      # madvise(addr, length, advice)
_call_self = ccall.caller(64, ())                   # pthread_self()
# MXEnginePushAsyncND(fn, param, deleter, ctx, const, nconst, mutable, nmutable, prop,
# priority, name, wait)
_call_push = ccall.caller(32, (64, 64, 64, 64, 64, 32, 64, 32, 64, 32, 64, 8))
_call_bcast = ccall.caller(32, (64, 32, 64, 32, 64))
_f32, _f64 = ccall.typed_pointer(types.float32), ccall.typed_pointer(types.float64)
_i32, _i64 = ccall.typed_pointer(types.int32), ccall.typed_pointer(types.int64)
# agreement.runs_as_offered itself, compiled: the test of the chained op's agreement.
_runs_as_offered = numba.njit(agreement.runs_as_offered)


@numba.njit
def _table_of(rec):
    return numba.carray(_i64(rec[L.FNS]), L.TABLE)


@numba.njit
def _take_pointers(rec, count):
    """Each array's DLTensor into its slot; -> True when all are host memory."""
    fns = _table_of(rec)
    base, host = rec[L.SELF], True
    for i in range(count):
        slot = L.HEADER + L.SLOT * i
        if _call_i32_2(fns[L.F_TO_DLPACK], (rec[slot + L.A_HANDLE],
                                          base + 8 * (slot + L.A_MANAGED))) != 0:
            host = False        # refused (MKLDNN layout): its DLManagedTensor* stays 0
            continue
        _call_i64_3(fns[L.F_MEMCPY], (base + 8 * (slot + L.A_TENSOR), rec[slot + L.A_MANAGED],
                                    L.DL_TENSOR_BYTES))
        _call_i32_1(fns[L.F_DLPACK_DELETE], (rec[slot + L.A_MANAGED],))
        device_type = rec[slot + L.A_DEVICE] & 0xffffffff
        if device_type != _DL_CPU and device_type != _DL_CUDA_HOST:
            host = False
    return host


@numba.njit
def _wake(rec):
    _call_write(_table_of(rec)[L.F_WRITE], (rec[L.EVENTFD], rec[L.SELF] + 8 * L.ONE, 8))


@numba.njit
def _array_address(rec, i):
    slot = L.HEADER + L.SLOT * i
    return rec[slot + L.A_DATA] + rec[slot + L.A_OFFSET]


@numba.njit
def _scale(ptr, count, how, size):
    """Divide by the number of ranks as reduce.Reducer does (L.SCALES)."""
    if how == 1:
        a32 = numba.carray(_f32(ptr), count)
        s32 = np.float32(1.0 / size)
        for i in range(count):
            a32[i] *= s32
    elif how == 2:
        a64 = numba.carray(_f64(ptr), count)
        s64 = 1.0 / size
        for i in range(count):
            a64[i] *= s64
    elif how == 3:
        n32 = numba.carray(_i32(ptr), count)
        for i in range(count):
            n32[i] = n32[i] // size
    elif how == 4:
        n64 = numba.carray(_i64(ptr), count)
        for i in range(count):
            n64[i] = n64[i] // size


@numba.njit
def _copy_arrays(rec, first, arrays, fused, into_fused):
    fns, offset = _table_of(rec), 0
    for i in range(first, first + arrays):
        nbytes = rec[L.HEADER + L.SLOT * i + L.A_NBYTES]
        if into_fused:
            _call_i64_3(fns[L.F_MEMCPY], (fused + offset, _array_address(rec, i), nbytes))
        else:
            _call_i64_3(fns[L.F_MEMCPY], (_array_address(rec, i), fused + offset, nbytes))
        offset += nbytes


@numba.njit
def _allreduce(rec, ptr, count, dtype, op, comm, poll_us):
    """MPI_Allreduce in place; with poll_us > 0, MPI_Iallreduce then MPI_Test with sleeps
    of up to poll_us (progress.poll: the engine worker leaves its core to compute while it
    waits). -> MPI's error code."""
    fns = _table_of(rec)
    if poll_us <= 0:
        return _call_allreduce(fns[L.F_ALLREDUCE], (fns[L.C_IN_PLACE], ptr, count, dtype, op, comm))
    base = rec[L.SELF]
    rec[L.REQUEST] = 0
    err = _call_iallreduce(fns[L.F_IALLREDUCE], (fns[L.C_IN_PLACE], ptr, count, dtype, op, comm,
                                               base + 8 * L.REQUEST))
    if err != 0:
        return err
    return progress.poll(fns[L.F_TEST], fns[L.F_USLEEP], base + 8 * L.REQUEST, base + 8 * L.FLAG,
                         poll_us, progress.PROGRESS_TESTS, 0)


@numba.njit
def _huge_pages(rec, ptr, nbytes):
    """arrays.huge_pages in compiled code: MXNet's memory in transparent huge pages."""
    if nbytes < arrays.HUGE_MIN_BYTES:
        return
    start = (ptr + arrays.HUGE_PAGE - 1) // arrays.HUGE_PAGE * arrays.HUGE_PAGE
    end = (ptr + nbytes) // arrays.HUGE_PAGE * arrays.HUGE_PAGE
    if end > start:
        fns = _table_of(rec)
        _call_madvise(fns[L.F_MADVISE], (start, end - start, arrays.MADV_HUGEPAGE))
        _call_madvise(fns[L.F_MADVISE], (start, end - start, arrays.MADV_COLLAPSE))


@numba.njit
def _run_bucket(rec, count, b, size, comm):
    """-> MPI's error code (0: success)."""
    fns = _table_of(rec)
    s = L.HEADER + L.SLOT * count + L.BSLOT * b
    kind, first, arrays_ = rec[s + L.B_KIND], rec[s + L.B_FIRST], rec[s + L.B_ARRAYS]
    if size == 1:                   # no other rank; averaging by 1 changes nothing
        return 0
    if kind == L.BARRIER:
        return _call_i32_1(fns[L.F_BARRIER], (comm,))
    ptr = _array_address(rec, first)
    if arrays_ == 1:
        _huge_pages(rec, ptr, rec[L.HEADER + L.SLOT * first + L.A_NBYTES])
    if kind == L.BCAST:
        return _call_bcast(fns[L.F_BCAST], (ptr, rec[s + L.B_COUNT], rec[s + L.B_DTYPE],
                                          rec[s + L.B_ROOT], comm))
    if arrays_ > 1:
        ptr = rec[s + L.B_FUSION]
        _copy_arrays(rec, first, arrays_, ptr, True)
    err = _allreduce(rec, ptr, rec[s + L.B_COUNT], rec[s + L.B_DTYPE], fns[L.C_SUM], comm,
                     rec[L.PROGRESS_US] if kind == L.ALLREDUCE_POLLED else 0)
    if err != 0:
        return err
    _scale(ptr, rec[s + L.B_COUNT], rec[s + L.B_SCALE], size)
    if arrays_ > 1:
        _copy_arrays(rec, first, arrays_, ptr, False)
    return 0


@numba.njit
def _hand_over(rec, stage, bucket, err):
    rec[L.STAGE], rec[L.BUCKET], rec[L.ERRCODE] = stage, bucket, err
    _call_void_1(_table_of(rec)[L.F_PYTHON], (rec[L.SELF],))  # finishes, completes the op


@numba.njit
def _chained_record(param):
    """The whole record of a chained op, whose header says how long it is."""
    head = numba.carray(param, L.HEADER, dtype=np.int64)
    return numba.carray(param, L.HEADER + L.SLOT * head[L.COUNT] + L.BSLOT * head[L.NBUCKETS],
                        dtype=np.int64)


@numba.njit
def _record_at(address):
    """The whole record of the chained op at ``address``."""
    head = numba.carray(_i64(address), L.HEADER)
    return numba.carray(_i64(address), L.HEADER + L.SLOT * head[L.COUNT]
                        + L.BSLOT * head[L.NBUCKETS])


@numba.njit
def _messages(rec):
    """(the agreement message after the MIN, this rank's own), as int32."""
    return (rec[L.MSG:L.MSG + L.MESSAGE_WORDS].view(np.int32),
            rec[L.MINE:L.MINE + L.MESSAGE_WORDS].view(np.int32))


@numba.njit
def _offer(rec):
    """Take up the ops pushed after this one that may run with it (ABSORBABLE, arrays read
    in place), at most FUSE_OPS in all, and offer them in this rank's message."""
    mine = _messages(rec)[1]
    offered = 1
    if rec[L.LEADS] != 0:
        at = rec[L.NEXT]
        while offered < L.FUSE_OPS and at != 0:
            other = _record_at(at)
            if other[L.ABSORBABLE] == 0 or not _take_pointers(other, other[L.COUNT]):
                break
            body = L.OFFERED + 1 + L.BODY * (offered - 1)
            mine[body:body + L.BODY] = _messages(other)[1][agreement.HEADER:
                                                           agreement.HEADER + L.BODY]
            offered += 1
            at = other[L.NEXT]
    mine[L.OFFERED] = offered


@numba.njit
def _agreed(rec):
    """After the MIN: how many of the offered ops run now, this one first (0: none, Python
    decides, as for a lone op). Every active rank offered the first MIN(offered) ops, so
    each of their bodies equals this rank's exactly when all ranks sent the same: every
    rank cuts the run at the same op."""
    msg, mine = _messages(rec)
    if not _runs_as_offered(msg[:L.OFFERED], mine[:L.OFFERED]):
        return 0
    agreed = msg[L.OFFERED]
    for i in range(1, agreed):
        body = L.OFFERED + 1 + L.BODY * (i - 1)
        for w in range(body, body + L.BODY):
            if msg[w] != mine[w]:
                return i
    return agreed


@numba.njit
def _bucket_bytes(op):
    """Bytes of the one bucket of ``op`` (an op that leads or is absorbed has one)."""
    s = L.HEADER + L.SLOT * op[L.COUNT]
    first, n = op[s + L.B_FIRST], op[s + L.B_ARRAYS]
    total = 0
    for i in range(first, first + n):
        total += op[L.HEADER + L.SLOT * i + L.A_NBYTES]
    return total


@numba.njit
def _run_group(rec, start, ops, total, dtype, size, comm):
    """The single buckets of ``ops`` ops from the record at ``start`` copied one after the
    other into the fuse buffer, reduced in one allreduce, each divided as its own bucket
    says, and copied back; -> MPI's error code."""
    fns, buf = _table_of(rec), rec[L.FUSE_BUF]
    for into in (True, False):
        at, offset = start, 0
        for _ in range(ops):
            op = _record_at(at)
            s = L.HEADER + L.SLOT * op[L.COUNT]
            n = _bucket_bytes(op)
            if not into:
                _scale(buf + offset, op[s + L.B_COUNT], op[s + L.B_SCALE], size)
            _copy_arrays(op, op[s + L.B_FIRST], op[s + L.B_ARRAYS], buf + offset, into)
            offset += n
            at = op[L.NEXT]
        if into:
            err = _allreduce(rec, buf, total, dtype, fns[L.C_SUM], comm, rec[L.PROGRESS_US])
            if err != 0:
                return err
    return 0


@numba.njit
def _run_fused(rec, agreed):
    """This op and the ``agreed - 1`` ops after it (one allreduce bucket each), in runs of
    one dtype of at most FUSE_CAP bytes, one allreduce a run. Every rank cuts the same runs:
    dtypes and sizes are in the agreed signatures, the cap is the same option everywhere.
    Each absorbed op is marked for its own engine op (ABSORBED, ERRCODE); -> this op's
    MPI error code."""
    comm, size, cap = rec[L.COMM], rec[L.SIZE], rec[L.FUSE_CAP]
    own_err, start, i = 0, rec[L.SELF], 0
    while i < agreed:
        first = _record_at(start)
        s = L.HEADER + L.SLOT * first[L.COUNT]
        dtype, nbytes, total = first[s + L.B_DTYPE], _bucket_bytes(first), first[s + L.B_COUNT]
        j, at = i + 1, first[L.NEXT]
        while j < agreed:
            op = _record_at(at)
            t = L.HEADER + L.SLOT * op[L.COUNT]
            n = _bucket_bytes(op)
            if op[t + L.B_DTYPE] != dtype or nbytes + n > cap:
                break
            nbytes += n
            total += op[t + L.B_COUNT]
            j += 1
            at = op[L.NEXT]
        if j - i == 1:
            err = _run_bucket(first, first[L.COUNT], 0, size, comm)
        else:
            err = _run_group(rec, start, j - i, total, dtype, size, comm)
        mark = start
        for _ in range(j - i):
            op = _record_at(mark)
            if mark == rec[L.SELF]:
                own_err = err
            else:
                op[L.ERRCODE] = err
                op[L.ABSORBED] = L.ABSORBED_OK if err == 0 else L.ABSORBED_FAILED
            mark = op[L.NEXT]
        start, i = at, j
    rec[L.FUSED] = agreed
    return own_err


@numba.njit
def _complete(rec):
    _call_void_3(rec[L.CALLBACK], (rec[L.ENGINE], rec[L.PARAM], 0))   # complete, no error
    rec[L.STATE] = L.DONE
    _wake(rec)


@numba.njit
def _run_chained_body(rec):
    count, nbuckets = rec[L.COUNT], rec[L.NBUCKETS]
    if not _take_pointers(rec, count):
        _hand_over(rec, L.READ, -1, 0)
        return
    fns, comm = _table_of(rec), rec[L.COMM]
    agreed = 1
    if rec[L.MSGLEN] > 0:
        _offer(rec)
        rec[L.MSG:L.MSG + L.MESSAGE_WORDS] = rec[L.MINE:L.MINE + L.MESSAGE_WORDS]
        err = _allreduce(rec, rec[L.SELF] + 8 * L.MSG, rec[L.MSGLEN], fns[L.C_INT32],
                         fns[L.C_MIN], comm, rec[L.POLL_US])
        if err != 0:
            _hand_over(rec, L.MPI_ERROR, -1, err)
            return
        agreed = _agreed(rec)
        if agreed == 0:
            _hand_over(rec, L.AGREED, -1, 0)
            return
    if agreed > 1:
        err = _run_fused(rec, agreed)
        if err != 0:
            _hand_over(rec, L.MPI_ERROR, 0, err)
            return
        _complete(rec)
        return
    for b in range(nbuckets):
        err = _run_bucket(rec, count, b, rec[L.SIZE], comm)
        if err != 0:
            _hand_over(rec, L.MPI_ERROR, b, err)
            return
    _complete(rec)


@numba.njit
def _run_absorbed(rec):
    """The engine op of an op that an earlier one ran: complete it, or hand its error over."""
    if rec[L.ABSORBED] == L.ABSORBED_FAILED:
        _hand_over(rec, L.MPI_ERROR, 0, rec[L.ERRCODE])
        return
    _complete(rec)


def _entry_points(key):
    """The functions the engine calls, by name: closures over ``key`` (the source of
    _SOURCES), which numba's cache keys them by."""
    def mark_ready(run_ctx, on_complete, param):
        _ = key
        count = numba.carray(param, L.HEADER, dtype=np.int64)[L.COUNT]
        rec = numba.carray(param, L.HEADER + L.SLOT * count, dtype=np.int64)
        done = numba.carray(on_complete, 3, dtype=np.int64)
        rec[L.CALLBACK], rec[L.ENGINE], rec[L.PARAM] = done[0], done[1], done[2]
        _take_pointers(rec, count)
        rec[L.STATE] = L.READY
        _wake(rec)                         # wakes the communication thread

    def run_chained(run_ctx, on_complete, param):
        _ = key
        rec = _chained_record(param)
        done = numba.carray(on_complete, 3, dtype=np.int64)
        rec[L.CALLBACK], rec[L.ENGINE], rec[L.PARAM] = done[0], done[1], done[2]
        if rec[L.ABSORBED] != 0:      # an earlier op ran it: nothing blocks here
            _run_absorbed(rec)
            return
        if rec[L.PUSHER] != 0:
            # Pushed as kAsync: the engine runs it inline on the pushing thread when its
            # arrays were ready then, else on its normal CPU worker, which also runs
            # compute. There it must not block: the call goes on from the priority worker
            # (run_queued), holding its arrays until it completes this op.
            fns = _table_of(rec)
            if _call_self(fns[L.F_PTHREAD_SELF], ()) != rec[L.PUSHER]:
                if _call_push(fns[L.F_PUSH], (fns[L.F_QUEUED], rec[L.SELF], 0,
                                              fns[L.C_CPU_CONTEXT], 0, 0, 0, 0,
                                              fns[L.C_PRIORITIZED], rec[L.PRIORITY],
                                              fns[L.C_NAME], 0)) == 0:
                    return
        _run_chained_body(rec)

    def run_queued(run_ctx, on_complete, param):
        """The rest of a chained op that did not run inline, on the priority worker. It
        holds no arrays (the chained op does, until it completes): complete it at once."""
        _ = key
        done = numba.carray(on_complete, 3, dtype=np.int64)
        _call_void_3(done[0], (done[1], done[2], 0))
        _run_chained_body(_chained_record(param))

    def probe(run_ctx, on_complete, param):
        """Pushed with a chained op's arrays just before it: run at once on the pushing
        thread exactly when nothing reads or writes them still (kAsync), which is when
        that op's data is ready and may be run by an earlier op (PROBED)."""
        _ = key
        numba.carray(param, L.HEADER, dtype=np.int64)[L.PROBED] = 1
        done = numba.carray(on_complete, 3, dtype=np.int64)
        _call_void_3(done[0], (done[1], done[2], 0))

    return {'mark_ready': mark_ready, 'run_chained': run_chained, 'run_queued': run_queued,
            'probe': probe}


_SIGNATURE = types.void(types.voidptr, types.voidptr, types.voidptr)
_compiled = {}   # entry point name -> its numba cfunc, compiled once per process


def _source_key():
    return ccall.source_key(module.__file__ for module in _SOURCES)


def address(name):
    """The address of entry point ``name``: ``mark_ready`` (funneled, concurrent),
    ``run_chained`` or ``run_queued`` (chained), compiled on first use in this process or
    loaded from numba's on-disk cache (docs/designs.md gives both costs). Each record
    carries the table its op calls through (records.function_table)."""
    if name not in _compiled:
        fn = _entry_points(_source_key())[name]
        _compiled[name] = numba.cfunc(_SIGNATURE, cache=True)(fn)
    return _compiled[name].address
