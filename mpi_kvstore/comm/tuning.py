"""Tune tables: which algorithm each collective takes by message size, and which GPU
transport a device buffer takes.

``python -m mpi_kvstore tune`` (tune.py) measures a table on the job itself; the store
loads it with the option ``tune_table``. Rank 0 reads the file and broadcasts it, and a
rank that can read its own copy must find the same content there (:func:`load`), so every
rank holds the same table, and a size's choice is a pure function of (size, communicator
size): the ranks always make the same calls. A table measured on another number of ranks
is ignored, with a warning. Between measured sizes the nearer one (in log scale) decides.
Besides allreduce, a table may hold rows for the other collectives (:data:`OPS`); an op
without rows keeps the store's own choice, so tables written before those rows still load.
Their device buffers may have rows too (``device_ops``: op -> sizes -> GPU transport); an op
without them takes the allreduce's ``device`` rows, or gpu_transport's choice.
docs/tuning.md shows the format and how the mixed GPU transports hand over.
"""
import bisect
import collections
import hashlib
import json
import logging
import math

import numpy as np

from ..errors import ConfigError
from .consensus import Setting, check
from .transports.base import REGISTRY

__all__ = ['Table', 'BySize', 'Choice', 'Reading', 'read', 'load', 'LOSSLESS', 'LOSSY', 'OPS']

log = logging.getLogger('mpi_kvstore')

LOSSLESS = ('mpi', 'rsag', 'hierarchical')
LOSSY = ('fp16', 'bf16', 'fp16-ring', 'bf16-ring')   # timed, never chosen
VERSION = 1
# The other collectives' algorithms, by op (the table's "ops" rows). broadcast: one
# MPI_Bcast, Ibcast chunks, a chain of chunks, or through the hosts (comm/broadcast.py);
# allgather and reduce-scatter: MPI's on the whole communicator, or through the hosts
# (hierarchy.Grid); alltoall: MPI_Alltoall, its one algorithm so far (timed, so a table
# records it).
OPS = {'broadcast': ('flat', 'pipelined', 'chain', 'hierarchical'),
       'allgather': ('mpi', 'hierarchical'),
       'reducescatter': ('mpi', 'hierarchical'),
       'alltoall': ('mpi',)}
# Algorithms that cut the buffer in chunks: their rows carry chunk_bytes ('hierarchical'
# broadcast may: without it, each step is one Bcast).
CHUNKED = ('pipelined', 'chain')


class Choice(collections.namedtuple('Choice', 'algorithm chunk_bytes')):
    """One row's choice: an algorithm of OPS[op], and its chunk size in bytes or None."""


class BySize:
    """A value per measured size; between two sizes the nearer one (in log scale) decides."""

    def __init__(self, sizes, values):
        order = np.argsort(sizes)
        self.sizes = [int(sizes[i]) for i in order]
        self.values = [values[i] for i in order]
        # Halfway in log scale: the integer geometric mean, the same on every machine (a
        # float edge could round apart on two ranks, and they would call different MPI).
        self._edges = [math.isqrt(a * b) for a, b in zip(self.sizes, self.sizes[1:])]
        self._chosen = {}   # nbytes -> value: the step's sizes repeat every step

    def __call__(self, nbytes):
        found = self._chosen.get(nbytes)
        if found is None:
            if len(self._chosen) > 4096:
                self._chosen.clear()
            found = self._chosen[nbytes] = self.values[bisect.bisect_right(self._edges,
                                                                             nbytes)]
        return found


class Table:
    """Which allreduce algorithm each message size takes (see the module), and optionally
    which GPU transport a device buffer of each size takes (``device``: a list of
    (bytes, transport name), as tune measured where every rank had a GPU) and which
    algorithm each other collective takes (``ops``: {op of OPS: [(bytes, algorithm,
    chunk_bytes or None)]}) and which GPU transport each other collective's device buffers
    take (``device_ops``: {op of OPS: [(bytes, transport name)]}, sizes increasing)."""

    def __init__(self, sizes, backends, comm_size, device=None, schedule=None, ops=None,
                 device_ops=None):
        if len(sizes) != len(backends) or not sizes:
            raise ValueError('a tune table needs one algorithm per size')
        bad = [b for b in backends if b not in LOSSLESS]
        if bad:
            raise ValueError('unknown allreduce algorithm(s) %s (known: %s)' % (bad, LOSSLESS))
        self._host = BySize(sizes, backends)
        self.sizes, self.backends = self._host.sizes, self._host.values
        self.comm_size = int(comm_size)
        self.device = None   # BySize of transport names, or None: gpu_transport decides
        # partition_bytes, credit_bytes (and progress_sleep_us, fusion_threshold) that tune
        # or autotune measured fastest for this job's topology, or None: the defaults
        self.schedule = _schedule(schedule)
        if device:
            bad = [name for _, name in device if name not in REGISTRY]
            if bad:
                raise ValueError('unknown GPU transport(s) %s (known: %s)'
                                 % (bad, tuple(REGISTRY)))
            self.device = BySize([int(n) for n, _ in device], [name for _, name in device])
        # op -> BySize of Choice: the rows of the other collectives (OPS); an op left out
        # keeps the store's own choice
        self.ops = {op: _op_rows(op, rows) for op, rows in (ops or {}).items()}
        # op -> BySize of transport names: the other collectives' device rows; an op left
        # out takes the allreduce's device rows (routing.DeviceRouter)
        self.device_ops = {op: _device_op_rows(op, rows)
                           for op, rows in (device_ops or {}).items()}

    def choose(self, nbytes):
        """The algorithm for an allreduce of nbytes (identical on every rank)."""
        return self._host(nbytes)

    def choose_device(self, nbytes):
        """The GPU transport the table measured fastest for nbytes, or None (no device rows)."""
        return None if self.device is None else self.device(nbytes)

    def choose_device_op(self, op, nbytes):
        """The GPU transport for a device buffer of nbytes in ``op`` (a key of OPS), or None
        where the table has no device rows for ``op``."""
        if op not in OPS:
            raise ValueError('unknown collective %r (known: %s)' % (op, ', '.join(OPS)))
        rows = self.device_ops.get(op)
        return None if rows is None else rows(nbytes)

    def choose_op(self, op, nbytes):
        """The Choice for ``op`` (a key of OPS) on nbytes, identical on every rank; None
        where the table has no rows for ``op``."""
        if op not in OPS:
            raise ValueError('unknown collective %r (known: %s)' % (op, ', '.join(OPS)))
        rows = self.ops.get(op)
        return None if rows is None else rows(nbytes)

    @property
    def needs_hierarchy(self):
        return 'hierarchical' in self.backends or any(
            choice.algorithm == 'hierarchical' for rows in self.ops.values()
            for choice in rows.values)

    def to_json(self, measured=None):
        payload = {'version': VERSION, 'comm_size': self.comm_size,
                   'allreduce': [{'bytes': s, 'algorithm': b}
                                 for s, b in zip(self.sizes, self.backends)],
                   'measured_ms': measured or {}}
        if self.schedule:
            payload['schedule'] = dict(self.schedule)
        if self.device is not None:
            payload['device'] = [{'bytes': s, 'transport': t}
                                 for s, t in zip(self.device.sizes, self.device.values)]
        if self.ops:
            payload['ops'] = {op: [dict({'bytes': s, 'algorithm': c.algorithm},
                                        **({'chunk_bytes': c.chunk_bytes}
                                           if c.chunk_bytes is not None else {}))
                                   for s, c in zip(rows.sizes, rows.values)]
                              for op, rows in self.ops.items()}
        if self.device_ops:
            payload['device_ops'] = {op: [{'bytes': s, 'transport': t}
                                          for s, t in zip(rows.sizes, rows.values)]
                                     for op, rows in self.device_ops.items()}
        return payload

    @classmethod
    def from_json(cls, payload):
        if not isinstance(payload, dict) or payload.get('version') != VERSION:
            raise ValueError('not a version-%d mpi_kvstore tune table' % VERSION)
        rows = payload['allreduce']
        device = [(r['bytes'], r['transport']) for r in payload.get('device') or ()]
        ops = payload.get('ops') or {}
        if not isinstance(ops, dict):
            raise ValueError('ops must be an object of %s, not %r' % (', '.join(OPS), ops))
        ops = {op: [(r['bytes'], r['algorithm'], r.get('chunk_bytes')) for r in op_rows]
               for op, op_rows in ops.items()}
        return cls([r['bytes'] for r in rows], [r['algorithm'] for r in rows],
                   payload['comm_size'], device, payload.get('schedule'), ops,
                   _device_ops_json(payload.get('device_ops') or {}))


def _device_ops_json(device_ops):
    """The JSON's device_ops ({op: [{bytes, transport}]}) as Table takes them, checked for
    shape (their content: _device_op_rows)."""
    if not isinstance(device_ops, dict):
        raise ValueError('device_ops must be an object of %s, not %r'
                         % (', '.join(OPS), device_ops))
    found = {}
    for op, rows in device_ops.items():
        if not isinstance(rows, list) or not all(
                isinstance(r, dict) and {'bytes', 'transport'} <= set(r) for r in rows):
            raise ValueError('device_ops %s: a list of {"bytes": ..., "transport": ...} rows '
                             'is needed, not %r' % (op, rows))
        found[op] = [(r['bytes'], r['transport']) for r in rows]
    return found


def _device_op_rows(op, rows):
    """BySize of transport names from [(bytes, transport)] of ``op``, checked: a known op
    and transport, sizes whole, >= 0 and increasing (rows out of order are a hand edit gone
    wrong, not a measurement)."""
    if op not in OPS:
        raise ValueError('device_ops: unknown collective %r (known: %s)' % (op, ', '.join(OPS)))
    if not rows:
        raise ValueError('device_ops %s: a row per size is needed, not none' % op)
    for i, (nbytes, name) in enumerate(rows):
        if name not in REGISTRY:
            raise ValueError('device_ops %s: unknown GPU transport %r at %r bytes (known: %s)'
                             % (op, name, nbytes, ', '.join(REGISTRY)))
        if not _count(nbytes):
            raise ValueError('device_ops %s: bytes must be a whole number >= 0, not %r'
                             % (op, nbytes))
        if i and nbytes <= rows[i - 1][0]:
            raise ValueError('device_ops %s: bytes must increase from row to row, but %d '
                             'follows %d' % (op, nbytes, rows[i - 1][0]))
    return BySize([int(n) for n, _ in rows], [name for _, name in rows])


def _op_rows(op, rows):
    """BySize of Choice from [(bytes, algorithm, chunk_bytes or None)] of ``op``, checked."""
    if op not in OPS:
        raise ValueError('ops: unknown collective %r (known: %s)' % (op, ', '.join(OPS)))
    if not rows:
        raise ValueError('ops %s: a row per size is needed, not none' % op)
    sizes, choices = [], []
    for nbytes, algorithm, chunk in rows:
        if algorithm not in OPS[op]:
            raise ValueError('ops %s: unknown algorithm %r at %r bytes (known: %s)'
                             % (op, algorithm, nbytes, ', '.join(OPS[op])))
        if not _count(nbytes):
            raise ValueError('ops %s: bytes must be a whole number >= 0, not %r' % (op, nbytes))
        if chunk is not None and (not _count(chunk) or chunk < 1):
            raise ValueError('ops %s: chunk_bytes at %d bytes must be a whole number >= 1, '
                             'not %r' % (op, nbytes, chunk))
        if chunk is None and algorithm in CHUNKED and op == 'broadcast':
            raise ValueError('ops %s: %s at %d bytes needs chunk_bytes' % (op, algorithm, nbytes))
        sizes.append(int(nbytes))
        choices.append(Choice(algorithm, None if chunk is None else int(chunk)))
    return BySize(sizes, choices)


def _count(value):
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


SCHEDULE_KEYS = ('partition_bytes', 'credit_bytes', 'progress_sleep_us', 'fusion_threshold')


def _schedule(values):
    """A tune table's schedule entry, checked: {option: number >= 0} of SCHEDULE_KEYS."""
    if not values:
        return None
    if not isinstance(values, dict):
        raise ValueError('schedule must be an object of %s' % ', '.join(SCHEDULE_KEYS))
    bad = sorted(set(values) - set(SCHEDULE_KEYS))
    if bad:
        raise ValueError('unknown schedule option(s) %s (known: %s)'
                         % (bad, ', '.join(SCHEDULE_KEYS)))
    out = {}
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError('schedule %s must be a number >= 0, not %r' % (name, value))
        out[name] = float(value) if name == 'progress_sleep_us' else int(value)
    return out


class Reading(collections.namedtuple('Reading', 'path payload error')):
    """What this rank read of a tune table's ``path``: the JSON ``payload``, or the
    ``error`` that kept it from being read ('' and None for no path). ``key`` and ``shown``
    are what the ranks compare (:func:`load`): the content, not the path, which may
    differ from host to host."""

    @property
    def key(self):
        if not self.path:
            return 'none'
        if self.error:
            return 'unreadable: %s' % self.error
        return hashlib.sha256(json.dumps(self.payload, sort_keys=True).encode()).hexdigest()

    @property
    def shown(self):
        if not self.path:
            return 'none'
        if self.error:
            return '%r (unreadable: %s)' % (self.path, self.error)
        return '%r (content sha256 %s)' % (self.path, self.key[:12])


def read(path):
    """This rank's Reading of the tune table at ``path`` (no collective)."""
    if not path:
        return Reading('', None, None)
    try:
        with open(path) as fh:
            payload = json.load(fh)
        Table.from_json(payload)
    except (OSError, ValueError, KeyError, TypeError) as err:
        return Reading(path, None, '%s: %s' % (type(err).__name__, err))
    return Reading(path, payload, None)


def load(path, comm, origin='argument'):
    """Collective when ``path`` is given (every rank must have been given one or none:
    topology.agree): the Table of ``path`` for communicator ``comm``, or None (no path, or a
    table of another communicator size). Rank 0 reads it and broadcasts it, so the file need
    exist only where rank 0 runs; a rank that can read its own ``path`` must find the same
    content there, else every rank raises ConfigError naming each rank's table (``origin``:
    where the path came from, for that message). A bad file raises ConfigError on every
    rank alike."""
    if not path:
        return None
    first = read(path) if comm.Get_rank() == 0 else None
    payload, why = comm.bcast((first.payload, first.error) if first else None, root=0)
    if why:
        raise ConfigError('tune_table %r cannot be used: %s (run python -m mpi_kvstore tune '
                          'to make one)' % (path, why))
    used = Reading(path, payload, None)
    mine = first or read(path)
    if mine.error:   # not on this host: rank 0's table serves
        shown = "%r (not readable here: rank 0's, content sha256 %s)" % (path, used.key[:12])
        mine = used
    else:
        shown = mine.shown
    check(comm, [Setting('tune_table', mine.key, shown, origin)], 'a store')
    table = Table.from_json(payload)
    if table.comm_size != comm.Get_size() and comm.Get_rank() == 0:
        log.warning('mpi_kvstore: tune_table %r was measured on %d ranks, this store has %d: '
                    'ignored (every collective takes its default)', path, table.comm_size,
                    comm.Get_size())
    return table if table.comm_size == comm.Get_size() else None
