"""A round of the native ops (records.py) that the negotiated designs' thread found ready:
``take_up`` reads their records in one compiled call (rounds.py) into a :class:`Round`, whose
:class:`Slot` per op completes it in the engine, alone or many at once (``complete_slots``);
and the eventfd (:class:`Waker`) that the ops write to wake the thread waiting for them.
Apart from records.py, which builds the records: this is what reads them after the fact."""
import os
import select
import threading

import numpy as np

from . import core as engine
from . import layout as L  # the records' words: L.READY
from . import rounds

__all__ = ['Round', 'Slot', 'complete_slots', 'take_up', 'Waker']


class Round:
    """The engine completions of the native ops that one take-up found ready: ``words``, a
    row per op as rounds.take_up read it (rounds.TAKEN), and ``arrays``, each op's arrays
    (which an error is raised on). Each is given at most once, by :meth:`done` (one op,
    maybe with an error) or :meth:`done_many` (many, without error, in one compiled call).
    It holds no op nor request: a request holds it (through its :class:`Slot`), and a
    cycle through the ops' requests would keep every array of the round until a collection."""

    __slots__ = ('words', 'arrays', '_done', '_lock')

    def __init__(self, words, arrays):
        self.words, self.arrays = words, arrays
        self._done = bytearray(len(arrays))
        self._lock = threading.Lock()

    def done(self, index, error=None):
        with self._lock:
            if self._done[index]:
                return
            self._done[index] = 1
            arrays, self.arrays[index] = self.arrays[index], ()
        callback, engine_, param = self.words[index, 1:4].tolist()
        engine.Completion.native(callback, engine_, param, arrays).done(error)

    def done_many(self, indices):
        with self._lock:
            rows = [i for i in indices if not self._done[i]]
            for i in rows:
                self._done[i] = 1
                self.arrays[i] = ()
        if rows:
            rounds.complete_ops(self.words, np.array(rows, dtype=np.int64))


class Slot:
    """The completion of op ``index`` of a :class:`Round`, as engine.Completion's
    ``done(error)``; ``forward``: whether an error reaches the engine (False: the op's
    array is a staging buffer, whose error would make the engine skip the copy that
    delivers its poison)."""

    __slots__ = ('round', 'index', 'forward')

    def __init__(self, round_, index, forward=True):
        self.round, self.index, self.forward = round_, index, forward

    def done(self, error=None):
        self.round.done(self.index, error if self.forward else None)


def complete_slots(slots):
    """Complete, without error, the ops of ``slots`` (:class:`Slot`), one compiled call per
    round they come from (one, mostly)."""
    first = slots[0].round
    if all(slot.round is first for slot in slots):
        first.done_many([slot.index for slot in slots])
        return
    rounds = {}
    for slot in slots:
        rounds.setdefault(id(slot.round), (slot.round, []))[1].append(slot.index)
    for round_, indices in rounds.values():
        round_.done_many(indices)


def take_up(ops, addresses):
    """The records of ``ops`` (NativeOps at ``addresses``) read in one compiled call ->
    (a :class:`Round` of the ready ones or None, the ready ones, the others), in order."""
    words = np.empty((len(ops), len(rounds.TAKEN)), dtype=np.int64)
    ready = rounds.take_up(np.array(addresses, dtype=np.int64), words)
    if not ready:
        return None, [], ops
    taken, waiting = ops, []
    if ready < len(ops):
        mask = words[:, 0] == L.READY
        taken = []
        for op, is_ready in zip(ops, mask.tolist()):
            (taken if is_ready else waiting).append(op)
        words = words[mask]
    return Round(words, [op.arrays for op in taken]), taken, waiting


class Waker:
    """An eventfd: native ops and Python threads write it; one thread waits on it."""

    def __init__(self):
        self.fd = os.eventfd(0, os.EFD_NONBLOCK)

    def notify(self):
        os.eventfd_write(self.fd, 1)

    def wait(self, timeout=None):
        """Until written (or ``timeout`` seconds), with the GIL released; drains it.

        Non-blocking, so that where two threads wait, the one that finds the counter
        drained by the other goes back to its caller instead of blocking.
        """
        if select.select([self.fd], [], [], timeout)[0]:
            try:
                os.eventfd_read(self.fd)
            except BlockingIOError:
                pass

    def close(self):
        os.close(self.fd)
