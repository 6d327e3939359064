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
- the chained op's pieces: reading a record's arrays, an allreduce (blocking or polled),
  each bucket (fused by memcpy into a buffer Python reserved, reduced, averaged, copied
  back) and the hand-over of a rare path to Python (records.ChainedOp's ``on_python``),
  which finishes the collective exactly as its Python op would have, and completes. Its
  entry points, and the fusing of a burst, are in fuse.py.

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
SOURCES = (L, ccall, arrays, progress, agreement)


# -- compiled code ------------------------------------------------------------------------
_call_i32_2 = ccall.caller(32, (64, 64))            # MXNDArrayToDLPack(handle, out)
_call_i32_1 = ccall.caller(32, (64,))               # MXNDArrayCallDLPackDeleter, MPI_Barrier
_call_i64_3 = ccall.caller(64, (64, 64, 64))        # memcpy
_call_write = ccall.caller(64, (32, 64, 64))        # write(fd, buf, n)
_call_void_1 = ccall.caller(0, (64,))               # the Python entry (core.python_entry)
_call_allreduce = ccall.caller(32, (64, 64, 32, 64, 64, 64))
_call_iallreduce = ccall.caller(32, (64, 64, 32, 64, 64, 64, 64))
_call_madvise = ccall.caller(32, (64, 64, 32))      # madvise(addr, length, advice)
_call_bcast = ccall.caller(32, (64, 32, 64, 32, 64))
_call_self = ccall.caller(64, ())                   # pthread_self()
_call_complete = ccall.caller(0, (64, 64, 64))      # the engine's completion callback
_f32, _f64 = ccall.typed_pointer(types.float32), ccall.typed_pointer(types.float64)
_i32, _i64 = ccall.typed_pointer(types.int32), ccall.typed_pointer(types.int64)
# agreement.runs_as_offered itself, compiled: the test of the chained op's agreement.
runs_as_offered = numba.njit(agreement.runs_as_offered)


@numba.njit
def table_of(rec):
    return numba.carray(_i64(rec[L.FNS]), L.TABLE)


@numba.njit
def take_pointers(rec, count):
    """Each array's DLTensor into its slot; -> True when all are host memory."""
    fns = table_of(rec)
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
    signal(rec[L.FNS], rec[L.EVENTFD])


@numba.njit
def signal(fns, eventfd):
    """Add 1 to ``eventfd``, read from the table at ``fns``, which outlives every record:
    a completion that has marked its record DONE may no longer read it (fuse._complete)."""
    _call_write(numba.carray(_i64(fns), L.TABLE)[L.F_WRITE], (eventfd, fns + 8 * L.C_ONE, 8))


@numba.njit
def _array_address(rec, i):
    slot = L.HEADER + L.SLOT * i
    return rec[slot + L.A_DATA] + rec[slot + L.A_OFFSET]


@numba.njit
def factor_of(rec, s):
    """The float64 factor of the bucket whose words start at ``s`` (L.B_FACTOR)."""
    return numba.carray(_f64(rec[L.SELF] + 8 * (s + L.B_FACTOR)), 1)[0]


@numba.njit
def scale(ptr, count, how, size, factor):
    """Scale the sum as reduce.scale does (L.SCALES: divided by the number of ranks, then
    multiplied by ``factor``; L.FACTORS: multiplied by ``factor`` alone), in one pass: a
    float in its own precision, an integer floor-divided, then multiplied in float64 and
    truncated."""
    if how == 0:
        return
    if how == 1 or how == 5:
        a32 = numba.carray(_f32(ptr), count)
        s32 = np.float32(factor / size if how == 1 else factor)
        for i in range(count):
            a32[i] *= s32
    elif how == 2 or how == 6:
        a64 = numba.carray(_f64(ptr), count)
        s64 = factor / size if how == 2 else factor
        for i in range(count):
            a64[i] *= s64
    elif how == 3 or how == 7:
        n32 = numba.carray(_i32(ptr), count)
        for i in range(count):
            v = n32[i] // size if how == 3 else n32[i]
            n32[i] = v if factor == 1.0 else np.int32(np.float64(v) * factor)
    elif how == 4 or how == 8:
        n64 = numba.carray(_i64(ptr), count)
        for i in range(count):
            v = n64[i] // size if how == 4 else n64[i]
            n64[i] = v if factor == 1.0 else np.int64(np.float64(v) * factor)


@numba.njit
def copy_arrays(rec, first, arrays, fused, into_fused):
    fns, offset = table_of(rec), 0
    for i in range(first, first + arrays):
        nbytes = rec[L.HEADER + L.SLOT * i + L.A_NBYTES]
        if into_fused:
            _call_i64_3(fns[L.F_MEMCPY], (fused + offset, _array_address(rec, i), nbytes))
        else:
            _call_i64_3(fns[L.F_MEMCPY], (_array_address(rec, i), fused + offset, nbytes))
        offset += nbytes


@numba.njit
def copy_out(rec, s, fused, size):
    """The bucket whose words start at ``s`` scaled (scale) and copied from ``fused`` into
    its arrays: a float's multiply in the copy's one pass, as scale then copy_arrays
    would give it; an integer's division scaled in place first."""
    how, first, arrays_ = rec[s + L.B_SCALE], rec[s + L.B_FIRST], rec[s + L.B_ARRAYS]
    if how != 1 and how != 2 and how != 5 and how != 6:
        scale(fused, rec[s + L.B_COUNT], how, size, factor_of(rec, s))
        copy_arrays(rec, first, arrays_, fused, False)
        return
    factor, offset = factor_of(rec, s), 0
    for i in range(first, first + arrays_):
        nbytes = rec[L.HEADER + L.SLOT * i + L.A_NBYTES]
        if how == 1 or how == 5:
            src32, dst32 = (numba.carray(_f32(fused + offset), nbytes // 4),
                            numba.carray(_f32(_array_address(rec, i)), nbytes // 4))
            s32 = np.float32(factor / size if how == 1 else factor)
            for k in range(nbytes // 4):
                dst32[k] = src32[k] * s32
        else:
            src64, dst64 = (numba.carray(_f64(fused + offset), nbytes // 8),
                            numba.carray(_f64(_array_address(rec, i)), nbytes // 8))
            s64 = factor / size if how == 2 else factor
            for k in range(nbytes // 8):
                dst64[k] = src64[k] * s64
        offset += nbytes


@numba.njit
def allreduce(rec, ptr, count, dtype, op, comm, poll_us):
    """MPI_Allreduce in place; with poll_us > 0, MPI_Iallreduce then MPI_Test with sleeps
    of up to poll_us (progress.poll: the engine worker leaves its core to compute while it
    waits). -> MPI's error code."""
    fns = table_of(rec)
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
        fns = table_of(rec)
        _call_madvise(fns[L.F_MADVISE], (start, end - start, arrays.MADV_HUGEPAGE))
        _call_madvise(fns[L.F_MADVISE], (start, end - start, arrays.MADV_COLLAPSE))


@numba.njit
def run_bucket(rec, count, b, size, comm):
    """-> MPI's error code (0: success)."""
    fns = table_of(rec)
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
        copy_arrays(rec, first, arrays_, ptr, True)
    err = allreduce(rec, ptr, rec[s + L.B_COUNT], rec[s + L.B_DTYPE], fns[L.C_SUM], comm,
                     rec[L.PROGRESS_US] if kind == L.ALLREDUCE_POLLED else 0)
    if err != 0:
        return err
    if arrays_ > 1:
        copy_out(rec, s, ptr, size)
    else:
        scale(ptr, rec[s + L.B_COUNT], rec[s + L.B_SCALE], size, factor_of(rec, s))
    return 0


@numba.njit
def _copy_now(rec, fns):
    """copy_now's copy, where both arrays are row-major host memory (an MKLDNN layout is
    refused by MXNDArrayToDLPack): COPY_DONE 1 once copied."""
    base = rec[L.COPY_SELF]
    if _call_i32_2(fns[L.F_TO_DLPACK], (rec[L.COPY_SRC], base + 8 * L.COPY_SRC_MANAGED)) != 0:
        return
    src = numba.carray(_i64(rec[L.COPY_SRC_MANAGED]), 6)   # DLTensor: data, device .. offset
    if _call_i32_2(fns[L.F_TO_DLPACK], (rec[L.COPY_DST], base + 8 * L.COPY_DST_MANAGED)) == 0:
        dst = numba.carray(_i64(rec[L.COPY_DST_MANAGED]), 6)
        kind, dst_kind = src[1] & 0xffffffff, dst[1] & 0xffffffff
        if ((kind == _DL_CPU or kind == _DL_CUDA_HOST)
                and (dst_kind == _DL_CPU or dst_kind == _DL_CUDA_HOST)):
            _call_i64_3(fns[L.F_MEMCPY], (dst[0] + dst[5], src[0] + src[5], rec[L.COPY_NBYTES]))
            rec[L.COPY_DONE] = 1
        _call_i32_1(fns[L.F_DLPACK_DELETE], (rec[L.COPY_DST_MANAGED],))
    _call_i32_1(fns[L.F_DLPACK_DELETE], (rec[L.COPY_SRC_MANAGED],))


@numba.njit
def hand_over(rec, stage, bucket, err):
    rec[L.STAGE], rec[L.BUCKET], rec[L.ERRCODE] = stage, bucket, err
    _call_void_1(table_of(rec)[L.F_PYTHON], (rec[L.SELF],))  # finishes, completes the op


@numba.njit
def chained_record(param):
    """The whole record of a chained op, whose header says how long it is."""
    head = numba.carray(param, L.HEADER, dtype=np.int64)
    return numba.carray(param, L.HEADER + L.SLOT * head[L.COUNT] + L.BSLOT * head[L.NBUCKETS],
                        dtype=np.int64)


@numba.njit
def record_at(address):
    """The whole record of the chained op at ``address``."""
    head = numba.carray(_i64(address), L.HEADER)
    return numba.carray(_i64(address), L.HEADER + L.SLOT * head[L.COUNT]
                        + L.BSLOT * head[L.NBUCKETS])


def _entry_points(key):
    """The functions the engine calls, by name: closures over ``key`` (the source of
    SOURCES), which numba's cache keys them by."""
    def mark_ready(run_ctx, on_complete, param):
        _ = key
        count = numba.carray(param, L.HEADER, dtype=np.int64)[L.COUNT]
        rec = numba.carray(param, L.HEADER + L.SLOT * count, dtype=np.int64)
        done = numba.carray(on_complete, 3, dtype=np.int64)
        rec[L.CALLBACK], rec[L.ENGINE], rec[L.PARAM] = done[0], done[1], done[2]
        take_pointers(rec, count)
        rec[L.STATE] = L.READY
        _wake(rec)                         # wakes the communication thread

    def copy_now(run_ctx, on_complete, param):
        """Copy an array into a new one where it runs inline at its push (kAsync, the
        source readable then): an out-of-place call's copy done before its collective is
        pushed, which then finds its array free (records.CopyNow). Anywhere else (pushed
        while the source was busy) it completes doing nothing: the caller copies then."""
        _ = key
        rec = numba.carray(param, L.COPY_WORDS, dtype=np.int64)
        done = numba.carray(on_complete, 3, dtype=np.int64)
        fns = numba.carray(_i64(rec[L.COPY_FNS]), L.TABLE)
        if _call_self(fns[L.F_PTHREAD_SELF], ()) == rec[L.COPY_PUSHER]:
            _copy_now(rec, fns)
        _call_complete(done[0], (done[1], done[2], 0))

    return {'mark_ready': mark_ready, 'copy_now': copy_now}


SIGNATURE = types.void(types.voidptr, types.voidptr, types.voidptr)
_compiled = {}   # entry point name -> its numba cfunc, compiled once per process


def _source_key():
    return ccall.source_key(module.__file__ for module in SOURCES)


def address(name):
    """The address of entry point ``name``: ``mark_ready`` (funneled, concurrent; the
    chained op's are fuse.address's), compiled on first use in this process or
    loaded from numba's on-disk cache (docs/designs.md gives both costs). Each record
    carries the table its op calls through (records.function_table)."""
    if name not in _compiled:
        fn = _entry_points(_source_key())[name]
        _compiled[name] = numba.cfunc(SIGNATURE, cache=True)(fn)
    return _compiled[name].address
