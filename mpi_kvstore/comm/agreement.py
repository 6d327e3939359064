"""The agreement between ranks: int32 messages whose elementwise MIN over ranks
says what every rank issued. Pure functions: no MPI, no engine.

Every message starts with a two-int header:

- ``0`` from a rank that called ``join()`` (it has run out of data), else ``1``:
  the MIN is 0 when some rank has joined;
- ``WILDCARD`` from a joined rank, else its rank: the MIN is the lowest rank
  still active, and ``WILDCARD`` once every rank has joined.

A joined rank sends ``WILDCARD`` for everything after the header, which no MIN
sees, so the active ranks agree among themselves as if it were not there.

Group message (blocking, chained: one call's requests, checked before they run):
``[digest + 1, SIG_LIMIT - digest, n, -n]`` of the requests' signatures; the
MIN of each pair gives the smallest and the largest value over active ranks,
which differ exactly when ranks disagree.

Window message (funneled, concurrent): per slot ``i`` of the window
``[base, base + window)``, ``sig + 1`` at ``i`` and ``SIG_LIMIT - sig`` at
``window + i`` for a request ready here, 0 for one not ready: the slot is ready
everywhere when both MINs are positive, and agreed when they decode to one sig.
"""
import collections
import zlib

import numpy as np

from .collective import SIG_LIMIT

__all__ = ['WILDCARD', 'HEADER', 'Header', 'read_header', 'group_message', 'group_mismatch',
           'runs_as_offered', 'window_message', 'window_result']

WILDCARD = int(np.iinfo(np.int32).max)
HEADER = 2

Header = collections.namedtuple('Header', 'someone_joined lowest_active all_joined')


def _header(joined, rank):
    return (0, WILDCARD) if joined else (1, rank)


def read_header(msg):
    lowest = int(msg[1])
    return Header(int(msg[0]) == 0, lowest, lowest == WILDCARD)


def group_message(sigs, joined=False, rank=0):
    """The group message of requests with signatures ``sigs``."""
    if joined:
        body = (WILDCARD,) * 4
    else:
        digest = zlib.crc32(b''.join(b'%d,' % s for s in sigs)) % SIG_LIMIT
        body = (digest + 1, SIG_LIMIT - digest, len(sigs), -len(sigs))
    return np.array(_header(joined, rank) + body, dtype=np.int32)


def group_mismatch(msg):
    """After the MIN: did the active ranks issue different requests?"""
    lo, hi = msg[HEADER] - 1, SIG_LIMIT - msg[HEADER + 1]
    return bool(lo != hi or msg[HEADER + 2] != -msg[HEADER + 3])


def runs_as_offered(msg, mine):
    """After the MIN: nobody joined and every rank sent this rank's body ``mine[HEADER:]``.

    The test of the chained design's native op (engine/native.py compiles this very
    function): for an active rank it equals ``not read_header(msg).someone_joined and
    not group_mismatch(msg)``, because the MIN of each pair ``(x + 1, SIG_LIMIT - x)``
    equals this rank's pair exactly when no rank sent a smaller x and none a larger one.
    """
    if msg[0] != 1:
        return False
    for i in range(HEADER, len(msg)):
        if msg[i] != mine[i]:
            return False
    return True


def window_message(msg, offer, base, joined=False, rank=0):
    """Fill ``msg`` (int32, HEADER + 2 * window) with the ready requests ``{seq: sig}``."""
    window = (len(msg) - HEADER) // 2
    msg[:HEADER] = _header(joined, rank)
    if joined:
        msg[HEADER:] = WILDCARD
        return msg
    msg[HEADER:] = 0
    if len(offer) > _FEW:   # a burst: one numpy assignment per half, not one per request
        slots = np.fromiter(offer.keys(), np.int64, len(offer)) + (HEADER - base)
        sigs = np.fromiter(offer.values(), np.int64, len(offer))
        msg[slots] = sigs + 1
        msg[slots + window] = SIG_LIMIT - sigs
        return msg
    for seq, sig in offer.items():
        msg[HEADER + seq - base] = sig + 1
        msg[HEADER + window + seq - base] = SIG_LIMIT - sig
    return msg


# Up to this many ready requests, a message is filled one by one: numpy's setup costs more.
_FEW = 8


def window_result(msg, offered=None):
    """After the MIN: (agreed slots, mismatched slots), as offsets from the base, ascending.

    ``offered``: the slots this rank offered, where it is not joined. A slot that a rank
    did not offer has 0 in the MIN, so only those can be ready everywhere: reading them
    alone gives the same answer as a scan of the whole window, at a cost per request.
    """
    window = (len(msg) - HEADER) // 2
    if offered is not None and len(offered) <= _FEW:
        agreed, bad = [], []
        for i in sorted(offered):
            lo, hi = int(msg[HEADER + i]), int(msg[HEADER + window + i])
            if lo > 0 and hi > 0 and lo != WILDCARD:
                (agreed if lo - 1 == SIG_LIMIT - hi else bad).append(i)
        return agreed, bad
    lo, hi = msg[HEADER:HEADER + window], msg[HEADER + window:]
    if offered is not None:
        slots = np.sort(np.fromiter(offered, np.int64, len(offered)))
        lo, hi = lo[slots], hi[slots]
        ready = (lo > 0) & (hi > 0) & (lo != WILDCARD)
        match = lo - 1 == SIG_LIMIT - hi
        return slots[ready & match].tolist(), slots[ready & ~match].tolist()
    ready = np.flatnonzero((lo > 0) & (hi > 0) & (lo != WILDCARD))
    if not ready.size:
        return [], []
    # a slot agrees when both encodings decode to one sig (SIG_LIMIT - hi: no overflow,
    # since 0 < hi <= SIG_LIMIT)
    match = lo[ready] - 1 == SIG_LIMIT - hi[ready]
    return ready[match].tolist(), ready[~match].tolist()
