"""A repeated round's data sent beside its agreement: one rendezvous instead of two.

A training loop, or a loop of lone calls, issues the same small collectives again and
again: the same keys, shapes and dtypes, ready together. Once two rounds in a row agreed
on the same small set of requests (the same window slots, the same signatures), every
rank bets that the next round agrees on that set again: it starts the set's data SUM right
after the agreement's MIN, both in flight at once, instead of waiting for the MIN before
starting the data.

The agreement still decides. The bet pays only when the round agreed exactly that set,
with no mismatch, nobody joined and nothing queued: then every rank had the whole set
ready with those signatures, so every rank sent its data, and the sums go to the
requests. Otherwise the sum is dropped (it was made in a buffer of its own: the user's
arrays were not written) and the round goes on as any round, its mismatch raised on every
rank as before.

Every rank makes the same MPI calls: whether a bet is placed, and its count and dtype,
follow from what earlier rounds agreed (a signature fixes kind, key, shape, dtype, place,
priority and codec), and a rank whose offer lacks part of the set sends zeros.
"""
import numpy as np

from .. import debug
from ..comm import agreement
from ..comm.mpiabi import MPI
from ..comm.progress import wait_polling

__all__ = ['Repeat', 'MAX_BYTES', 'DTYPES']

# The largest set bet on: a lost bet costs an allreduce of this many bytes, beside the
# agreement's; a round this small is the one whose latency the rendezvous decide.
MAX_BYTES = 64 * 1024
DTYPES = frozenset(np.dtype(name) for name in ('float32', 'float64', 'int32', 'int64'))


class Repeat:
    """The bet of one negotiation thread (:class:`negotiated.Negotiated`), over ``size``
    ranks; ``poll_us``: how its waits poll (progress.wait_polling)."""

    def __init__(self, size, poll_us):
        self._size, self._poll_us = size, poll_us
        self._last = None      # the last round's set, where it could be bet on
        self._armed = None     # (slots, sigs, dtype, counts): the set this round bets on
        self._buffer = np.empty(0, dtype=np.float32)
        self._pending = None
        self.stats = {'won': 0, 'lost': 0}

    def start(self, comm, offer, base):
        """Right after the agreement's MIN started on the mpi4py ``comm``: start the bet's
        SUM, with this rank's data of the set if ``offer`` ({seq: request}) holds all of it."""
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
            at = 0
            for req, count in zip(reqs, counts):
                buf[at:at + count] = req.buffer()
                at += count
        else:
            buf[...] = 0
        self._pending = comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM)

    def wait(self):
        """After the MIN: wait for the bet's SUM, if one was started."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            wait_polling(pending, self._poll_us)

    def settle(self, msg, agreed, bad, offer, base, queued):
        """After the round's MIN (``msg``) and the bet's SUM: -> the requests the bet
        delivered and completed (the round's agreed ones), or None where it did not pay.
        Then arm the next round's bet, where this round repeated the last one."""
        head = agreement.read_header(msg)
        clean = not bad and not head.someone_joined and not queued and bool(agreed)
        now = None
        if clean:
            sigs = tuple(int(msg[agreement.HEADER + slot]) - 1 for slot in agreed)
            now = _betting_set(tuple(agreed), sigs, [offer[base + slot] for slot in agreed])
        armed, self._armed = self._armed, (now if now is not None and now == self._last
                                           else None)
        self._last = now
        if armed is None:
            return None
        if now is None or now[:2] != armed[:2]:
            self.stats['lost'] += 1
            debug.count('repeat', 'lost')
            return None
        self.stats['won'] += 1
        debug.count('repeat', 'won')
        reqs = [offer[base + slot] for slot in agreed]
        at = 0
        for req, count in zip(reqs, armed[3]):
            view = req.buffer()
            view[...] = self._buffer[at:at + count]
            at += count
            if req.average:
                if view.dtype.kind == 'f':
                    view *= 1.0 / self._size
                else:
                    view //= self._size
            req.complete()
        return reqs

    def forget(self):
        """No bet next round (every rank calls it at the same round)."""
        self._armed = self._last = None


def _betting_set(slots, sigs, reqs):
    """(slots, sigs, dtype, counts) of agreed requests a bet may carry, else None. Reads
    only what the signatures fix, so every rank gets the same answer."""
    dtype = reqs[0].dtype
    if sum(r.nbytes for r in reqs) > MAX_BYTES or dtype not in DTYPES:
        return None
    for req in reqs:
        if (req.kind != 'allreduce' or req.codec is not None or req.place != 'cpu'
                or req.dtype != dtype or req.nbytes <= 0 or req.mirror):
            return None
    return slots, sigs, dtype, tuple(r.nbytes // dtype.itemsize for r in reqs)
