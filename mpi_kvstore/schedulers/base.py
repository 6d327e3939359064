"""What every scheduler shares: sequence numbers, execution of buckets, errors."""
import itertools
import logging
import zlib

import numpy as np

from ..arrays import flat_view
from ..comm import MPI
from ..errors import RankMismatchError
from ..fusion import plan
from ..request import SIG_LIMIT

__all__ = ['Scheduler', 'FusionPool', 'group_check_message', 'group_mismatch']

log = logging.getLogger(__name__)


class FusionPool:
    """Reusable flat buffers for fused buckets, one per (dtype, host/device)."""

    def __init__(self):
        self._buffers = {}

    def get(self, like, count):
        module = type(like).__module__.split('.')[0]
        key = (module, like.dtype.str)
        buf = self._buffers.get(key)
        if buf is None or buf.size < count:
            xp = np if module == 'numpy' else __import__(module)
            buf = self._buffers[key] = xp.empty(max(count, 1024), dtype=like.dtype)
        return buf[:count]


def group_check_message(reqs):
    """Fixed-size int32 message whose elementwise MIN across ranks shows any disagreement."""
    digest = zlib.crc32(b''.join(b'%d,' % r.sig for r in reqs)) % SIG_LIMIT
    return np.array([digest + 1, SIG_LIMIT - digest, len(reqs), -len(reqs)], dtype=np.int32)


def group_mismatch(msg):
    lo, hi = msg[0] - 1, SIG_LIMIT - msg[1]
    return lo != hi or msg[2] != -msg[3]


class Scheduler:
    """Base of the designs. Subclasses define ``_submit`` and say in their docstring
    which MPI thread level they need and how they keep one collective order."""

    name = ''
    thread_level = MPI.THREAD_SERIALIZED

    def __init__(self, comm, config, sink, timeline=None):
        self.config = config
        self.size = comm.Get_size()
        self.rank = comm.Get_rank()
        self._sink = sink
        self._seq = itertools.count()
        self.pushed = 0  # collectives numbered so far (read by the stall inspector)
        self._pools = {}  # one per communicator: lanes of the concurrent design run at once
        self.timeline = timeline

    # -- called on the user's thread ---------------------------------------
    def submit(self, reqs, priority=0):
        """Number the requests in call order, then hand them to the design."""
        for req in reqs:
            req.seq = next(self._seq)
            self.pushed = req.seq + 1
            # Within a round, collectives run by priority: every rank must pass the same.
            req.priority = priority
            req.sig = (req.sig * 31 + priority) % SIG_LIMIT
            if self.timeline:
                self.timeline.pushed(req)
        self._submit(reqs, priority)

    def _submit(self, reqs, priority):
        raise NotImplementedError

    @property
    def synchronous(self):
        """True when a call returns only after its collectives ran (errors are known)."""
        return self.config.naive_engine

    def close(self):
        """Stop threads; the caller has already waited for every request."""

    # -- called where the collective runs ----------------------------------
    def attach(self, req):
        """Point the request at its array's memory, inside the engine op holding it."""
        if req.array is None:
            return
        try:
            req.view = flat_view(req.array, req.nbytes, req.dtype)
        except Exception as err:  # keep this rank in step with the others: reduce zeros
            self.fail_all([req], err)

    def fail(self, req, err):
        req.error = err
        self._sink(req, err)

    def fail_all(self, reqs, err):
        """Fail requests that still take part: those without memory get zeros to send."""
        for req in reqs:
            if req.view is None and req.array is not None:
                req.scratch = np.zeros(req.nbytes // req.dtype.itemsize, dtype=req.dtype)
            if req.error is None:
                self.fail(req, err)

    def mismatch(self, req):
        self.fail(req, RankMismatchError(
            'ranks disagree on %s: every rank must issue the same keys, shapes and dtypes '
            'in the same order' % req.describe()))

    def reject(self, reqs):
        """Ranks agreed that these do not match: fail and complete them, run nothing."""
        for req in reqs:
            self.mismatch(req)
            req.complete()

    def agree(self, reqs, comm):
        """One MIN-allreduce of a fingerprint of ``reqs``: True when every rank issued them."""
        if self.size == 1:
            return True
        msg = group_check_message(reqs)
        comm.check_min(msg)
        return not group_mismatch(msg)

    def agree_and_execute(self, reqs, comm):
        if self.agree(reqs, comm):
            self.execute_all(reqs, comm)
        else:
            self.reject(reqs)

    def execute_all(self, reqs, comm):
        for bucket in plan(reqs, self.config.fusion_threshold):
            self.execute(bucket, comm)

    def execute(self, bucket, comm):
        """Run one bucket's collective and complete its requests, whatever happens.

        A failure of this rank's own steps before the MPI call (attaching, fusing)
        still makes the call, on zeros of the agreed size: the other ranks are in
        it, and skipping it would pair this rank's next collective with their
        current one.
        """
        if self.timeline:
            self.timeline.started(bucket)
        try:
            self._execute(bucket, comm)
        except Exception as err:
            log.error('collective failed: %s: %s', bucket[0].describe(), err)
            for req in bucket:
                if req.error is None:
                    self.fail(req, err)
        finally:
            if self.timeline:
                self.timeline.finished(bucket)
            for req in bucket:
                req.complete()

    def _execute(self, bucket, comm):
        kind = bucket[0].kind
        if kind == 'allreduce':
            self._allreduce(bucket, comm)
        elif kind == 'bcast':
            comm.bcast(bucket[0].buffer(), bucket[0].root)
        elif kind == 'barrier':
            comm.barrier()
        else:
            bucket[0].result = bucket[0].fn(comm.mpi)

    def _allreduce(self, bucket, comm):
        if len(bucket) == 1:
            buf = bucket[0].buffer()
            comm.allreduce(buf)
            self._average(bucket[0], buf)
            return
        flat = self._fuse(bucket, comm)
        comm.allreduce(flat)
        self._average(bucket[0], flat)
        offset = 0
        for req in bucket:
            view = req.buffer()
            view[...] = flat[offset:offset + view.size]
            offset += view.size

    def _fuse(self, bucket, comm):
        """The bucket's data in one flat buffer; zeros of the agreed size if that fails here."""
        count = sum(r.nbytes for r in bucket) // bucket[0].dtype.itemsize
        try:
            views = [r.buffer() for r in bucket]
            pool = self._pools.setdefault(id(comm), FusionPool())
            flat = pool.get(views[0], count)
            _xp(flat).concatenate(views, out=flat)
            return flat
        except Exception as err:
            self.fail_all(bucket, err)
            return np.zeros(count, dtype=bucket[0].dtype)

    def _average(self, req, buf):
        if not req.average or self.size == 1:
            return
        if buf.dtype.kind == 'f':
            buf *= 1.0 / self.size
        else:
            buf //= self.size


def _xp(array):
    return np if isinstance(array, np.ndarray) else __import__(type(array).__module__.split('.')[0])
