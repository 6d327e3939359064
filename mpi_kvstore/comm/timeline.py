"""A Chrome trace (chrome://tracing, Perfetto) of every collective, per rank.

Phases per request, on one row per key: QUEUED (pushed until the engine found
its data ready), NEGOTIATE (ready until its collective started: agreement with
the other ranks and waiting for earlier buckets) and the collective itself,
named as the engine op that carries it (``mpi_kvstore.allreduce``...), which is
also the name MXNet's profiler shows for that op.
"""
import json
import os
import threading
import time

__all__ = ['Timeline', 'trace_path', 'op_name']

def op_name(kind):
    """The engine op name of a collective kind, shared with engine.push."""
    return 'mpi_kvstore.' + kind


def trace_path(path, rank, size):
    """'trace.json' -> 'trace.rank1.json' when there is more than one rank."""
    if size == 1:
        return path
    root, ext = os.path.splitext(path)
    return '%s.rank%d%s' % (root, rank, ext or '.json')


def _unit(req):
    """Where a request's or a piece's own marks are kept."""
    index = getattr(req, 'index', None)
    return req.seq if index is None else (req.seq, index)


class Timeline:
    def __init__(self, path, rank, size):
        self.path = trace_path(path, rank, size)
        self.rank = rank
        self._t0 = time.perf_counter()
        self._lock = threading.Lock()
        self._marks = {}
        self._pieces_done = {}    # seq -> pieces of that request finished so far
        self._events = []
        self._rows = {}

    def _now(self):
        return (time.perf_counter() - self._t0) * 1e6

    def _mark(self, req, what):
        with self._lock:
            self._marks.setdefault(req.seq, {})[what] = self._now()

    def pushed(self, req):
        self._mark(req, 'pushed')

    def ready(self, req):
        self._mark(req, 'ready')

    def started(self, bucket):
        now = self._now()
        with self._lock:
            for req in bucket:
                self._marks.setdefault(_unit(req), {})['started'] = now

    def finished(self, bucket):
        end = self._now()
        with self._lock:
            for req in bucket:
                marks = self._marks.pop(_unit(req), {})
                parent = getattr(req, 'parent', None)
                if parent is not None:   # a piece (schedule.Piece): its request's marks too
                    # pieces may finish in any order (concurrent's lanes): the last to finish
                    # drops the request's marks
                    done = self._pieces_done.get(req.seq, 0) + 1
                    last = done == req.pieces
                    if last:
                        self._pieces_done.pop(req.seq, None)
                    else:
                        self._pieces_done[req.seq] = done
                    shared = (self._marks.pop if last else self._marks.get)(req.seq, {})
                    marks = dict(shared, **marks)
                self._emit(req, marks, end, len(bucket))

    def _row(self, key):
        return self._rows.setdefault(repr(key), len(self._rows) + 1)

    def record_into(self, path):
        """Keep events from now on, for ``path``; None: keep none, write nothing, while still
        following the requests (Horovod's start_timeline and stop_timeline)."""
        with self._lock:
            self._events.clear()
            self.path = path

    def _emit(self, req, marks, end, bucket_size):
        if self.path is None:
            return
        pushed = marks.get('pushed', end)
        ready = marks.get('ready', pushed)
        started = marks.get('started', ready)
        key = getattr(req, 'parent', req).key
        args = {'seq': req.seq, 'key': repr(key), 'bytes': req.nbytes,
                'bucket_requests': bucket_size}
        if hasattr(req, 'parent'):
            args['piece'] = req.index
        tid = self._row(key)
        for name, t0, t1 in (('QUEUED', pushed, ready), ('NEGOTIATE', ready, started),
                             (op_name(req.kind), started, end)):
            self._events.append({'name': name, 'cat': 'mpi_kvstore', 'ph': 'X', 'ts': t0,
                                 'dur': max(t1 - t0, 0.0), 'pid': self.rank, 'tid': tid,
                                 'args': args})

    def write(self):
        if self.path is None:
            return
        meta = [{'name': 'process_name', 'ph': 'M', 'pid': self.rank,
                 'args': {'name': 'rank %d' % self.rank}}]
        meta += [{'name': 'thread_name', 'ph': 'M', 'pid': self.rank, 'tid': tid,
                  'args': {'name': 'key %s' % key}} for key, tid in self._rows.items()]
        with self._lock:
            payload = {'traceEvents': meta + self._events, 'displayTimeUnit': 'ms'}
        with open(self.path, 'w') as fh:
            json.dump(payload, fh)
