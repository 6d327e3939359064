"""The dependency-chained design."""
import collections
import functools
import threading
import time

import mxnet as mx
import numpy as np

from .. import debug
from ..comm.collective import all_done, finish_all
from ..comm.fusion import BufferPool
from ..comm.mpiabi import MPI, c_datatype
from ..comm.progress import AGREEMENT_POLL_US
from ..comm.timeline import op_name
from ..engine import core as engine
from ..engine import layout, records, takeup
from ..errors import RankMismatchError
from .base import Design
from .base import progress as _progress

__all__ = ['Chained']

_INT_MAX = (1 << 31) - 1   # MPI counts are C ints in the native op
# pthread_self() of the calling thread, which the native op compares with its own: CPython's
# thread id is that value on Linux, and costs a third of a ctypes call of it.
_pthread_self = threading.get_ident
_MAX_PLANS = 4096          # call shapes remembered (a training loop has a few)
# inline_max_bytes: a call made within this many seconds of the previous one's push (of
# its end, where it ran inline) is taken as part of a burst and queues, so that the calls
# after it fuse, instead of running inline: a burst's calls come ~6 us apart, and each run
# inline was its own round (100 x 16 KB: 5x a fused raw allreduce, against 3x queued). A
# lone call, and the first of a burst, still run inline.
_BURST_GAP = 50e-6
_clock = time.perf_counter
_WAIT_SLICE = 0.05         # s: longest sleep of a waiter between looks at the records


_FOLLOW_NAME = b'mpi_kvstore'   # what push_native names an op by default, encoded
_LINKED = (('fuse', 'linked'),)  # debug.count_all's key: a plain dict bump a linked call
_FIRST_HANDLE = layout.HEADER + layout.A_HANDLE   # the record's word of its first array
# the record's words that a call or a reap reads and writes (through ChainedOp.words)
(_STATE, _DONE, _FUSED, _NEXT, _CLOSED, _LEADS, _STARTED, _PUSHER, _PRIORITY, _AFTER,
 _SELF) = (layout.STATE, layout.DONE, layout.FUSED, layout.NEXT, layout.CLOSED, layout.LEADS,
           layout.STARTED, layout.PUSHER, layout.PRIORITY, layout.AFTER, layout.SELF)


class _Kept:
    """What the repeated calls of one prepared call (engine.records.Prepared) keep on the
    chained design: its plan (None: the Python op) at the priority it was made for (the
    priority is in the signatures the plan is keyed by), the op's encoded name, and its
    last two ops, whose records the next calls take again once reaped (ChainedOp.again)."""

    __slots__ = ('plan', 'priority', 'name', 'op', 'spare', 'models', 'sigs')

    def __init__(self, plan, priority, name):
        self.plan, self.priority, self.name = plan, priority, engine.encoded(name)
        self.op = self.spare = None
        # the models Chained.again renews requests from, and their signatures numbered at
        # ``priority`` (Collective.numbered_sig)
        self.models = self.sigs = None

    def move_to(self, handle):
        """Prepared.move_to: the plan (private to a moving call: Chained._submit) names the
        array of ``handle`` in its record and in the handle arrays the next push passes."""
        plan = self.plan
        if plan is not None:
            plan.record[_FIRST_HANDLE] = handle
            plan.handles.array[0] = handle
            if plan.follow_handles is not None:
                plan.follow_handles.array[0] = handle


class Chained(Design):
    """An engine dependency orders the collectives.

    Thread level: MPI_THREAD_SERIALIZED. Collectives run inside the engine ops,
    on whichever engine worker runs them (or inline on the calling thread when the
    data is ready then: ``inline_max_bytes``), but never two at once.

    Order: every op also writes one private chain variable, so the engine runs
    them strictly in push order (the sequence order) on every rank, whatever
    order their data becomes ready in. An op is one call of the store: a list of
    keys fuses into buckets; separate calls are separate collectives. It cannot
    deadlock: op k waits only for data pushed before it and for op k-1, which
    every rank reaches. The price is head-of-line blocking: a key pushed early
    but produced late (gluon pushes the first layer first) holds back the rest.
    Each op first MIN-allreduces a 4-int fingerprint of its requests, so ranks
    that disagree fail loudly instead of summing different keys.

    A burst fuses. A call of one allreduce bucket made while the op before it is still
    pending is pushed without the chain, so that its engine op runs at once exactly when
    nothing else reads or writes its arrays; it then holds them, and the op that leads the
    burst runs it in its walk (after a call whose arrays were busy, none until the ops catch
    up: that one is pushed as a chained op). Each round of the walk offers, after its first
    call's fingerprint, those of the calls linked after it, and every rank runs the MIN of
    the counts offered (cut before the first that differs) in allreduces of up to
    ``fusion_threshold`` bytes. The leader holds the chain until its walk ends. Ranks that
    offer different counts line up again: each round on every rank starts at the same place
    in the sequence.

    The op is native (engine/fuse.py, run_chained): machine code calls MPI, so
    no Python runs on the engine worker. It hands the rare cases to Python on
    the same worker (:meth:`_in_python`). Requests are marked done lazily
    (:meth:`reap`), by whoever asks: the next call, ``wait()``, the stall
    inspector; a waiter sleeps on the eventfd every op writes. No thread of ours
    wakes per collective. The Python op remains for what
    the native one does not do: NaiveEngine, the timeline, Python collectives,
    averages of dtypes it cannot divide, counts beyond a C int.
    """

    name = 'chained'
    thread_level = MPI.THREAD_SERIALIZED
    _skip = None   # see __init__ (here too: _push reads it first thing)

    def __init__(self, comm, config, sink, timeline=None, table=None, make_comm=None,
                 shares=None):
        super().__init__(comm, config, sink, timeline, table, make_comm, shares)
        self._comm = self.join_comm = self.make_comm()
        self._chain = mx.nd.zeros((1,))
        # The native op calls MPI_Allreduce on the flat handle: a hierarchy needs the Python op.
        self._native = (config.native_ops and not config.naive_engine and not timeline
                        and not self._comm.hierarchical)
        self._fusion = BufferPool()           # host buffers for fused buckets
        self._plans = {}                      # call shape -> records.ChainedPlan
        self._inflight = collections.deque()  # native ops, in push (= completion) order
        self._tail = None                     # the last op pushed, where it is native
        self._fuse = None                     # the host buffer of fused runs
        self._probing = True                  # no call found busy arrays since ops were idle
        self._reap_lock = threading.Lock()
        self._waker = None
        # Ready data at push time: the op runs on this thread, no engine hand-offs
        # (native.py: elsewhere it re-pushes itself to the priority worker).
        self._inline_max = config.inline_max_bytes if self._native else -1
        self._last_push = float('-inf')   # _clock() at the last push, where _inline_max > 0
        # (first, last) sequence numbers of the last calls of several ops (Design.call), and
        # (after, last, words): the ops of a parted call's rest, failed unagreed (parted)
        self._calls = collections.deque(maxlen=64)
        self._skip = None
        if self._native:
            self._address = records.run_chained_address()   # compiled now, not in step one
            self._chained_fn = engine.native_fn(self._address)
            self._waker = takeup.Waker()
            if self.size > 1 and config.fusion_threshold > 0:
                self._fuse = np.empty(config.fusion_threshold, dtype=np.uint8)
                self._follow_fn = engine.native_fn(records.follow_address())

    def _submit(self, reqs, priority):
        prepared = getattr(reqs, 'prepared', None)
        if prepared is not None and prepared.owner is self and self._native:
            # A prepared call again (store.namecache.Batch): its plan, the record of its
            # last op and the push's arguments are kept on it (_Kept), not made per call.
            kept = prepared.kept
            if kept is None or kept.priority != priority:
                # a moving call (Prepared.move_to) rewrites its plan: not the shared one
                plan_ = (self._plan if prepared.moved is None else self._new_plan)(
                    reqs, prepared.arrays)
                kept = prepared.kept = _Kept(plan_, priority, op_name(reqs[0].kind))
            plan_ = kept.plan
            if plan_ is not None:
                wait = self._wait
                for req in reqs:
                    req.wait_with(wait)
                self._push(self._kept_op(kept, prepared, reqs), plan_, reqs, priority,
                           kept.name)
                return
            arrays = prepared.arrays
        else:
            arrays = [r.array for r in reqs if r.array is not None]
            plan_ = self._plan(reqs, arrays) if self._native else None
            if plan_ is not None:
                wait = self._wait
                for req in reqs:
                    req.wait_with(wait)
                op = records.ChainedOp(plan_, reqs, arrays, self._in_python)
                self._push(op, plan_, reqs, priority, engine.encoded(op_name(reqs[0].kind)))
                return
        self._tail = None     # a Python op: no native op may run past it
        engine.push(functools.partial(self._run, reqs), mutable=arrays + [self._chain],
                    priority=priority, name=op_name(reqs[0].kind),
                    on_error=functools.partial(self._failed_in_engine, reqs))

    def again_direct(self, prepared, models, priority, pending):
        """A prepared call repeated (Design.again) at the priority its kept plan was made
        for, in one function: Job.again's part (the reap, the done requests out of
        ``pending``; no synchronous raise: a native op never is), requests renewed from
        ``models`` numbered and waited on here (Collective.again), entered in ``pending``,
        and the kept op (:meth:`_kept_op`) pushed as :meth:`_push` pushes it, the one
        linked after a burst's op in this function. The store calls it straight
        (Job.again_direct: no elastic world, the store open and the caller's own checks done).
        False where nothing is kept for it yet (its first calls, another priority, a
        Python op): Job submits it the general way, which keeps it."""
        kept = prepared.kept
        if (kept is None or kept.priority != priority or kept.plan is None
                or prepared.owner is not self):
            return False
        inflight = self._inflight
        if inflight and inflight[0].words[_STATE] == _DONE:   # reap's own first test
            self.reap()
        if pending and pending[0].done:
            _drop_done(pending)
        if kept.models is not models:   # signatures numbered once, not once a call
            kept.sigs = [model.numbered_sig(priority) for model in models]
            kept.models = models
        # _kept_op's body: the kept op (or its spare) taken again once reaped, its record
        # copied from the plan's (ChainedOp.again's body, below)
        op = kept.op
        if op is None or not op.reaped:
            spare, kept.spare = kept.spare, op
            op = spare if spare is not None and spare.reaped else None
        wait, seq, sigs = self._wait, self._seq, kept.sigs
        # models is never empty (at is bound): kvstore refuses [] keys, groups keep 2 or more
        if len(models) == 1:   # a key alone, the common call: no loop
            at = next(seq)
            # a reaped op's request (done: reap finished it before marking the op reaped)
            # renumbered for this call, else a new one renewed from the model
            if op is not None and op.reqs[0].again_in_place(at, sigs[0], prepared.moved):
                reqs = op.reqs
            else:
                reqs = [models[0].again(at, priority, sigs[0], wait, prepared.moved)]
        else:
            reqs = []
            for model, sig in zip(models, sigs):
                at = next(seq)
                reqs.append(model.again(at, priority, sig, wait))
        self.pushed = at + 1
        pending.extend(reqs)
        plan_ = kept.plan
        if op is None:
            op = kept.op = records.ChainedOp(plan_, reqs, prepared.arrays, self._in_python)
        else:
            kept.op = op
            words = op.words
            words[:] = plan_.words
            words[_SELF] = address = op._address
            op.reqs, op.reaped, op.arrays = reqs, False, prepared.arrays
            _fallbacks[address] = op
        # _push's linked call, inline: where no call runs inline (inline_max_bytes) and the
        # op before it is a burst's, walking; anything else goes through _push
        prev = inflight[-1] if inflight else None
        if (prev is None or not plan_.leads or not self._probing or prev is not self._tail
                or self._inline_max > 0 or plan_.nbytes <= self._inline_max
                or self._skip is not None):   # _push fails a parted call's rest (parted)
            self._push(op, plan_, reqs, priority, kept.name)
            return True
        before = prev.words
        if before[_STATE] == _DONE or before[_NEXT] == _CLOSED or not before[_LEADS]:
            self._push(op, plan_, reqs, priority, kept.name)
            return True
        inflight.append(op)
        if not self._follow(op, prev, plan_, priority):
            engine.push_op(self._chained_fn, op.param, plan_.handles, priority, kept.name)
            self._tail = op
        return True

    again = again_direct   # Design.again: Job.again's general path calls it too

    def _kept_op(self, kept, prepared, reqs):
        """The op of a prepared call's ``reqs``: a kept op's record taken again once
        reaped (ChainedOp.again), else a new one, kept."""
        op = kept.op
        if op is not None and op.reaped:
            op.arrays = prepared.arrays   # a moving call's (Prepared.move_to)
            return op.again(kept.plan, reqs)
        # the last op may wait to be reaped behind its burst's leader, whose thread marks
        # it done after the engine's completion: two are kept
        spare, kept.spare = kept.spare, op
        if spare is not None and spare.reaped:
            spare.arrays = prepared.arrays
            op = kept.op = spare.again(kept.plan, reqs)
        else:
            op = kept.op = records.ChainedOp(kept.plan, reqs, prepared.arrays, self._in_python)
        return op

    def _push(self, op, plan_, reqs, priority, name):
        """Push the native ``op`` of ``reqs`` (its plan ``plan_``; ``name``: encoded),
        whose requests wait with :meth:`_wait`."""
        inflight = self._inflight
        prev = inflight[-1] if inflight else None
        pending = prev is not None and prev.words[_STATE] != _DONE
        # The ops caught up once no walk can take this call: prev's walk closed its link
        # (fuse._run_chained_body), which it does before completing; an op is DONE only
        # after its engine completion, which already woke the caller's wait, so in a
        # loop of burst-then-wait DONE alone lags, and one busy call stopped all fusing.
        walking = pending and prev.words[_NEXT] != _CLOSED
        burst = False    # made right after the call before it (_BURST_GAP): not inline
        if self._inline_max > 0:
            now = _clock()
            burst, self._last_push = now - self._last_push < _BURST_GAP, now
        inflight.append(op)
        skip = self._skip
        if skip is not None and skip[0] < reqs[0].seq <= skip[1]:
            self._skip_op(op, skip[2])
        if not walking:
            self._probing = True
        elif (plan_.leads and self._probing and prev is self._tail and prev.words[_LEADS]
              and self._follow(op, prev, plan_, priority)):
            return
        # Offered inline only when no earlier op is pending: one that is would hold this
        # one back, and an op offered inline whose data is not ready takes a detour
        # through MXNet's compute worker (fuse.py), which slowed per-key training.
        if plan_.nbytes <= self._inline_max and not pending and not burst:
            op.pushed_from(_pthread_self(), priority)
            engine.push_native(self._address, op.address, plan_.handles, priority=priority,
                               name=op_name(reqs[0].kind), inline_when_ready=True,
                               may_block=True)
            self._last_push = _clock()   # the next call's gap counts from the end of this one
        else:
            engine.push_op(self._chained_fn, op.param, plan_.handles, priority, name)
        self._tail = op

    def _follow(self, op, prev, plan_, priority):
        """Push ``op`` (appended to the ops in flight) without the chain: at once exactly
        when nothing else reads or writes its arrays, which it then holds, and the walk of
        the burst the op before it (``prev``, walking) belongs to runs it (fuse.py) -> True.
        One that finds them busy runs later on MXNet's compute worker, doing nothing, and
        the call goes on as a chained op, which waits for it: one such a burst (the
        gradients of a backward pass still being computed), until the ops catch up ->
        False: the caller pushes it chained."""
        words = op.words
        words[_PUSHER], words[_PRIORITY], words[_AFTER] = (_pthread_self(), priority,
                                                           prev._address)
        push = op.follow   # the op's plan is always the same: its push made once
        if push is None:
            push = op.follow = engine.inline_push(self._follow_fn, op.param,
                                                  plan_.follow_handles, 0, _FOLLOW_NAME)
        if push():
            engine.push_failed()
        if words[_STARTED]:
            if prev.words[_NEXT] == op._address:   # its follow op linked it (fuse.follow)
                self._tail = op
                debug.count_all(_LINKED)
                return True
            op.let_go()       # the walk ended before the link: a chained op
        else:
            self._probing = False
            debug.count('fuse', 'busy')
        words[_PUSHER], words[_PRIORITY], words[_AFTER] = 0, priority, 0
        return False

    def call(self, count):
        if count > 1:
            self._calls.append((self.pushed, self.pushed + count - 1))

    def parted(self, reqs, words):
        """Design.parted, on the engine worker: the ops of this rank's call after ``reqs``
        fail with ``words`` and agree on nothing, those pushed (marked here) and those to
        come (_push, agree_and_execute), so that every rank's next agreement is its next
        call's. Seen from the ranks, each ran one agreement for the call."""
        after = reqs[-1].seq
        for first, last in tuple(self._calls):   # a copy: the user's thread appends
            if first <= after < last:
                break
        else:
            return
        self._skip = (after, last, words)
        for op in tuple(self._inflight):
            if isinstance(op, records.ChainedOp) and after < op.reqs[0].seq <= last:
                self._skip_op(op, words)

    def _skip_op(self, op, words):
        """A native op of a parted call's rest: no agreement and no bucket (it completes
        at once when it runs), its requests failed here (it may run it twice: idempotent)."""
        rec = op.record
        rec[layout.MSGLEN] = rec[layout.NBUCKETS] = 0
        for req in op.reqs:
            if req.error is None:
                self.fail(req, RankMismatchError(words))

    def agree_and_execute(self, reqs, comm):
        skip = self._skip
        if reqs and skip is not None and skip[0] < reqs[0].seq <= skip[1]:
            for req in reqs:   # a Python op of a parted call's rest (see parted)
                if req.error is None:
                    self.fail(req, RankMismatchError(skip[2]))
                req.complete()
            return
        super().agree_and_execute(reqs, comm)

    def _run(self, reqs, completion):
        try:
            for req in reqs:
                if self.timeline:
                    self.timeline.ready(req)
                self.attach(req)
            self.agree_and_execute(reqs, self._comm)
        finally:
            # Never with an error: the engine would set it on the chain variable
            # too and skip every later collective of this rank (see deferred.py).
            completion.done()

    def _failed_in_engine(self, reqs, err):
        self.fail_all(reqs, err)
        for req in reqs:
            req.finish()

    # -- the native op's helpers (Python) --------------------------------------
    def _plan(self, reqs, arrays):
        """The native plan of a call of this shape: the same requests (signatures, which
        include kind, key, shape, dtype, root and priority; sizes; averaging; the scale
        factor itself, which the record carries: two factors' marks in a signature may
        collide, 1.6689453125 and 16.6162109375 do for 'x' (8,) float32, and the second
        call took the first's plan and factor) on the same arrays; None (remembered too)
        for a call the native op cannot run. Requests keep their call order: fusion.plan
        sorts one call's requests (one priority) by sequence number."""
        key = (tuple((r.sig, r.nbytes, r.average, r.factor) for r in reqs),
               tuple(a.handle.value for a in arrays))
        found = self._plans.get(key, False)
        if found is False:
            if len(self._plans) >= _MAX_PLANS:
                self._plans.clear()
            found = self._plans[key] = self._new_plan(reqs, arrays)
        return found

    def _new_plan(self, reqs, arrays):
        if not _native_can_run(reqs):
            return None
        buckets = self.buckets(reqs)
        if self.table is not None and any(      # the compiled op calls MPI_Allreduce only
                b[0].kind == 'allreduce' and self.table.choose(sum(r.nbytes for r in b)) != 'mpi'
                for b in buckets):
            return None
        if any(b[0].kind == 'bcast' and _python_broadcast(self._comm, b) for b in buckets):
            return None
        message = self.group_message([r.sig for r in reqs]) if self.size > 1 else None
        fuse = (0, 0) if self._fuse is None else (self._fuse.ctypes.data, self._fuse.size)
        found = records.ChainedPlan(buckets, self._comm, message, self._waker.fd,
                                    self._fusion_buffer, _progress(self.config),
                                    AGREEMENT_POLL_US, fuse)
        found.handles = engine.Handles(arrays + [self._chain])
        if found.leads:
            found.follow_handles = engine.Handles(arrays)
        return found

    def group_message(self, sigs, joined=False):
        """The agreement message of one call, offering no other (layout.offer_message):
        every agreement on this comm, in Python or compiled, has the compiled op's length."""
        return layout.offer_message(super().group_message(sigs, joined))

    def _fusion_buffer(self, dtype, count):
        """A host buffer for a fused bucket. Ops run one at a time, so they share the
        pool's; a plan keeps the buffer it was given alive (the pool may grow past it)."""
        return self._fusion.get(np.empty(0, dtype=dtype), count)

    def _in_python(self, op):
        """On the engine worker: finish what the native op handed over, then complete it."""
        stage, failed_bucket, code = op.stage
        try:
            self.attach_native(op)   # a refused array fails here, and spoils its signature
            if stage == layout.Stage.READ:
                self.agree_and_execute(op.reqs, self._comm)
            elif stage == layout.Stage.AGREED:
                self.run_agreed(op.reqs, op.message(), self._comm)
            else:
                self._after_mpi_error(op, failed_bucket, MPI.Exception(code))
        finally:
            if not op.held:      # else the walk that holds it completes it (fuse.py)
                engine.Completion.native(*op.callback(), op.arrays).done()
                op.finish_in_python()

    def _after_mpi_error(self, op, failed_bucket, err):
        """An MPI call of the native op failed at ``failed_bucket`` (-1: the agreement)."""
        if failed_bucket < 0:
            for req in op.reqs:
                self.fail(req, err)
                req.complete()
            return
        for bucket in op.buckets[:failed_bucket]:   # ran natively
            for req in bucket:
                req.complete()
        for req in op.buckets[failed_bucket]:
            self.fail(req, err)
            req.complete()
        for bucket in op.buckets[failed_bucket + 1:]:
            self.execute(bucket, self._comm)

    def reap(self):
        """Mark the requests of completed native ops done (any thread)."""
        inflight = self._inflight
        if not (inflight and inflight[0].words[_STATE] == _DONE):  # the common case: no lock
            return
        with self._reap_lock:
            reqs, ops = [], []
            led = absorbed = 0
            # a burst's ~100 ops at once: each op's words read here as Python ints
            # (ChainedOp.words), not through properties nor numpy scalars
            while inflight:
                op = inflight[0]
                words = op.words
                if words[_STATE] != _DONE:
                    break
                inflight.popleft()
                fused = words[_FUSED]
                if fused:   # it ran the first ``fused`` of a round (itself included), so
                    led += 1    # its walk marked the other fused - 1 ABSORBED (fuse.py)
                    absorbed += fused - 1
                reqs += op.reqs
                ops.append(op)
            # counted once a reap, not once an op
            if led:
                debug.count('fuse', 'led', led)
            if absorbed:
                debug.count('fuse', 'absorbed', absorbed)
            finish_all(reqs)   # the waiters woken once, not once a request
            # last: once reaped, the user's thread may take an op again for its next call
            # (again_direct, _kept_op), its record and (done, finished here) its request
            # renumbered, while this thread goes on here
            for op in ops:
                op.forget()

    def _wait(self, req, timeout):
        """Collective.wait of a native op's request: reap, else sleep until an op writes
        the eventfd (bounded, so two waiters never starve each other)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self.reap()
            if req.done:
                return True
            left = _WAIT_SLICE if deadline is None else min(_WAIT_SLICE,
                                                             deadline - time.monotonic())
            if left <= 0:
                return False
            self._waker.wait(left)

    def close(self):
        if self._waker is not None:
            self.reap()
            self._waker.close()
        self._comm.free()


def _python_broadcast(comm, bucket):
    """Whether a broadcast bucket needs the Python op: the compiled op calls MPI_Bcast,
    which is what the Comm's own choice (broadcast.ByTable.choose: the table's row, and
    its fallback where the hosts do not apply) calls 'flat'."""
    return comm.broadcast_choice(sum(r.nbytes for r in bucket)).algorithm != 'flat'


def _native_can_run(reqs):
    for req in reqs:
        if req.kind not in records.KINDS or req.codec is not None:   # compressed: compression/
            return False
        if req.place != 'cpu':   # device memory: a device transport (reduce.py)
            return False
        if req.dtype is None:
            continue
        if c_datatype(req.dtype) is None or req.nbytes // req.dtype.itemsize > _INT_MAX:
            return False
        if (req.average or req.factor != 1.0) and req.dtype not in layout.SCALES:
            return False
    return True


_fallbacks = records.fallbacks()   # what ChainedOp.again registers, in Chained.again_direct


def _drop_done(pending):
    """Drop the done requests at the head of ``pending`` (Job's), a burst's ~100 at once:
    all of them in one clear where every one is done (the common case, tested in C)."""
    if all_done(pending):
        pending.clear()
        return
    while pending and pending[0].done:
        pending.popleft()
