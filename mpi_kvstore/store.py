"""MPIKVStore: MXNet's KVStore contract on top of the schedulers."""
import atexit
import collections
import logging
import threading
import weakref

import mxnet as mx
import numpy as np
from mxnet.kvstore import KVStoreBase

from . import engine
from .comm import MPI
from .config import Config
from .contract import UnknownKeyError, normalize, normalize_out
from .errors import CollectiveError, MPIKVStoreError
from .request import Request, signature
from .schedulers import check_thread_level, get_design
from .timeline import Timeline

__all__ = ['MPIKVStore']

log = logging.getLogger(__name__)


class _Key:
    """What the store knows of one key: its shape, dtype, stored value, staging buffer."""

    __slots__ = ('key', 'shape', 'dtype', 'ctx', 'data', 'nbytes', '_staging', '_sigs')

    def __init__(self, entry):
        self.key, self.shape, self.dtype = entry.key, entry.shape, entry.dtype
        self.ctx = entry.values[0].context
        self.data = mx.nd.zeros(self.shape, ctx=self.ctx, dtype=self.dtype)
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        self._staging = None
        self._sigs = {}

    def staging(self):
        if self._staging is None:
            self._staging = mx.nd.zeros(self.shape, ctx=self.ctx, dtype=self.dtype)
        return self._staging

    def signature(self, kind, root):
        sig = self._sigs.get((kind, root))
        if sig is None:
            sig = self._sigs[(kind, root)] = signature(kind, self.key, self.dtype, self.shape,
                                                       root)
        return sig

    def check(self, entry, what):
        if entry.shape != self.shape or entry.dtype != self.dtype:
            raise ValueError('%s for key %r has shape %s and dtype %s, but the key was '
                             'initialised with shape %s and dtype %s'
                             % (what, self.key, entry.shape, entry.dtype.name,
                                self.shape, self.dtype.name))


def _same(a, b):
    return a is b or a.handle.value == b.handle.value


def _reduce_into(values, target):
    """Sum per-device values into ``target`` with MXNet operators (which handle layouts)."""
    if len(values) == 1:
        values[0].copyto(target)
    else:
        mx.nd.add_n(*[v.as_in_context(target.context) for v in values], out=target)


class MPIKVStore(KVStoreBase):
    """A KVStore whose push, pull, pushpull and broadcast are MPI collectives
    pushed into MXNet's dependency engine. Reductions are sums over devices and
    ranks (``average=True`` divides by the number of workers).

    Parameters
    ----------
    name : str
        'dist_mpi' (alias 'dist_sync_mpi').
    comm : mpi4py communicator, optional
        The processes to span; the store duplicates it. Default COMM_WORLD.
    **options
        See :mod:`mpi_kvstore.config` (design, fusion_threshold, ...).
    """

    NAMES = ('dist_mpi', 'dist_sync_mpi')

    def __init__(self, name='dist_mpi', comm=None, **options):
        if str(name).lower() not in self.NAMES:
            raise ValueError('unknown store name %r; mpi_kvstore provides %s'
                             % (name, ', '.join(self.NAMES)))
        self._config = Config(**options)
        design = get_design(self._config.design)
        check_thread_level(design)
        engine.set_naive(self._config.naive_engine)
        comm = MPI.COMM_WORLD if comm is None else comm
        self._rank, self._size = comm.Get_rank(), comm.Get_size()
        self._keys = {}
        self._errors = collections.deque()
        self._pending = collections.deque()
        self._updater = None
        self._closed = False
        self._timeline = (Timeline(self._config.timeline, self._rank, self._size)
                          if self._config.timeline else None)
        self._scheduler = design(comm, self._config, self._record_error, self._timeline)
        _LIVE.add(self)

    # -- identity -------------------------------------------------------------
    @property
    def type(self):
        # Module multiplies the batch size by num_workers only when the type
        # contains both 'dist' and '_sync'; Trainer checks for 'dist'.
        return 'dist_sync_mpi'

    @property
    def rank(self):
        return self._rank

    @property
    def num_workers(self):
        return self._size

    @property
    def design(self):
        return self._scheduler.name

    @property
    def config(self):
        return self._config

    @staticmethod
    def is_capable(capability):
        return str(capability).lower() == KVStoreBase.OPTIMIZER

    # -- errors -----------------------------------------------------------------
    def _record_error(self, req, err):
        log.error('mpi_kvstore: %s failed: %s', req.describe(), err)
        self._errors.append((req.describe(), err))

    def _raise_pending(self):
        if not self._errors:
            return
        errors = []
        while self._errors:
            errors.append(self._errors.popleft())
        where, err = errors[0]
        more = ' (and %d more failed collectives)' % (len(errors) - 1) if len(errors) > 1 else ''
        cls = type(err) if isinstance(err, MPIKVStoreError) else CollectiveError
        raise cls('%s failed: %s%s' % (where, err, more)) from err

    # -- keys -------------------------------------------------------------------
    def _state(self, key):
        try:
            return self._keys[key]
        except KeyError:
            raise UnknownKeyError('key %r was never initialised: call init() or broadcast() '
                                  'for it first' % (key,)) from None

    def _register(self, entry):
        state = self._keys.get(entry.key)
        if state is None:
            state = self._keys[entry.key] = _Key(entry)
        return state

    # -- submission ---------------------------------------------------------------
    def _submit(self, reqs, priority):
        if self._closed:
            raise MPIKVStoreError('the store is closed: create a new one to go on')
        while self._pending and self._pending[0].done:
            self._pending.popleft()
        self._pending.extend(reqs)
        self._scheduler.submit(reqs, priority)
        if self._config.naive_engine:
            self._raise_pending()

    def _request(self, kind, state, array, root=0):
        return Request(kind, state.key, state.dtype, state.shape, array=array, root=root,
                       average=self._config.average and kind == 'allreduce',
                       nbytes=state.nbytes, sig=state.signature(kind, root))

    # -- the contract ---------------------------------------------------------------
    def init(self, key, value):
        """Register keys with rank 0's values."""
        self._raise_pending()
        entries = normalize(key, value)
        for entry in entries:
            if entry.key in self._keys:
                raise ValueError('key %r is already initialised' % (entry.key,))
        self._broadcast(entries, 0)

    def broadcast(self, key, value, out, priority=0):
        """Rank 0's value lands in every out on every rank (and in the store)."""
        self._raise_pending()
        self._broadcast(normalize(key, value, out), priority)

    def broadcast_from(self, key, value, out=None, root=0, priority=0):
        """Like broadcast, from any root rank (out=None: in place)."""
        self._raise_pending()
        if not 0 <= root < self._size:
            raise ValueError('root %d is not a rank of a %d-process store' % (root, self._size))
        entries = normalize(key, value, out)
        for entry in entries:
            entry.outs = entry.values if entry.outs is None else entry.outs
        self._broadcast(entries, priority, root)

    def _broadcast(self, entries, priority, root=0):
        for entry in entries:
            if entry.key in self._keys:
                self._keys[entry.key].check(entry, 'value')
        states = [self._register(entry) for entry in entries]
        for state, entry in zip(states, entries):
            entry.values[0].copyto(state.data)
        self._submit([self._request('bcast', st, st.data, root) for st in states], priority)
        for state, entry in zip(states, entries):
            for out in entry.outs or ():
                state.data.copyto(out)

    def pushpull(self, key, value, out=None, priority=0):
        """Sum value over devices and ranks into out (in place when out is None)."""
        self._raise_pending()
        plans = [self._plan(entry, in_place_ok=True) for entry in normalize(key, value, out)]
        self._submit([req for _, req, _ in plans], priority)
        for state, req, targets in plans:
            self._deliver(state, req.array, targets)

    def push(self, key, value, priority=0):
        """Sum value over devices and ranks into the store (through the optimizer if set)."""
        self._raise_pending()
        plans = [self._plan(entry, in_place_ok=False) for entry in normalize(key, value)]
        self._submit([req for _, req, _ in plans], priority)
        for state, req, _ in plans:
            self._deliver(state, req.array, ())

    def pull(self, key, out=None, priority=0, ignore_sparse=True):
        """Copy the stored value of each key into out."""
        self._raise_pending()
        entries = normalize_out(key, out)
        states = [self._state(entry.key) for entry in entries]
        for state, entry in zip(states, entries):
            state.check(entry, 'out')
        for state, entry in zip(states, entries):
            for arr in entry.outs:
                state.data.copyto(arr)

    def row_sparse_pull(self, key, out=None, priority=0, row_ids=None):
        raise TypeError('mpi_kvstore reduces dense arrays only; row_sparse_pull is not supported')

    def _plan(self, entry, in_place_ok):
        state = self._state(entry.key)
        state.check(entry, 'value')
        values = entry.values
        targets = values if entry.outs is None else entry.outs
        in_place = (in_place_ok and self._config.zero_copy and self._updater is None
                    and len(values) == 1 and all(_same(t, values[0]) for t in targets))
        if in_place:
            work = values[0]
        else:
            work = state.staging()
            _reduce_into(values, work)
        return state, self._request('allreduce', state, work), targets if in_place_ok else ()

    def _deliver(self, state, work, targets):
        source = work
        if self._updater is not None:
            self._updater(state.key, work, state.data)
            source = state.data
        elif not targets:
            work.copyto(state.data)
            return
        for arr in targets:
            if not _same(arr, source):
                source.copyto(arr)

    # -- optimizer ----------------------------------------------------------------
    def set_optimizer(self, optimizer):
        """Run the optimizer in the store: every rank applies it to the same sums."""
        self._raise_pending()
        self._updater = mx.optimizer.get_updater(optimizer)

    def _require_updater(self):
        if self._updater is None:
            raise MPIKVStoreError('no optimizer is set on this store: call set_optimizer first')
        return self._updater

    def save_optimizer_states(self, fname, dump_optimizer=False):
        states = self._require_updater().get_states(dump_optimizer)
        with open(fname, 'wb') as fh:
            fh.write(states)

    def load_optimizer_states(self, fname):
        with open(fname, 'rb') as fh:
            self._require_updater().set_states(fh.read())

    def set_gradient_compression(self, compression_params):
        raise MPIKVStoreError('gradient compression is not supported by mpi_kvstore yet '
                              '(asked for %r)' % (compression_params,))

    # -- synchronisation ----------------------------------------------------------
    def wait(self):
        """Block until every collective pushed so far finished; raise what failed."""
        while self._pending:
            self._pending[0].wait()
            self._pending.popleft()
        self._raise_pending()

    def _barrier(self):
        self.wait()
        req = Request('barrier', '__barrier__')
        self._submit([req], 0)
        req.wait()
        self._raise_pending()

    def run_collective(self, fn, name='custom'):
        """Run ``fn(mpi_comm)`` in collective order on the store's communicator; return its result."""
        self._raise_pending()
        req = Request('custom', '__%s__' % name, fn=fn)
        self._submit([req], 0)
        req.wait()
        self._raise_pending()
        return req.result

    def close(self):
        """Finish in-flight work and stop the communication threads (idempotent)."""
        if self._closed:
            return
        mx.nd.waitall()
        engine.quiesce()
        for req in list(self._pending):
            req.wait(timeout=60)
        self._closed = True
        self._scheduler.close()
        if self._timeline:
            self._timeline.write()
        _LIVE.discard(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def __repr__(self):
        return '<MPIKVStore design=%s rank=%d/%d>' % (self.design, self._rank, self._size)


_LIVE = weakref.WeakSet()
_exit_lock = threading.Lock()


@atexit.register
def _close_all():
    # Registered after mxnet's and mpi4py's own exit hooks, so it runs before
    # them: in-flight engine ops finish and threads stop before MPI finalizes.
    with _exit_lock:
        for store in list(_LIVE):
            try:
                store.close()
            except Exception:
                log.exception('mpi_kvstore: closing %r at exit failed', store)
