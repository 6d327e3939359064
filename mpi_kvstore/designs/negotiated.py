"""Readiness negotiation, shared by the funneled and concurrent designs.

The engine finds gradients ready in an order that differs between ranks, and
the push order (gluon.Trainer pushes the first layer first) is the reverse of
the order backward produces them. So the collective order comes from an
agreement: in each round every rank offers the pending requests that are ready
locally, one int32 MIN-allreduce finds those ready on every rank, and every
rank runs exactly those, sorted by sequence number, in the same fused buckets.

The message (agreement.window_message) holds, per request of the window
[base, base + window), two encodings of its signature (0 when not ready): a
request runs when it is ready on every rank, and fails on every rank when ranks
pushed different keys, shapes or dtypes at that position.

A rank that called join() offers a wildcard for the whole window and takes
part in every round, mirroring what the active ranks agreed (join.py); the
round in which every rank offers a wildcard ends the join everywhere.

No deadlock: a rank takes part in a round whenever it has a ready request in
the window, and each round is one collective every such rank joins. A request
at ``base`` depends only on work pushed before it, so it becomes ready on every
rank and the next round that sees it agrees on it; ``base`` is the lowest
sequence number not yet executed, identical everywhere because rounds agree.
"""
import abc
import ctypes
import functools
import logging
import threading
import time

import numpy as np

from .. import debug
from ..comm import agreement
from ..comm.progress import wait_polling
from ..comm.timeline import op_name
from ..config import window_of
from ..engine import core as engine
from ..engine import records, rounds, takeup
from . import autotune, schedule
from .base import Design, complete_all, native_view
from .repeat import REQUEST_BYTES, Repeat
from .spin import Spin, spin_of

__all__ = ['Negotiated', 'tighten_timer_slack', 'TIMER_SLACK_NS']

log = logging.getLogger(__name__)

# the words of a native op that _collect reads (rounds.take_up's row)
_T_COUNT, _T_MANAGED, _T_ADDRESS, _T_DEVICE = (
    rounds.TAKEN.index(name) for name in ('count', 'managed', 'address', 'device'))

# The communication threads' timer slack. Linux lets a sleep of a normal thread overrun by
# its slack, 50 us by default: each of a polled wait's short sleeps (progress.wait_polling's
# 1, 2, 4... us) lasted 62 us on the test VM (8 us at 1 us of slack), and a round's
# agreement, waiting for the other ranks, paid them. Only these threads' sleeps change:
# idle, they block on the waker without a timeout, so no timer runs.
TIMER_SLACK_NS = 1000
_PR_SET_TIMERSLACK = 29


def tighten_timer_slack(nanoseconds=TIMER_SLACK_NS):
    """Set the calling thread's timer slack (Linux prctl); False where it cannot."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_TIMERSLACK, int(nanoseconds),
                                                       0, 0, 0) == 0
    except (OSError, AttributeError):   # no prctl: not Linux
        log.debug('no prctl: the timer slack stays as it is', exc_info=True)
        return False


class Negotiated(Design):
    """Engine ops mark requests ready; one negotiation thread decides what runs."""

    def __init__(self, comm, config, sink, timeline=None, table=None, make_comm=None,
                 shares=None):
        super().__init__(comm, config, sink, timeline, table, make_comm, shares)
        self._control = self.make_comm()
        self._lock = threading.Lock()
        self._waker = takeup.Waker()      # engine ops, calls and close() wake the thread
        # Mark-ready ops run as compiled code, except where NaiveEngine needs an op to
        # complete before its function returns (native.py).
        self._native = config.native_ops and not config.naive_engine
        if self._native:   # what the prepared path pushes (_submit), converted once
            self._mark_ready_fn = engine.native_fn(records.mark_ready_address())
            self._names = {}
        self._inflight = []               # native ops pushed, not yet taken up...
        self._addresses = []              # ...and their records' addresses
        self._ready = {}
        self._executed = set()
        self._base = 0
        self._stop = False
        self._window = window_of(config)
        self._msg = np.zeros(agreement.HEADER + 2 * self._window, dtype=np.int32)
        # agreed, not yet run: large ones cut in pieces, taken by priority up to a credit;
        # the sizes are this design's knobs, which autotune switches (_retune)
        self._knobs = schedule.Knobs(config.partition_bytes, config.credit_bytes)
        self.spin = Spin(spin_of(self.config, self.size))   # the agreement's wait (above)
        self._queue = schedule.Queue(self._knobs, self.size)
        # autotune: searches the schedule on this job's steps, switching between rounds
        self.tuner = autotune.Tuner(self.config, self.rank, self.size, table,
                                    config.poll_us) if config.autotune else None
        # a repeated small round's data beside its agreement (repeat.py); not under autotune,
        # whose switches between rounds it would have to follow, nor the timeline's events;
        # a request that partition_bytes cuts in pieces goes through the queue, never a bet
        bet_bound = REQUEST_BYTES
        if isinstance(config.partition_bytes, int) and config.partition_bytes > 0:
            bet_bound = min(bet_bound, config.partition_bytes)
        self.repeat = (Repeat(self.size, config.poll_us, request_bytes=bet_bound,
                              spin=lambda: self.spin.us(time.monotonic()))
                       if self.size > 1 and self.tuner is None and not timeline else None)
        self._join_done = threading.Event()
        self._last_joined = None
        self._thread = threading.Thread(target=self._loop, name='mpi_kvstore-' + self.name,
                                        daemon=True)
        self._thread.start()

    def _submit(self, reqs, priority):
        prepared = getattr(reqs, 'prepared', None)
        if prepared is not None and prepared.owner is self and self._native:
            # a store's prepared call (keys.Replay): the same arrays again, whose handle
            # array is built and whose record is taken again once its last op is done
            op = prepared.op(reqs, self._waker.fd)
            address = op.address
            with self._lock:
                self._inflight.append(op)
                self._addresses.append(address)
            kind = reqs[0].kind
            name = self._names.get(kind)
            if name is None:
                name = self._names[kind] = engine.encoded(op_name(kind))
            engine.push_inline(self._mark_ready_fn, address, prepared.handles, priority, name)
            return
        arrays = [r.array for r in reqs if r.array is not None]
        if not arrays:
            self._mark_ready(reqs)
            return
        # One engine op per call: a list of keys costs one op, not one each. It only
        # marks requests ready, so it may run inline when the data is ready.
        # Priorities take effect where the order is decided: each round runs its agreed
        # requests by priority, then push order (fusion.order).
        if self._native:
            op, mutable = records.NativeOp(arrays, reqs, self._waker.fd), arrays
            with self._lock:
                self._inflight.append(op)
                self._addresses.append(op.address)
            engine.push_native(records.mark_ready_address(), op.address, mutable,
                               priority=priority, name=op_name(reqs[0].kind),
                               inline_when_ready=True)
            return
        engine.push(functools.partial(self._on_engine, reqs), mutable=arrays,
                    priority=priority, name=op_name(reqs[0].kind),
                    on_error=functools.partial(self._failed_in_engine, reqs),
                    inline_when_ready=True)

    def _on_engine(self, reqs, completion):
        countdown = _countdown(reqs, completion)
        for req in reqs:
            req.complete_with(countdown)
            self.attach(req)
        self._mark_ready(reqs)

    def _collect(self):
        """Take up the native ops that ran: their requests become ready here.

        One compiled call reads every op's record (takeup.take_up); an op of one request
        over one array, the common case, then costs a few Python operations: its
        completion (a slot of the round's, completed with the others in one compiled call,
        base.complete_all) and its view."""
        if not self._inflight:
            return
        with self._lock:
            ops, addresses = self._inflight, self._addresses
            self._inflight, self._addresses = [], []
        round_, ops, waiting = takeup.take_up(ops, addresses)
        if waiting:
            with self._lock:   # the ops pushed meanwhile go after them
                self._inflight[:0] = waiting
                self._addresses[:0] = [op.address for op in waiting]
        if round_ is None:
            return
        debug.count('round', 'taken')
        reqs, slot = [], takeup.Slot
        for index, (op, row) in enumerate(zip(ops, round_.words.tolist())):
            if len(op.reqs) == 1 and row[_T_COUNT] == 1 and row[_T_MANAGED]:
                req = op.reqs[0]
                req.complete_with(slot(round_, index, req.in_place))
                device = row[_T_DEVICE]
                try:
                    req.attach(native_view(req, (row[_T_ADDRESS], device & 0xffffffff,
                                                 device >> 32)))
                except Exception as err:  # keep this rank in step with the others
                    self.fail_all([req], err)
                reqs.append(req)
                continue
            countdown = _countdown(op.reqs, slot(round_, index))
            at = 0
            for req in op.reqs:
                req.complete_with(countdown)
                if req.array is not None:   # Design.attach_native, without its partials
                    try:
                        req.attach(native_view(req, op.pointer(at)))
                    except Exception as err:  # keep this rank in step with the others
                        self.fail_all([req], err)
                    at += 1
            reqs.extend(op.reqs)
        self._mark_ready(reqs, notify=False)

    def _failed_in_engine(self, reqs, err):
        # Still offer them (on scratch memory): the other ranks wait for these.
        self.fail_all(reqs, err)
        self._mark_ready([r for r in reqs if r.seq not in self._ready])

    def _mark_ready(self, reqs, notify=True):
        if self.tuner is not None and self.tuner.active:
            self.tuner.ready(reqs)      # the step's pace: when its gradients are computed
        if self.timeline:
            for req in reqs:
                self.timeline.ready(req)
        with self._lock:
            for req in reqs:
                self._ready[req.seq] = req
        if notify:
            self._waker.notify()

    def _has_work(self):
        if self.joined:  # every round of the others needs this rank too
            return True
        limit = self._base + self._window
        return any(seq < limit for seq in self._ready)

    def join(self):
        """Mirror the others' collectives from the negotiation thread until all joined."""
        with self._lock:
            self._join_done.clear()
            self.joined = True
        self._waker.notify()
        self._join_done.wait()
        return self._last_joined

    timer_slack_ns = TIMER_SLACK_NS   # of the negotiation thread; 0 leaves the system's

    def _loop(self):
        if self.timer_slack_ns:
            tighten_timer_slack(self.timer_slack_ns)
        backoff = 0.0
        poll = self.config.poll_us * 1e-6
        while True:
            if backoff:
                self._waker.wait(backoff)  # news may come; go on regardless
            self._collect()
            queued = len(self._queue) > 0    # the same on every rank: all negotiate
            with self._lock:
                busy, stop = self._has_work(), self._stop
                limit = self._base + self._window
                offer = {s: r for s, r in self._ready.items() if s < limit} if busy else {}
            if not busy and not queued:
                if stop:
                    return
                self._waker.wait()
                continue
            if self.repeat is not None and offer and not queued and not self.joined:
                offer = self.repeat.gather(offer, self._base, self._waker.wait, self._offer)
            agreed, bad, delivered = self._negotiate(offer, queued)
            if agreed is None:  # every rank has joined (so none has anything queued)
                self._last_joined = self.finish_join(self._control)
                self._join_done.set()
                continue
            if self.tuner is not None and self.tuner.active:
                self._retune(self.tuner.round(self._control))
            if not agreed and not bad and not queued:
                backoff = min(max(2 * backoff, 1e-5), max(poll, 1e-5))
                continue
            backoff = 0.0
            self._retire(agreed + bad)
            if bad:   # the same on every rank: all of them reject, and say what they issued
                self.reject(bad, self._control)
            if delivered:   # the bet of repeat.py ran these with the agreement
                ran = {r.seq for r in delivered}
                agreed = [r for r in agreed if r.seq not in ran]
            if agreed or not delivered:
                _complete(delivered)   # their readers go on while the rest runs
                self._queue.add(agreed)
                self.dispatch(self._queue.take())
            else:
                # Completed last: a caller waiting for them wakes wanting the GIL, which this
                # thread holds until it blocks, so the bookkeeping above went first.
                _complete(delivered)

    def _offer(self):
        """The ready requests of the window, after taking up the native ops that ran."""
        self._collect()
        with self._lock:
            limit = self._base + self._window
            return {s: r for s, r in self._ready.items() if s < limit}

    def _negotiate(self, offer, queued=False):
        """One round -> (agreed, mismatched, delivered) requests, or (None, None, None) once all
        ranks joined; ``delivered``: those of the agreed ones that already ran (repeat.py)."""
        if self.size == 1:
            return sorted(offer.values(), key=lambda r: r.seq), [], None
        msg, base, repeat = self._msg, self._base, self.repeat
        agreement.window_message(msg, {s: r.sig for s, r in offer.items()}, base,
                                 self.joined, self.rank)
        started = self._control.start_min(msg)
        if repeat is not None:
            repeat.start(self._control.mpi, offer, base)
        spin = self.spin
        if spin.top:
            began = time.monotonic()
            wait_polling(started, self.config.poll_us, spin_us=spin.us(began))
            spin.waited(time.monotonic() - began)
        else:
            wait_polling(started, self.config.poll_us)
        if repeat is not None:
            repeat.wait()
        head = agreement.read_header(msg)
        if head.all_joined:
            if repeat is not None:
                repeat.forget()
            return None, None, None
        agreed, bad = agreement.window_result(
            msg, None if self.joined else [s - base for s in offer])
        delivered = (None if repeat is None
                     else repeat.settle(msg, agreed, bad, offer, base, queued, complete=False))
        if delivered:
            return [offer[base + i] for i in agreed], [], delivered
        seqs = [base + i for i in agreed + bad]
        if not head.someone_joined:
            return ([offer[s] for s in seqs[:len(agreed)]],
                    [offer[s] for s in seqs[len(agreed):]], None)
        mine = None if self.joined else [offer[s] for s in seqs]
        reqs, joined = self.exchange_with_joined(self._control, head, mine)
        runnable = self.refuse(reqs[:len(agreed)], joined)
        self._retire([r for r in reqs[:len(agreed)] if r not in runnable])
        return runnable, reqs[len(agreed):], None

    def _retire(self, reqs):
        with self._lock:
            for req in reqs:
                self._ready.pop(req.seq, None)  # a joined rank's mirrors were never ready here
                self._executed.add(req.seq)
            while self._base in self._executed:
                self._executed.discard(self._base)
                self._base += 1

    @abc.abstractmethod
    def dispatch(self, agreed):
        """Run the agreed requests the queue released, in the order given (every rank alike)."""

    def _retune(self, values):
        """Run with autotune's ``values`` from this round on: every rank calls it at the same
        round, so every rank cuts, credits, buckets and waits alike."""
        if not values:
            return
        self.config = self.config.replace(origin='autotune', **values)
        self._knobs.switch(self.config.partition_bytes, self.config.credit_bytes)
        if 'progress_sleep_us' in values:
            self.set_progress(self.config.progress_sleep_us)
            self.spin.set_top(spin_of(self.config, self.size))

    @abc.abstractmethod
    def set_progress(self, sleep_us):
        """progress_sleep_us of the data communicators, from their next collective on."""

    def close(self):
        with self._lock:
            self._stop = True
        self._waker.notify()
        self._thread.join(timeout=10)
        if self._thread.is_alive():
            return
        self._control.free()
        self._waker.close()


def _complete(reqs):
    if reqs:
        complete_all(reqs)


def _countdown(reqs, completion):
    """What completes one call's engine op once each of its requests is done.

    An error may reach the engine (and raise at the read of the op's arrays) only
    when every array of the op is a user output: a staging buffer's error would
    make the engine skip the copy that delivers its poison.
    """
    if not all(r.in_place for r in reqs):
        return engine.Countdown(completion, len(reqs), forward_errors=False)
    if len(reqs) > 1:
        return engine.Countdown(completion, len(reqs))
    return completion

