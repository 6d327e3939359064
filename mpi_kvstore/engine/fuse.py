"""The chained op (designs/chained.py) in compiled code: one call, or a burst of calls fused.

Its entry points are ``@cfunc`` functions that MXNet's engine calls, built on native.py's
compiled pieces (the records' pointers, MPI calls, the hand-over to Python):

- ``run_chained``: the op of a call, pushed with its arrays and the design's chain
  variable. Pushed inline-when-ready (kAsync), it runs on the pushing thread when its
  arrays are ready then; on any other thread (the engine's normal CPU worker, which runs
  compute) it pushes the rest of the op (``run_queued``) to the priority worker instead and
  returns (docs/designs.md, chained). It runs the agreement (an int32 MIN-allreduce, as in
  agreement.py), then each bucket, completes the op and writes an eventfd.
- ``follow``: the op of a call made while the op before it is pending, pushed with the
  call's arrays only, so that it runs at once exactly when nothing else reads or writes
  them (kAsync, on the pushing thread). There it records its completion, marks the call
  STARTED, links it after the op before it (AFTER) by compare-and-swap, and returns,
  holding the arrays: the walk of that burst runs it (where that walk ended first, it
  closed the link, and the design sees the call unlinked). Where it does not run at
  once it completes when it runs, doing nothing, and the design pushes the call as a
  ``run_chained`` op, which that one precedes.

A burst: a chained op that may lead (one allreduce bucket) walks the calls linked after it,
holding its own completion, so the chain, until the walk ends: each round offers, in its
agreement, its first call and up to FUSE_OPS - 1 linked after it; every rank runs the MIN
of the counts offered, cut where a signature differs, as allreduces of up to
fusion_threshold bytes, and completes each call it ran. The next round starts at the
next call; the walk ends where no call is linked, closing the link (CLOSED), so that a call
made after that is pushed as a chain op. Every rank starts each round at the same place in
the sequence, so ranks that offered different counts line up again.

Whatever a round cannot do natively it hands to Python (records.ChainedOp's ``on_python``)
at a named stage, on the same engine thread: an array it could not read in place or that
lives on a GPU, an agreement that shows a mismatch or a joined rank, an MPI error.
"""

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ..comm import agreement, ccall
from . import layout as L  # the records' words: L.COUNT, L.NEXT, L.FUSE_BUF...
from . import native
from .native import (
    allreduce,
    copy_arrays,
    copy_out,
    hand_over,
    record_at,
    run_bucket,
    runs_as_offered,
    signal,
    table_of,
    take_pointers,
)

__all__ = ['address']

# The entry points compile in native.py's functions and what they compile in: their cache
# is keyed by all of that source and this file's (native.py says why).
_SOURCES = native.SOURCES + (native,)

_call_void_3 = ccall.caller(0, (64, 64, 64))        # the engine's completion callback
_call_self = ccall.caller(64, ())                   # pthread_self()
# MXEnginePushAsyncND(fn, param, deleter, ctx, const, nconst, mutable, nmutable, prop,
# priority, name, wait)
_call_push = ccall.caller(32, (64, 64, 64, 64, 64, 32, 64, 32, 64, 32, 64, 8))


@intrinsic
def _cas(typingctx, address, expected, new):
    """Compare-and-swap of the int64 at ``address`` -> the value it held (``expected``:
    swapped), sequentially consistent."""
    sig = types.int64(types.int64, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        word = builder.inttoptr(args[0], ir.IntType(64).as_pointer())
        pair = builder.cmpxchg(word, args[1], args[2], 'seq_cst', 'seq_cst')
        return builder.extract_value(pair, 0)
    return sig, codegen


@numba.njit
def _messages(rec):
    """(the agreement message after the MIN, this rank's own), as int32."""
    return (rec[L.MSG:L.MSG + L.MESSAGE_WORDS].view(np.int32),
            rec[L.MINE:L.MINE + L.MESSAGE_WORDS].view(np.int32))


@numba.njit
def _linked(at):
    return at != 0 and at != L.CLOSED


@numba.njit
def _offer(rec):
    """Take up the ops linked after this one (STARTED, arrays read in place), at most
    FUSE_OPS in all, and offer them in this rank's message."""
    mine = _messages(rec)[1]
    offered = 1
    if rec[L.LEADS] != 0:
        at = rec[L.NEXT]
        while offered < L.FUSE_OPS and _linked(at):
            other = record_at(at)
            if other[L.STARTED] == 0 or not take_pointers(other, other[L.COUNT]):
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
    if not runs_as_offered(msg[:L.OFFERED], mine[:L.OFFERED]):
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
    fns, buf = table_of(rec), rec[L.FUSE_BUF]
    for into in (True, False):
        at, offset = start, 0
        for _ in range(ops):
            op = record_at(at)
            s = L.HEADER + L.SLOT * op[L.COUNT]
            n = _bucket_bytes(op)
            if into:
                copy_arrays(op, op[s + L.B_FIRST], op[s + L.B_ARRAYS], buf + offset, True)
            else:
                copy_out(op, s, buf + offset, size)
            offset += n
            at = op[L.NEXT]
        if into:
            err = allreduce(rec, buf, total, dtype, fns[L.C_SUM], comm, rec[L.PROGRESS_US])
            if err != 0:
                return err
    return 0


@numba.njit
def _complete(rec, wake=True):
    """Complete ``rec``'s engine op, mark it DONE and, where ``wake``, write the eventfd
    (a fused run writes it once for all its ops, _run_fused)."""
    _call_void_3(rec[L.CALLBACK], (rec[L.ENGINE], rec[L.PARAM], 0))   # complete, no error
    # Once DONE is seen, a reaper may drop the op and free its record: read what the wake
    # needs first, and add the table's 1 (it lives as long as the process), not the record's.
    fns, eventfd = rec[L.FNS], rec[L.EVENTFD]
    rec[L.STATE] = L.DONE
    if wake:
        signal(fns, eventfd)


@numba.njit
def _finish(rec, stage, bucket, err):
    """The end of ``rec``'s part of a round: completed (stage 0) or handed to Python, which
    completes it; where its walk holds it (HOLD), the walk completes it at the end."""
    if stage != 0:
        hand_over(rec, stage, bucket, err)
    elif rec[L.HOLD] == 0:
        _complete(rec)


@numba.njit
def _run_fused(rec, agreed):
    """This op and the ``agreed - 1`` ops after it (one allreduce bucket each), in runs of
    one dtype of at most FUSE_CAP (fusion_threshold) and FUSE_RUN_BYTES bytes, one allreduce
    a run. Every rank cuts the same runs: dtypes and sizes are in the agreed signatures, the
    caps are the same everywhere. Each absorbed op is marked (ABSORBED) and finished, the
    eventfd written once a run; -> this op's MPI error code."""
    comm, size, cap = rec[L.COMM], rec[L.SIZE], min(rec[L.FUSE_CAP], L.FUSE_RUN_BYTES)
    own_err, start, i = 0, rec[L.SELF], 0
    while i < agreed:
        first = record_at(start)
        s = L.HEADER + L.SLOT * first[L.COUNT]
        dtype, nbytes, total = first[s + L.B_DTYPE], _bucket_bytes(first), first[s + L.B_COUNT]
        j, at = i + 1, first[L.NEXT]
        while j < agreed:
            op = record_at(at)
            t = L.HEADER + L.SLOT * op[L.COUNT]
            n = _bucket_bytes(op)
            if op[t + L.B_DTYPE] != dtype or nbytes + n > cap:
                break
            nbytes += n
            total += op[t + L.B_COUNT]
            j += 1
            at = op[L.NEXT]
        if j - i == 1:
            err = run_bucket(first, first[L.COUNT], 0, size, comm)
        else:
            err = _run_group(rec, start, j - i, total, dtype, size, comm)
        mark = start
        for _ in range(j - i):
            op = record_at(mark)
            mark = op[L.NEXT]
            if op[L.SELF] == rec[L.SELF]:
                own_err = err
            else:
                op[L.ABSORBED] = L.ABSORBED_OK if err == 0 else L.ABSORBED_FAILED
                if err != 0:
                    _finish(op, L.MPI_ERROR, 0, err)
                elif op[L.HOLD] == 0:
                    _complete(op, False)
        # one wake for the run's ops, not one an op (15-25 us of a 100-call walk): this op,
        # finished after the round, is not DONE yet, so its record is still readable
        signal(rec[L.FNS], rec[L.EVENTFD])
        start, i = at, j
    rec[L.FUSED] = agreed
    return own_err


@numba.njit
def _round(at):
    """One round from the op at ``at``: its agreement, then it alone or fused with the ops
    agreed; -> the address of the last op it ran."""
    rec = record_at(at)
    count = rec[L.COUNT]
    if not take_pointers(rec, count):
        _finish(rec, L.READ, -1, 0)
        return at
    comm, agreed = rec[L.COMM], 1
    if rec[L.MSGLEN] > 0:
        _offer(rec)
        rec[L.MSG:L.MSG + L.MESSAGE_WORDS] = rec[L.MINE:L.MINE + L.MESSAGE_WORDS]
        fns = table_of(rec)
        err = allreduce(rec, rec[L.SELF] + 8 * L.MSG, rec[L.MSGLEN], fns[L.C_INT32],
                         fns[L.C_MIN], comm, rec[L.POLL_US])
        if err != 0:
            _finish(rec, L.MPI_ERROR, -1, err)
            return at
        agreed = _agreed(rec)
        if agreed == 0:
            _finish(rec, L.AGREED, -1, 0)
            return at
    if agreed > 1:
        last = at
        for _ in range(agreed - 1):
            last = record_at(last)[L.NEXT]
        err = _run_fused(rec, agreed)
        _finish(rec, L.MPI_ERROR if err != 0 else 0, 0, err)
        return last
    for b in range(rec[L.NBUCKETS]):
        err = run_bucket(rec, count, b, rec[L.SIZE], comm)
        if err != 0:
            _finish(rec, L.MPI_ERROR, b, err)
            return at
    _finish(rec, 0, 0, 0)
    return at


@numba.njit
def _run_chained_body(rec):
    """A chained op's call, and where it leads, the walk of the calls linked after it."""
    if rec[L.LEADS] == 0:
        _round(rec[L.SELF])
        return
    rec[L.HOLD] = 1      # the chain stays held until the walk ends: nothing runs past it
    last = _round(rec[L.SELF])
    while True:
        after = _cas(last + 8 * L.NEXT, 0, L.CLOSED)
        if after == 0:
            break
        last = _round(after)
    _complete(rec)


def _entry_points(key):
    """The functions the engine calls, by name: closures over ``key`` (the source of
    _SOURCES), which numba's cache keys them by."""
    def run_chained(run_ctx, on_complete, param):
        _ = key
        rec = native.chained_record(param)
        done = numba.carray(on_complete, 3, dtype=np.int64)
        rec[L.CALLBACK], rec[L.ENGINE], rec[L.PARAM] = done[0], done[1], done[2]
        if rec[L.PUSHER] != 0:
            # Pushed as kAsync: the engine runs it inline on the pushing thread when its
            # arrays were ready then, else on its normal CPU worker, which also runs
            # compute. There it must not block: the call goes on from the priority worker
            # (run_queued), holding its arrays until it completes this op.
            fns = table_of(rec)
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
        _run_chained_body(native.chained_record(param))

    def follow(run_ctx, on_complete, param):
        """A call's op pushed without the chain (the module says when): at once on the
        pushing thread it holds the arrays for the walk; anywhere else it completes."""
        _ = key
        head = numba.carray(param, L.HEADER, dtype=np.int64)
        done = numba.carray(on_complete, 3, dtype=np.int64)
        if _call_self(table_of(head)[L.F_PTHREAD_SELF], ()) == head[L.PUSHER]:
            head[L.CALLBACK], head[L.ENGINE], head[L.PARAM] = done[0], done[1], done[2]
            head[L.STARTED] = 1
            # linked here rather than by a second call from Python (a numba dispatch costs
            # a repeated call ~0.7 us): STARTED is set first, the walk takes it once linked
            after = head[L.AFTER]
            if after != 0:
                _cas(after + 8 * L.NEXT, 0, head[L.SELF])
            return
        _call_void_3(done[0], (done[1], done[2], 0))

    return {'run_chained': run_chained, 'run_queued': run_queued, 'follow': follow}


_compiled = {}   # entry point name -> its numba cfunc, compiled once per process


def address(name):
    """The address of entry point ``name`` (``run_chained``, ``run_queued``, ``follow``),
    compiled on first use in this process or loaded from numba's on-disk cache."""
    if name not in _compiled:
        fn = _entry_points(ccall.source_key(m.__file__ for m in _SOURCES))[name]
        _compiled[name] = numba.cfunc(native.SIGNATURE, cache=True)(fn)
    return _compiled[name].address
