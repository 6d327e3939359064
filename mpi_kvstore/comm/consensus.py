"""Collective: one check that every rank of a communicator was given the same settings.

Ranks given different designs, fusion thresholds, pieces or compression would pair
different collectives and hang, or sum different things. So a store compares, when it is
created and before any other collective, every option that must agree (config.AGREED), the
content of its tune table, and the package's version, in ONE MIN-allreduce of fixed size:
each setting is sent as a 56-bit hash ``h`` and as ``-h``, and the MIN of both halves gives
the smallest and the largest hash over the ranks, which differ exactly where ranks disagree
(up to a hash collision, about 1 in 10^16). Only then do the ranks gather the values of the
settings that differ, so that the ``ConfigError`` every rank raises names each of them with
every rank's value and where it came from.

The message has room for :data:`SLOTS` settings whatever a rank's version sends, so ranks
running different versions of the package still meet in one allreduce of one size and are
told so (the version is the first setting), instead of hanging.
"""
import collections
import hashlib

import numpy as np

from ..errors import ConfigError
from .mpiabi import MPI

__all__ = ['Setting', 'SLOTS', 'digest', 'check', 'describe', 'rank_ranges']

SLOTS = 64

Setting = collections.namedtuple('Setting', 'name key shown origin')
Setting.__doc__ = """One setting to compare: ``key`` is what must be equal (a str, compared by
hash), ``shown`` how the error message writes this rank's value, ``origin`` where it came
from ('argument', 'environment variable ...', 'default', 'tune table', ...)."""


def digest(key):
    """A setting's key as a non-negative int64 (56 bits of BLAKE2b, so -digest fits too)."""
    return int.from_bytes(hashlib.blake2b(str(key).encode(), digest_size=7).digest(), 'little')


def check(comm, settings, what='a store', gates=()):
    """Collective over ``comm``: return if every rank passed equal settings (by name and
    key, in the same order), else raise ConfigError on every rank alike, naming each
    setting that differs with every rank's value. ``what`` names the object in the
    message ('a store', 'a process set', ...). A setting named in ``gates`` that differs is
    named alone: it says the rest cannot be compared (a rank whose options are invalid
    sends no others)."""
    settings = list(settings)
    if len(settings) > SLOTS:
        raise ValueError('consensus.check: %d settings, room for %d' % (len(settings), SLOTS))
    if comm.Get_size() == 1:
        return
    # A slot beyond this rank's settings holds 0 on every rank that has none there, and a
    # setting's hash never equals another's name by chance, so the name is hashed in.
    mine = np.zeros(2 * SLOTS, dtype=np.int64)
    for i, s in enumerate(settings):
        mine[i] = digest('%s=%s' % (s.name, s.key)) + 1
        mine[SLOTS + i] = -mine[i]
    comm.Allreduce(MPI.IN_PLACE, mine, op=MPI.MIN)
    differ = [i for i in range(SLOTS) if mine[i] != -mine[SLOTS + i]]
    if not differ:
        return
    # Rare and at creation: an object allgather on the caller's thread is fine here.
    table = comm.allgather([(s.name, s.shown, s.origin) for s in settings])
    gated = [i for i in differ if any(i < len(row) and row[i][0] in gates for row in table)]
    raise ConfigError(describe(table, gated or differ, what))


def describe(table, slots, what='a store'):
    """The message for ``table`` (per rank, the (name, shown, origin) of each setting) where
    the settings in ``slots`` differ: each named once, with every rank's value grouped."""
    parts, seen = [], set()
    for slot in slots:
        names = {row[slot][0] for row in table if slot < len(row)}
        for name in sorted(names):
            if name in seen:
                continue
            seen.add(name)
            parts.append('%s: %s' % (name, _values_of(table, name)))
    return ('ranks of %s disagree on %s. Every rank must be given the same value of %s '
            '(docs/configuration.md marks the options that must agree)'
            % (what, '; '.join(parts), 'this' if len(parts) == 1 else 'these'))


def _values_of(table, name):
    groups = collections.OrderedDict()
    for rank, row in enumerate(table):
        found = [(shown, origin) for n, shown, origin in row if n == name]
        groups.setdefault(found[0] if found else ('(not known to this version)', ''),
                          []).append(rank)
    return ', '.join('%s on %s%s' % (shown, rank_ranges(ranks), ' (%s)' % origin if origin else '')
                     for (shown, origin), ranks in groups.items())


def rank_ranges(ranks):
    """'rank 3', 'ranks 0, 2' or 'ranks 0-3, 7': sorted ranks, runs folded."""
    ranks = sorted(ranks)
    runs, start = [], ranks[0]
    for prev, cur in zip(ranks, ranks[1:] + [None]):
        if cur != prev + 1:
            runs.append('%d' % start if start == prev else '%d-%d' % (start, prev))
            start = cur
    return ('rank ' if len(ranks) == 1 else 'ranks ') + ', '.join(runs)
