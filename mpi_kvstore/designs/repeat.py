"""A repeated round's data sent beside its agreement: one rendezvous instead of two.

A training loop, or a loop of lone calls, issues the same collectives again and again:
the same keys, shapes and dtypes in the same pattern of rounds. Every rank keeps a small
history: for each round, the round that followed it last time. After a round, every rank
looks up what followed that round before, and bets that the next round agrees on it
again: it starts the bet's data SUM right after the next agreement's MIN, both in flight
at once, instead of waiting for the MIN before starting the data.

The agreement still decides. The bet pays when the round agreed every request of the bet,
with the same signatures, no mismatch, nobody joined and nothing queued: then every rank
had the whole bet ready with those signatures, so every rank sent its data, and the sums
go to those requests; the round's other agreed requests run as any round's. Otherwise the
sum is dropped (it was made in a buffer of its own: the user's arrays were not written) and
the round goes on as any round, its mismatch raised on every rank as before.

Every rank makes the same MPI calls: the history is fed only by agreed rounds (a
signature fixes kind, key, shape, dtype, place, priority and codec), so whether a bet is
placed, and its count and dtype, are the same everywhere; a rank whose offer lacks part of
the bet sends zeros.

A burst (a step's gradients, issued back to back) is agreed in rounds whose cut depends on
timing. So a rank that holds part of the predicted round, not all of it, waits a little
(``GATHER_S``, on its waker, not spinning) for the rest before it offers: the rounds then
repeat from step to step, and the bets win. This wait is local and bounded: it changes
when a rank offers, never what the ranks agree.
"""
import operator
import time

import numpy as np

from .. import debug
from ..comm import agreement
from ..comm.mpiabi import MPI
from ..comm.progress import wait_polling
from ..comm.reduce import scale
from ..engine import rounds

__all__ = ['Repeat', 'MAX_BYTES', 'REQUEST_BYTES', 'DTYPES', 'GATHER_S', 'PAUSE_S', 'MAX_PAUSE_S',
           'HISTORY']

# The most bytes one bet carries (the first requests of the predicted round that fit):
# a lost bet costs an allreduce of this size beside the agreement, and a buffer of it. A
# few MB is a step of many small tensors (100 x 16 KB is 1.6 MB), where the rendezvous
# decide the time; a larger round is bandwidth-bound, and its pieces, credit and fusion
# buckets (schedule.py, fusion.py) do better than one allreduce ahead of the agreement.
MAX_BYTES = 4 << 20
# The largest request a bet carries. A bet copies its data into a buffer of its own and back,
# and waits on it with polls: a larger request, bandwidth-bound, runs faster in place as any
# round's (a 1 MB allreduce took twice raw MPI's time in a bet).
REQUEST_BYTES = 64 << 10
DTYPES = frozenset(np.dtype(name) for name in ('float32', 'float64', 'int32', 'int64'))
# How long a rank holding part of the predicted round waits for the rest before it offers:
# about a burst's issue time in Python (100 calls at 10-20 us each). A pattern that changed
# pays it once: the history then records the round that really followed.
GATHER_S = 0.002
# gather's pause after a wake-up, per request still lacking but the last, and at most: the
# thread looks again about once per few calls of a burst instead of once per call, and the
# last call of a burst waits for no pause.
PAUSE_S = 10e-6
MAX_PAUSE_S = 200e-6
# Rounds remembered: a step's distinct rounds; the oldest is forgotten first.
HISTORY = 256


class Repeat:
    """The bet of one negotiation thread (:class:`negotiated.Negotiated`), over ``size``
    ranks; ``poll_us``: how its waits poll, ``spin()``: how long they first spin, in
    microseconds (progress.wait_polling)."""

    def __init__(self, size, poll_us, max_bytes=MAX_BYTES, request_bytes=REQUEST_BYTES,
                 spin=lambda: 0):
        self._size, self._poll_us, self._max_bytes = size, poll_us, max_bytes
        self._spin = spin
        self._request_bytes = request_bytes
        self._history = {}     # (slots, sigs) of a round -> (slots, sigs, bet) of the next
        self._last = None      # (slots, sigs) of the last round, where it was clean
        self._expect = None    # (slots, sigs) of the round predicted next
        self._armed = None     # (slots, sigs, dtype, counts): the bet of this round
        self._buffer = np.empty(0, dtype=np.float32)
        self._pending = None
        self._places = None    # (views, their addresses, their bytes) of the last bet
        self.stats = {'won': 0, 'lost': 0}

    def missing(self, offer, base):
        """Whether ``offer`` ({seq: request}) holds part of the predicted round, not all."""
        return self._lacking(offer, base) > 0

    def _lacking(self, offer, base):
        """How many requests of the predicted round ``offer`` lacks where it holds some of
        them, else 0."""
        if self._expect is None:
            return 0
        slots, sigs = self._expect
        have = 0
        for slot, sig in zip(slots, sigs):
            req = offer.get(base + slot)
            if req is not None and req.sig == sig:
                have += 1
        return len(slots) - have if 0 < have < len(slots) else 0

    def gather(self, offer, base, wait, refresh, budget=GATHER_S, sleep=time.sleep):
        """Wait (``wait(seconds)``, then ``refresh()`` -> a new offer) while ``offer`` holds
        part of the predicted round, at most ``budget`` seconds -> the offer to make.

        After each wake-up it sleeps a little more (``sleep``: PAUSE_S a request still
        lacking, at most MAX_PAUSE_S) before it looks: a burst's calls arrive some 10-40 us
        apart, each wakes the thread, and a look per call cost the thread more than the
        rest of its work on the burst."""
        deadline = None
        while True:
            lacking = self._lacking(offer, base)
            if not lacking:
                return offer
            now = time.monotonic()
            if deadline is None:
                deadline = now + budget
            if now >= deadline:
                return offer
            wait(deadline - now)
            rest = deadline - time.monotonic()
            if lacking > 1 and rest > 0:
                sleep(min(rest, (lacking - 1) * PAUSE_S, MAX_PAUSE_S))
            offer = refresh()

    def start(self, comm, offer, base):
        """Right after the agreement's MIN started on the mpi4py ``comm``: start the bet's
        SUM, with this rank's data of the bet if ``offer`` ({seq: request}) holds all of it."""
        if self._armed is None:
            return
        slots, sigs, dtype, counts = self._armed
        total = sum(counts)
        if self._buffer.dtype != dtype or self._buffer.size < total:
            self._buffer = np.empty(max(total, 1024), dtype=dtype)
        buf = self._buffer[:total]
        reqs = [offer.get(base + slot) for slot in slots]
        if all(r is not None and r.sig == sig and r.view is not None and r.error is None
               for r, sig in zip(reqs, sigs)):
            places = self._places_of([r.view for r in reqs], buf.nbytes)
            if places is not None:   # one compiled copy, not one numpy call a request
                rounds.gather(buf.view(np.uint8), *places)
            elif len(reqs) == 1:
                buf[...] = reqs[0].view.reshape(-1)
            else:
                np.concatenate([r.view.reshape(-1) for r in reqs], out=buf)
        else:
            buf[...] = 0
        self._pending = comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM)

    def wait(self):
        """After the MIN: wait for the bet's SUM, if one was started."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            wait_polling(pending, self._poll_us, spin_us=self._spin())

    def settle(self, msg, agreed, bad, offer, base, queued, complete=True):
        """After the round's MIN (``msg``) and the bet's SUM: -> the requests the bet
        delivered (some or all of the round's agreed ones), or None where it did not pay;
        completed here unless ``complete`` is False (then the caller completes them). Then
        arm the next round's bet from the history."""
        head = agreement.read_header(msg)
        clean = not bad and not head.someone_joined and not queued and bool(agreed)
        now = None
        if clean:
            now = (tuple(agreed), tuple(_sigs(msg, agreed)))
        armed = self._armed
        self._learn(now, offer, base)
        if armed is None:
            return None
        if now is None or not _covers(now, armed):
            self.stats['lost'] += 1
            debug.count('repeat', 'lost')
            return None
        self.stats['won'] += 1
        debug.count('repeat', 'won')
        reqs = [offer[base + slot] for slot in armed[0]]
        buf = self._buffer[:sum(armed[3])]
        head = reqs[0]
        every = all(r.average == head.average and r.factor == head.factor for r in reqs)
        if every:   # one scaling of the whole sum, not one a request
            scale(buf, head.average, head.factor, self._size)
            places = self._places_of([r.buffer() for r in reqs], buf.nbytes)
            if places is not None:   # one compiled copy back, not one numpy call a request
                rounds.scatter(buf.view(np.uint8), *places)
                if complete:
                    for req in reqs:
                        req.complete()
                return reqs
        at = 0
        for req, count in zip(reqs, armed[3]):
            view = req.buffer()
            view[...] = buf[at:at + count].reshape(view.shape)
            at += count
            if not every:
                scale(view, req.average, req.factor, self._size)
            if complete:
                req.complete()
        return reqs

    def _places_of(self, views, nbytes):
        """(addresses, bytes) of ``views`` for rounds.gather and scatter, kept while a bet
        finds the very same views again (arrays.host_view keeps one a buffer); None where one
        is not a contiguous host array, or where they do not hold ``nbytes`` in all."""
        known = self._places
        if (known is not None and len(known[0]) == len(views) and known[3] == nbytes
                and all(map(operator.is_, views, known[0]))):
            return known[1:3]
        if not all(type(v) is np.ndarray and v.flags.c_contiguous for v in views):
            return None
        sizes = np.array([v.nbytes for v in views], dtype=np.int64)
        if int(sizes.sum()) != nbytes:
            return None
        self._places = (views, np.array([v.ctypes.data for v in views], dtype=np.int64),
                        sizes, nbytes)
        return self._places[1:3]

    def _learn(self, now, offer, base):
        """Record ``now`` as what followed the last round; predict and arm the next."""
        if now is not None and self._last is not None:
            history = self._history
            known = history.get(self._last)
            if known is None or known[:2] != now:   # a repeated round keeps its bet
                if known is None and len(history) >= HISTORY:
                    del history[next(iter(history))]
                history[self._last] = now + (_bet(now, [offer[base + s] for s in now[0]],
                                                  self._max_bytes, self._request_bytes),)
        self._last = now
        follows = None if now is None else self._history.get(now)
        self._expect = None if follows is None else follows[:2]
        self._armed = None if follows is None else follows[2]

    def forget(self):
        """No bet next round, and no history (every rank calls it at the same round)."""
        self._armed = self._last = self._expect = None
        self._history.clear()


def _sigs(msg, slots):
    """The agreed signatures of ``slots`` (after the MIN: the sig + 1 encodings)."""
    if len(slots) > 8:
        return (msg[agreement.HEADER + np.asarray(slots)] - 1).tolist()
    return [int(msg[agreement.HEADER + slot]) - 1 for slot in slots]


def _covers(now, armed):
    """Whether the round agreed ``now`` ((slots, sigs)) agreed every request of ``armed``."""
    agreed = dict(zip(*now))
    return all(agreed.get(slot) == sig for slot, sig in zip(armed[0], armed[1]))


def _bet(round_, reqs, max_bytes, request_bytes=REQUEST_BYTES):
    """(slots, sigs, dtype, counts): the first agreed requests of ``round_`` a bet may carry
    (allreduces on the CPU, no codec, of the first one's dtype, up to ``max_bytes``), else
    None. Reads only what the signatures fix, so every rank gets the same answer."""
    dtype, slots, sigs, counts, total = reqs[0].dtype, [], [], [], 0
    if dtype not in DTYPES:
        return None
    for slot, sig, req in zip(round_[0], round_[1], reqs):
        total += req.nbytes
        if (req.kind != 'allreduce' or req.codec is not None or req.place != 'cpu'
                or req.dtype != dtype or not 0 < req.nbytes <= request_bytes or req.mirror
                or total > max_bytes):
            break
        slots.append(slot)
        sigs.append(sig)
        counts.append(req.nbytes // dtype.itemsize)
    return (tuple(slots), tuple(sigs), dtype, tuple(counts)) if slots else None
