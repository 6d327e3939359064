"""The records that the compiled engine ops (native.py) and Python (records.py) share,
declared once, as numpy structured dtypes; every word offset either side uses is derived
from them here.

A record is an int64 array that Python owns until its op completes::

    [HEADER_DTYPE, then an ARRAY_DTYPE per array,
     then a BUCKET_DTYPE per bucket (chained only)]

Every record carries the address of a table of the C functions and MPI constants that
compiled code calls (TABLE_DTYPE), so that the machine code holds no address of this
process and numba can cache it on disk. Compiled code reads the offsets below as
constants (numba freezes module-level ints when it compiles); native.py and fuse.py key
their caches by this file's source, so a change here compiles them again. The offsets are
named by where they point: a header word bare (COUNT), within an array's slot A_ (A_DATA),
within a bucket's B_ (B_KIND), within the table F_ (a function) and C_ (an MPI constant).
"""
import enum

import numpy as np

from ..comm import agreement

__all__ = ['HEADER_DTYPE', 'ARRAY_DTYPE', 'DL_TENSOR_DTYPE', 'BUCKET_DTYPE', 'TABLE_DTYPE',
           'HEADER', 'SLOT', 'BSLOT', 'TABLE', 'MESSAGE_WORDS', 'Stage', 'SCALES', 'FACTORS',
           'FUSE_OPS', 'FUSE_RUN_BYTES', 'offer_message']

_I64 = np.int64
# A chained op offers itself and up to FUSE_OPS - 1 ops linked after it (fuse.py, _offer):
# its agreement message is agreement.group_message of its own requests, then how many ops it
# offers (OFFERED, MIN over ranks: how many run fused), then the group body of each further
# op (BODY ints each, WILDCARD where not offered).
FUSE_OPS = 32
# The largest allreduce of a fused round (fuse.py, _run_fused; fusion_threshold caps it too):
# its copy in, its reduction and its copy out stay in a core's cache. 100 x 16 KB on 2 ranks
# of one host: the walk's own CPU (copies, offer, completions) 235-247 us (min) at 256 KB
# against 276-333 us at the round's 512 KB (percall_breakdown.txt, helper W).
FUSE_RUN_BYTES = 256 << 10
_GROUP = len(agreement.group_message(()))
BODY = _GROUP - agreement.HEADER
OFFERED = _GROUP                              # int32 index of the count offered
MESSAGE_INTS = _GROUP + 1 + BODY * (FUSE_OPS - 1)
MESSAGE_WORDS = -(-MESSAGE_INTS // 2)         # in whole words


def offer_message(group):
    """The chained agreement message of a lone op whose group message is ``group``: it
    offers itself alone (a joined rank's: WILDCARD, which no MIN sees)."""
    msg = np.full(MESSAGE_INTS, agreement.WILDCARD, dtype=np.int32)
    msg[:_GROUP] = group
    if group[0] != 0:       # not joined
        msg[OFFERED] = 1
    return msg


HEADER_DTYPE = np.dtype([
    ('state', _I64),                  # PENDING, READY, DONE
    ('callback', _I64), ('engine', _I64), ('param', _I64),   # the engine's completion
    ('count', _I64),                  # arrays
    ('eventfd', _I64),                # written when the op is ready (or done)
    ('self', _I64),                   # the record's own address
    ('one', _I64),                    # 1: what an eventfd write adds
    ('comm', _I64), ('size', _I64),   # the MPI_Comm handle and its size (chained)
    ('nbuckets', _I64),
    ('stage', _I64),                  # why the op handed over to Python (Stage)...
    ('bucket', _I64),                 # ...at which bucket (-1: the agreement)...
    ('errcode', _I64),                # ...with which MPI error code
    ('msglen', _I64),                 # int32 in the agreement message (0: no agreement)
    ('fns', _I64),                    # the table's address
    ('msg', np.int32, 2 * MESSAGE_WORDS),    # the agreement message after the MIN
    ('mine', np.int32, 2 * MESSAGE_WORDS),   # this rank's own
    ('poll_us', _I64),        # longest sleep between polls of the agreement (0: blocking)
    ('progress_us', _I64),    # the same for a polled bucket (ALLREDUCE_POLLED)
    # MPI_Iallreduce's request, MPI_Test's flag and status: the status right after the
    # flag, as progress.poll's scratch box holds them
    ('request', _I64), ('flag', _I64), ('status', _I64, 8),
    # pthread_self() of the thread that pushed a chained op inline-when-ready (0: pushed
    # to the priority worker), and the call's priority, for a re-push; the op a call's
    # follow op links it after where it runs at once (its record's address; 0: none).
    ('pusher', _I64), ('priority', _I64), ('after', _I64),
    # Fusing a burst (fuse.py): the next op linked after this one (its record's address; 0:
    # none yet, CLOSED: the walk of its burst ended there, none may link); whether this op
    # may lead a burst (one allreduce bucket); whether its engine op was pushed without the
    # chain and ran at once (STARTED: arrays free and held; then only the burst's walk may run
    # it); whether its completion waits for its walk (HOLD); set by the op that absorbed
    # it (ABSORBED_OK, or ABSORBED_FAILED with ERRCODE); the ops this op ran fused (itself
    # included); the host buffer that a fused round reduces in, and its size in bytes.
    ('next', _I64), ('leads', _I64), ('started', _I64), ('hold', _I64),
    ('absorbed', _I64), ('fused', _I64), ('fuse_buf', _I64), ('fuse_cap', _I64),
])

# dlpack.h's DLTensor, with which MXNDArrayToDLPack's DLManagedTensor begins.
DL_TENSOR_DTYPE = np.dtype([
    ('data', _I64), ('device_type', np.int32), ('device_id', np.int32),
    ('ndim', np.int32), ('dtype', np.uint32), ('shape', _I64), ('strides', _I64),
    ('byte_offset', _I64),
])
ARRAY_DTYPE = np.dtype([
    ('handle', _I64),                 # the NDArrayHandle
    ('managed', _I64),                # its DLManagedTensor* (0: refused, MKLDNN layout)
    ('tensor', DL_TENSOR_DTYPE),      # a copy of its DLTensor, taken inside the op
    ('nbytes', _I64),
])
BUCKET_DTYPE = np.dtype([
    ('kind', _I64), ('first', _I64),  # bucket kind, its first array
    ('arrays', _I64), ('count', _I64),   # how many arrays, how many elements
    ('dtype', _I64), ('root', _I64),  # MPI datatype handle, broadcast root
    ('scale', _I64),                  # SCALES (0: a sum)
    ('fusion', _I64),                 # the fusion buffer's address (several arrays)
    ('factor', np.float64),           # the scale factor after the sum (SCALES, FACTORS)
])
TABLE_DTYPE = np.dtype([(name, _I64) for name in (
    'to_dlpack', 'dlpack_delete', 'memcpy', 'write', 'python', 'usleep', 'pthread_self',
    'push', 'madvise',                # libmxnet, libc, the Python entry (core.python_entry)
    'allreduce', 'bcast', 'barrier', 'iallreduce', 'test',   # MPI (mpiabi.CApi)...
    'in_place', 'sum', 'min', 'int32',                       # ...and its constants
    'cpu_context', 'prioritized', 'name',   # what a re-push passes (core.native_push_constants)
    'queued',                               # the compiled op a re-push runs (fuse.py)
    'one',             # 1: what a completion's eventfd write adds (the table outlives records)
)])


def _words(dtype, *names):
    """The int64 word at which each field of ``dtype`` starts (``a.b``: a nested field)."""
    found = []
    for name in names:
        offset, inner = 0, dtype
        for part in name.split('.'):
            inner, at = inner.fields[part][:2]
            offset += at
        if offset % 8:
            raise ValueError('record field %r does not start on a word' % name)
        found.append(offset // 8)
    return found[0] if len(found) == 1 else found


HEADER, SLOT, BSLOT, TABLE = (d.itemsize // 8 for d in (
    HEADER_DTYPE, ARRAY_DTYPE, BUCKET_DTYPE, TABLE_DTYPE))
(STATE, CALLBACK, ENGINE, PARAM, COUNT, EVENTFD, SELF, ONE, COMM, SIZE, NBUCKETS, STAGE,
 BUCKET, ERRCODE, MSGLEN, FNS, MSG, MINE, POLL_US, PROGRESS_US, REQUEST, FLAG, STATUS,
 PUSHER, PRIORITY, AFTER, NEXT, LEADS, STARTED, HOLD, ABSORBED, FUSED, FUSE_BUF,
 FUSE_CAP) = _words(
    HEADER_DTYPE, 'state', 'callback', 'engine', 'param', 'count', 'eventfd', 'self', 'one',
    'comm', 'size', 'nbuckets', 'stage', 'bucket', 'errcode', 'msglen', 'fns', 'msg', 'mine',
    'poll_us', 'progress_us', 'request', 'flag', 'status', 'pusher', 'priority', 'after', 'next',
    'leads', 'started', 'hold', 'absorbed', 'fused', 'fuse_buf', 'fuse_cap')
# Within an array's slot; A_DEVICE holds device_type (low half) and device_id.
A_HANDLE, A_MANAGED, A_TENSOR, A_DATA, A_DEVICE, A_OFFSET, A_NBYTES = _words(
    ARRAY_DTYPE, 'handle', 'managed', 'tensor', 'tensor.data', 'tensor.device_type',
    'tensor.byte_offset', 'nbytes')
DL_TENSOR_BYTES = DL_TENSOR_DTYPE.itemsize
# Within a bucket's slot.
B_KIND, B_FIRST, B_ARRAYS, B_COUNT, B_DTYPE, B_ROOT, B_SCALE, B_FUSION, B_FACTOR = _words(
    BUCKET_DTYPE, 'kind', 'first', 'arrays', 'count', 'dtype', 'root', 'scale', 'fusion',
    'factor')
# Within the table.
(F_TO_DLPACK, F_DLPACK_DELETE, F_MEMCPY, F_WRITE, F_PYTHON, F_USLEEP, F_PTHREAD_SELF,
 F_PUSH, F_MADVISE, F_ALLREDUCE, F_BCAST, F_BARRIER, F_IALLREDUCE, F_TEST, C_IN_PLACE,
 C_SUM, C_MIN, C_INT32, C_CPU_CONTEXT, C_PRIORITIZED, C_NAME, F_QUEUED, C_ONE) = _words(
    TABLE_DTYPE, 'to_dlpack', 'dlpack_delete', 'memcpy', 'write', 'python', 'usleep',
    'pthread_self', 'push', 'madvise', 'allreduce', 'bcast', 'barrier', 'iallreduce', 'test',
    'in_place', 'sum', 'min', 'int32', 'cpu_context', 'prioritized', 'name', 'queued', 'one')

# The record of a copy made at push (native.py's copy_now, records.CopyNow): the table,
# the record's own address, the pushing thread (the op copies only there, inline at its
# push), the source and destination handles, the bytes, COPIED (1 once it copied) and the
# two DLManagedTensor* it takes.
(COPY_FNS, COPY_SELF, COPY_PUSHER, COPY_SRC, COPY_DST, COPY_NBYTES, COPY_DONE,
 COPY_SRC_MANAGED, COPY_DST_MANAGED) = range(9)
COPY_WORDS = 9

PENDING, READY, DONE = 0, 1, 2        # STATE
ABSORBED_OK, ABSORBED_FAILED = 1, 2   # ABSORBED (0: run by its own op)
CLOSED = 1                            # NEXT: no op may link after this one
ALLREDUCE, BCAST, BARRIER, ALLREDUCE_POLLED = 0, 1, 2, 3   # a bucket's kind
# How an averaged bucket is divided by the number of ranks, by dtype (as reduce.scale
# does: floats multiply by factor/size in their own precision, integers floor-divide, then
# multiply by the factor in float64, truncated), and how a bucket that is not averaged is
# multiplied by its factor (B_FACTOR, a float64; 1.0: a plain sum, scale 0).
SCALES = {np.dtype(np.float32): 1, np.dtype(np.float64): 2, np.dtype(np.int32): 3,
          np.dtype(np.int64): 4}
FACTORS = {np.dtype(np.float32): 5, np.dtype(np.float64): 6, np.dtype(np.int32): 7,
           np.dtype(np.int64): 8}

# Why a chained op handed its collective to Python (STAGE):
READ = 1       # an array was refused by MXNDArrayToDLPack, or is not host memory
AGREED = 2     # the agreement found a mismatch or a joined rank; MSG holds it
MPI_ERROR = 3  # an MPI call returned ERRCODE at bucket BUCKET (-1: the agreement)


class Stage(enum.IntEnum):
    """STAGE's values, for Python."""
    READ = READ
    AGREED = AGREED
    MPI_ERROR = MPI_ERROR
