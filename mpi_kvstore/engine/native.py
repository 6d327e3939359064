"""Engine ops with no Python in them: numba ``@cfunc`` functions that MXNet's engine calls.

As ctypes callbacks, the designs' engine ops took the GIL and built a Python
thread state on an engine worker, where the training loop's backward runs. The
functions here are machine code (numba compiles them once per process). Both
take each array's row-major pointer inside the op with ``MXNDArrayToDLPack``:
an MKLDNN-layout array is refused there, and recorded, so the pointer is never
one taken before the op ran.

- :func:`mark_ready_address` (funneled, concurrent): marks the record ready and
  writes an eventfd. The communication thread, waiting on that eventfd with the
  GIL released, reads the record and later completes the op by calling the
  engine's callback itself.
- :func:`run_chained_address` (chained): runs the call's collectives itself
  through MPI's C entry points (mpiabi.CApi): the agreement (an int32
  MIN-allreduce, as in agreement.py), then each bucket (fused by memcpy into a
  buffer Python reserved, reduced, averaged, copied back), then completes the
  op and writes an eventfd. Whatever it cannot do natively it hands to Python
  (native_records.ChainedOp's ``on_python``) at a named stage, on the same engine thread, before it
  completes: an array it could not read in place or that lives on a GPU, an
  agreement that shows a mismatch or a joined rank, an MPI error. Those are the
  rare paths; the Python side finishes the collective exactly as its Python op
  would have, and completes. Pushed inline-when-ready (kAsync), it runs on the pushing
  thread when its arrays are ready then; on any other thread (the engine's normal CPU
  worker, which runs compute) it pushes :func:`_run_queued` to the priority worker instead
  and returns, and the body runs there (docs/designs.md, chained).

A record is an int64 array owned by Python until the op completes::

    [header (HEADER words: see the names below),
     per array (SLOT words): handle, DLManagedTensor* (0: refused),
         DLTensor (6 words: data, device, ..., byte_offset), nbytes,
     per bucket (BSLOT words, chained only): kind, first array, arrays, count,
         MPI datatype, root, scale, fusion buffer address]

native_records.py holds the Python side of a record (NativeOp, ChainedPlan, ChainedOp).

NaiveEngine runs every op inline on the pushing thread, which holds the GIL
(libmxnet.py) and, for mark_ready, checks that the op completed before its
function returned: there the designs keep their Python op.
"""
import ctypes
import enum

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ..comm import agreement  # agreement.HEADER: a constant of the message format
from ..comm.mpiabi import c_api
from . import core as engine
from .libmxnet import address_of

__all__ = ['mark_ready_address', 'run_chained_address', 'SCALES', 'Stage']

# Header words. ONE holds 1 (what an eventfd write adds); MSG and MINE hold 6 int32
# each: the agreement message after the MIN, and this rank's own. POLL_US: the longest
# sleep between polls of the agreement (0: a blocking MPI_Allreduce); PROGRESS_US: the
# same for a polled bucket (ALLREDUCE_POLLED); REQUEST, FLAG and STATUS (8 words) are
# where MPI_Iallreduce and MPI_Test write.
(STATE, CALLBACK, ENGINE, PARAM, COUNT, EVENTFD, SELF, ONE, COMM, SIZE, NBUCKETS, STAGE,
 BUCKET, ERRCODE, MSGLEN, FNS) = range(16)
MSG, MINE = 16, 20
POLL_US, PROGRESS_US, REQUEST, FLAG, STATUS = 24, 25, 26, 27, 28
# PUSHER: pthread_self() of the thread that pushed a chained op pushed inline-when-ready
# (0: pushed to the priority worker); PRIORITY: the call's priority, for a re-push.
PUSHER, PRIORITY = 36, 37
HEADER = 38
SLOT = 9                              # words per array
_DATA, _DEVICE, _OFFSET, _NBYTES = 2, 3, 7, 8   # within a slot
BSLOT = 8                             # words per bucket
_KIND, _FIRST, _ARRAYS, _COUNT, _DTYPE, _ROOT, _SCALE, _FUSION = range(BSLOT)
_DL_TENSOR_BYTES = 48
_DL_CPU, _DL_CUDA_HOST = 1, 3

PENDING, READY, DONE = 0, 1, 2        # STATE
ALLREDUCE, BCAST, BARRIER, ALLREDUCE_POLLED = 0, 1, 2, 3   # bucket kinds
# A polled wait first calls MPI_Test SPIN_TESTS times in a row (the other ranks are
# often there already), then sleeps, doubling from 1 us up to its limit, and calls
# MPI_Test up to TESTS_PER_WAKE times after each sleep (= progress.PROGRESS_TESTS, a test checks: MPICH
# moves a bounded amount of data per Test).
SPIN_TESTS, TESTS_PER_WAKE = 32, 8
# How an averaged bucket is divided by the number of ranks, by dtype (as reduce.Reducer does:
# floats multiply by 1/size in their own precision, integers floor-divide).
SCALES = {np.dtype(np.float32): 1, np.dtype(np.float64): 2, np.dtype(np.int32): 3,
          np.dtype(np.int64): 4}


# arrays.huge_pages' constants, written here because numba's cache of this file cannot see
# a change in another (tests/test_units.py checks they agree).
HUGE_PAGE, HUGE_MIN_BYTES, MADV_HUGEPAGE, MADV_COLLAPSE = 2 << 20, 4 << 20, 14, 25

# Why a chained op handed its collective to Python (the record's STAGE word):
READ = 1       # an array was refused by MXNDArrayToDLPack, or is not host memory
AGREED = 2     # the agreement found a mismatch or a joined rank; MSG holds it
MPI_ERROR = 3  # an MPI call returned ERRCODE at bucket BUCKET (-1: the agreement)


class Stage(enum.IntEnum):
    """The STAGE word's values, for Python."""
    READ = READ
    AGREED = AGREED
    MPI_ERROR = MPI_ERROR


# -- the table of C functions and MPI constants the compiled code calls ---------------
# Compiled code holds no address of this process: it reads them from the table whose
# address every record carries (FNS), so numba caches it on disk (cache=True) and a
# process loads it instead of compiling it (see _compile).
(F_TO_DLPACK, F_DLPACK_DELETE, F_MEMCPY, F_WRITE, F_PYTHON, F_ALLREDUCE, F_BCAST, F_BARRIER,
 C_IN_PLACE, C_SUM, C_MIN, C_INT32, F_USLEEP, F_IALLREDUCE, F_TEST, F_PTHREAD_SELF, F_PUSH,
 C_CPU_CONTEXT, C_PRIORITIZED, C_NAME, F_QUEUED, F_MADVISE, TABLE) = range(23)

_table = []        # [the table (int64 array), what keeps its entries alive]
_fallbacks = {}    # record address -> what finishes its op in Python


def _run_in_python(address):
    _fallbacks.pop(address)()


def _address(fn):
    return ctypes.cast(fn, ctypes.c_void_p).value


def _functions():
    """The address of this process's table (built on first use; MPI's part once a chained
    op needs it, mpi4py being loaded by then)."""
    if not _table:
        libc = ctypes.CDLL(None)
        table = np.zeros(TABLE, dtype=np.int64)
        entry = engine.python_entry(_run_in_python)
        table[[F_TO_DLPACK, F_DLPACK_DELETE, F_MEMCPY, F_WRITE, F_PYTHON, F_USLEEP,
               F_PTHREAD_SELF, F_PUSH]] = [
            address_of('MXNDArrayToDLPack'), address_of('MXNDArrayCallDLPackDeleter'),
            _address(libc.memcpy), _address(libc.write), _address(entry), _address(libc.usleep),
            _address(libc.pthread_self), address_of('MXEnginePushAsyncND')]
        table[F_MADVISE] = _address(libc.madvise)
        table[[C_CPU_CONTEXT, C_PRIORITIZED, C_NAME]] = engine.native_push_constants()
        _table.extend([table, entry])
    return _table[0]


def _add_mpi(table):
    if not table[F_ALLREDUCE]:
        api = c_api()
        table[[F_ALLREDUCE, F_BCAST, F_BARRIER, C_IN_PLACE, C_SUM, C_MIN, C_INT32,
               F_IALLREDUCE, F_TEST]] = [
            api.allreduce, api.bcast, api.barrier, api.in_place, api.sum, api.min, api.int32,
            api.iallreduce, api.test]


# -- compiled code ------------------------------------------------------------------------
def _caller(ret_bits, arg_bits):
    """An intrinsic ``call(fn, (args...))``: the C function at address ``fn``, taking C
    integers (or pointers) of ``arg_bits`` bits and returning ``ret_bits`` (0: void),
    called with int64 arguments; -> int64 (0 for void). MPICH's handles are C ints
    passed in 64-bit registers, as ctypes passes them (mpiabi.CApi)."""
    @intrinsic
    def call(typingctx, fn, args):
        if not isinstance(args, types.BaseTuple) or len(args) != len(arg_bits):
            return None
        sig = types.int64(types.int64, args)

        def codegen(context, builder, signature, llargs):
            values = cgutils.unpack_tuple(builder, llargs[1], len(arg_bits))
            c_args = []
            for value, ty, bits in zip(values, signature.args[1], arg_bits):
                value = context.cast(builder, value, ty, types.int64)
                c_args.append(builder.trunc(value, ir.IntType(bits)) if bits < 64 else value)
            ret = ir.VoidType() if not ret_bits else ir.IntType(ret_bits)
            fnty = ir.FunctionType(ret, [ir.IntType(b) for b in arg_bits])
            result = builder.call(builder.inttoptr(llargs[0], fnty.as_pointer()), c_args)
            if not ret_bits:
                return ir.Constant(ir.IntType(64), 0)
            return builder.sext(result, ir.IntType(64)) if ret_bits < 64 else result
        return sig, codegen
    return call


def _typed_pointer(dtype):
    """An intrinsic that turns an int64 address into a ``dtype`` pointer (for carray)."""
    @intrinsic
    def pointer(typingctx, address):
        sig = types.CPointer(dtype)(types.int64)

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(signature.return_type))
        return sig, codegen
    return pointer


_call_i32_2 = _caller(32, (64, 64))                 # MXNDArrayToDLPack(handle, out)
_call_i32_1 = _caller(32, (64,))                    # MXNDArrayCallDLPackDeleter, MPI_Barrier
_call_i64_3 = _caller(64, (64, 64, 64))             # memcpy
_call_write = _caller(64, (32, 64, 64))             # write(fd, buf, n)
_call_void_1 = _caller(0, (64,))                    # the Python entry (engine.python_entry)
_call_void_3 = _caller(0, (64, 64, 64))             # the engine's completion callback
_call_allreduce = _caller(32, (64, 64, 32, 64, 64, 64))
_call_iallreduce = _caller(32, (64, 64, 32, 64, 64, 64, 64))
_call_test = _caller(32, (64, 64, 64))              # MPI_Test(request*, flag*, status*)
_call_usleep = _caller(32, (32,))
_call_madvise = _caller(32, (64, 64, 32))           # madvise(addr, length, advice)
_call_self = _caller(64, ())                        # pthread_self()
# MXEnginePushAsyncND(fn, param, deleter, ctx, const, nconst, mutable, nmutable, prop,
# priority, name, wait)
_call_push = _caller(32, (64, 64, 64, 64, 64, 32, 64, 32, 64, 32, 64, 8))
_call_bcast = _caller(32, (64, 32, 64, 32, 64))
_f32, _f64 = _typed_pointer(types.float32), _typed_pointer(types.float64)
_i32, _i64 = _typed_pointer(types.int32), _typed_pointer(types.int64)


@numba.njit(cache=True)
def _table_of(rec):
    return numba.carray(_i64(rec[FNS]), TABLE)


@numba.njit(cache=True)
def _take_pointers(rec, count):
    """Each array's DLTensor into its slot; -> True when all are host memory."""
    fns = _table_of(rec)
    base, host = rec[SELF], True
    for i in range(count):
        slot = HEADER + SLOT * i
        if _call_i32_2(fns[F_TO_DLPACK], (rec[slot], base + 8 * (slot + 1))) != 0:
            host = False        # refused (MKLDNN layout): its DLManagedTensor* stays 0
            continue
        _call_i64_3(fns[F_MEMCPY], (base + 8 * (slot + 2), rec[slot + 1], _DL_TENSOR_BYTES))
        _call_i32_1(fns[F_DLPACK_DELETE], (rec[slot + 1],))
        device_type = rec[slot + _DEVICE] & 0xffffffff
        if device_type != _DL_CPU and device_type != _DL_CUDA_HOST:
            host = False
    return host


@numba.njit(cache=True)
def _wake(rec):
    _call_write(_table_of(rec)[F_WRITE], (rec[EVENTFD], rec[SELF] + 8 * ONE, 8))


def _mark_ready(run_ctx, on_complete, param):
    count = numba.carray(param, HEADER, dtype=np.int64)[COUNT]
    rec = numba.carray(param, HEADER + SLOT * count, dtype=np.int64)
    done = numba.carray(on_complete, 3, dtype=np.int64)
    rec[CALLBACK], rec[ENGINE], rec[PARAM] = done[0], done[1], done[2]
    _take_pointers(rec, count)
    rec[STATE] = READY
    _wake(rec)                         # wakes the communication thread


@numba.njit(cache=True)
def _array_address(rec, i):
    slot = HEADER + SLOT * i
    return rec[slot + _DATA] + rec[slot + _OFFSET]


@numba.njit(cache=True)
def _scale(ptr, count, how, size):
    """Divide by the number of ranks as reduce.Reducer does (SCALES)."""
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


@numba.njit(cache=True)
def _copy_arrays(rec, first, arrays, fused, into_fused):
    fns, offset = _table_of(rec), 0
    for i in range(first, first + arrays):
        nbytes = rec[HEADER + SLOT * i + _NBYTES]
        if into_fused:
            _call_i64_3(fns[F_MEMCPY], (fused + offset, _array_address(rec, i), nbytes))
        else:
            _call_i64_3(fns[F_MEMCPY], (_array_address(rec, i), fused + offset, nbytes))
        offset += nbytes


@numba.njit(cache=True)
def _allreduce(rec, ptr, count, dtype, op, comm, poll_us):
    """MPI_Allreduce in place; with poll_us > 0, MPI_Iallreduce then MPI_Test with sleeps
    of up to poll_us (the engine worker leaves its core to compute while it waits, as
    progress.wait_polling does in Python). -> MPI's error code."""
    fns = _table_of(rec)
    if poll_us <= 0:
        return _call_allreduce(fns[F_ALLREDUCE], (fns[C_IN_PLACE], ptr, count, dtype, op, comm))
    base = rec[SELF]
    rec[REQUEST] = 0
    err = _call_iallreduce(fns[F_IALLREDUCE], (fns[C_IN_PLACE], ptr, count, dtype, op, comm,
                                               base + 8 * REQUEST))
    if err != 0:
        return err
    tests, sleep = SPIN_TESTS, 1
    while True:
        for _ in range(tests):
            rec[FLAG] = 0
            err = _call_test(fns[F_TEST], (base + 8 * REQUEST, base + 8 * FLAG, base + 8 * STATUS))
            if err != 0:
                return err
            if rec[FLAG] & 0xffffffff:
                return 0
        _call_usleep(fns[F_USLEEP], (sleep,))
        sleep = min(2 * sleep, poll_us)
        tests = TESTS_PER_WAKE


@numba.njit(cache=True)
def _huge_pages(rec, ptr, nbytes):
    """arrays.huge_pages in compiled code: MXNet's memory in transparent huge pages."""
    if nbytes < HUGE_MIN_BYTES:
        return
    start = (ptr + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    end = (ptr + nbytes) // HUGE_PAGE * HUGE_PAGE
    if end > start:
        fns = _table_of(rec)
        _call_madvise(fns[F_MADVISE], (start, end - start, MADV_HUGEPAGE))
        _call_madvise(fns[F_MADVISE], (start, end - start, MADV_COLLAPSE))


@numba.njit(cache=True)
def _run_bucket(rec, count, b, size, comm):
    """-> MPI's error code (0: success)."""
    fns = _table_of(rec)
    s = HEADER + SLOT * count + BSLOT * b
    kind, first, arrays = rec[s + _KIND], rec[s + _FIRST], rec[s + _ARRAYS]
    if size == 1:                   # no other rank; averaging by 1 changes nothing
        return 0
    if kind == BARRIER:
        return _call_i32_1(fns[F_BARRIER], (comm,))
    ptr = _array_address(rec, first)
    if arrays == 1:
        _huge_pages(rec, ptr, rec[HEADER + SLOT * first + _NBYTES])
    if kind == BCAST:
        return _call_bcast(fns[F_BCAST], (ptr, rec[s + _COUNT], rec[s + _DTYPE],
                                          rec[s + _ROOT], comm))
    if arrays > 1:
        ptr = rec[s + _FUSION]
        _copy_arrays(rec, first, arrays, ptr, True)
    err = _allreduce(rec, ptr, rec[s + _COUNT], rec[s + _DTYPE], fns[C_SUM], comm,
                     rec[PROGRESS_US] if kind == ALLREDUCE_POLLED else 0)
    if err != 0:
        return err
    _scale(ptr, rec[s + _COUNT], rec[s + _SCALE], size)
    if arrays > 1:
        _copy_arrays(rec, first, arrays, ptr, False)
    return 0


@numba.njit(cache=True)
def _hand_over(rec, stage, bucket, err):
    rec[STAGE], rec[BUCKET], rec[ERRCODE] = stage, bucket, err
    _call_void_1(_table_of(rec)[F_PYTHON], (rec[SELF],))  # finishes, completes the op


@numba.njit(cache=True)
def _runs_as_offered(msg, mine):
    """agreement.runs_as_offered, here because numba's cache of this file cannot see a
    change in another (tests/test_agreement.py checks the two agree)."""
    if msg[0] != 1:
        return False
    for i in range(agreement.HEADER, len(msg)):
        if msg[i] != mine[i]:
            return False
    return True


@numba.njit(cache=True)
def _chained_record(param):
    """The whole record of a chained op, whose header says how long it is."""
    head = numba.carray(param, HEADER, dtype=np.int64)
    return numba.carray(param, HEADER + SLOT * head[COUNT] + BSLOT * head[NBUCKETS],
                        dtype=np.int64)


def _run_chained(run_ctx, on_complete, param):
    rec = _chained_record(param)
    done = numba.carray(on_complete, 3, dtype=np.int64)
    rec[CALLBACK], rec[ENGINE], rec[PARAM] = done[0], done[1], done[2]
    if rec[PUSHER] != 0:
        # Pushed as kAsync: the engine runs it inline on the pushing thread when its arrays
        # were ready then, else on its normal CPU worker, which also runs compute. There it
        # must not block: the call goes on from the priority worker, holding its arrays
        # until it completes this op.
        fns = _table_of(rec)
        if _call_self(fns[F_PTHREAD_SELF], ()) != rec[PUSHER]:
            if _call_push(fns[F_PUSH], (fns[F_QUEUED], rec[SELF], 0, fns[C_CPU_CONTEXT], 0, 0,
                                        0, 0, fns[C_PRIORITIZED], rec[PRIORITY], fns[C_NAME],
                                        0)) == 0:
                return
    _run_chained_body(rec)


def _run_queued(run_ctx, on_complete, param):
    """The rest of a chained op that did not run inline, on the priority worker. It holds
    no arrays (the chained op does, until it completes): complete it at once."""
    done = numba.carray(on_complete, 3, dtype=np.int64)
    _call_void_3(done[0], (done[1], done[2], 0))
    _run_chained_body(_chained_record(param))


@numba.njit(cache=True)
def _run_chained_body(rec):
    count, nbuckets = rec[COUNT], rec[NBUCKETS]
    if not _take_pointers(rec, count):
        _hand_over(rec, READ, -1, 0)
        return
    fns, comm = _table_of(rec), rec[COMM]
    if rec[MSGLEN] > 0:
        rec[MSG:MSG + 3] = rec[MINE:MINE + 3]
        err = _allreduce(rec, rec[SELF] + 8 * MSG, rec[MSGLEN], fns[C_INT32], fns[C_MIN], comm,
                         rec[POLL_US])
        if err != 0:
            _hand_over(rec, MPI_ERROR, -1, err)
            return
        if not _runs_as_offered(rec[MSG:MSG + 3].view(np.int32),
                                rec[MINE:MINE + 3].view(np.int32)):
            _hand_over(rec, AGREED, -1, 0)
            return
    for b in range(nbuckets):
        err = _run_bucket(rec, count, b, rec[SIZE], comm)
        if err != 0:
            _hand_over(rec, MPI_ERROR, b, err)
            return
    _call_void_3(rec[CALLBACK], (rec[ENGINE], rec[PARAM], 0))   # complete, no error
    rec[STATE] = DONE
    _wake(rec)


_SIGNATURE = types.void(types.voidptr, types.voidptr, types.voidptr)
_compiled = {}


def _compile(name, fn):
    """The cfunc ``fn`` (compiled on first use in this process, or loaded from numba's
    on-disk cache: docs/designs.md gives both costs)."""
    if name not in _compiled:
        _compiled[name] = numba.cfunc(_SIGNATURE, cache=True)(fn)
    return _compiled[name].address


def mark_ready_address():
    """The address of the funneled/concurrent op."""
    _functions()
    return _compile('mark_ready', _mark_ready)


def run_chained_address():
    """The address of the chained op."""
    table = _functions()
    _add_mpi(table)
    if not table[F_QUEUED]:
        table[F_QUEUED] = _compile('run_queued', _run_queued)
    return _compile('run_chained', _run_chained)
