"""MPIKVStore: MXNet's KVStore contract on top of the designs."""
from __future__ import annotations

import atexit
import collections
import logging
import os
import pickle
import sys
import threading
import weakref
from typing import Any, Callable, Sequence, Union

import mxnet as mx
import numpy as np
from mxnet.kvstore import KVStoreBase

from .. import compression
from ..comm import topology
from ..comm.collective import CLIP_NORM, LAMB_NORMS, Collective
from ..comm.mpiabi import MPI
from ..comm.timeline import Timeline
from ..config import Config
from ..designs import check_thread_level, get_design
from ..engine import core as engine
from ..errors import MPIKVStoreError
from ..faults.abort import install_abort_hook
from ..faults.stall import StallInspector
from ..optim import shards
from .contract import check_priority, normalize, normalize_out
from .deferred import DeferredErrors
from .keys import CallCache, KeyTable, fill, note_weights, request, same_array
from .namecache import NameCache

__all__ = ['MPIKVStore']

# MXNet ships no type information: an NDArray is Any to a type checker. A key is an int or a
# str; a call takes one key or a list of them, and one value (or list of values per device)
# per key.
NDArray = Any
Key = Union[int, str]
Keys = Union[Key, Sequence[Key]]
Values = Union[NDArray, Sequence[Any]]

log = logging.getLogger(__name__)


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
    """The store names ``create`` and ``mx.kv.create`` accept."""

    def __init__(self, name: str = 'dist_mpi', comm: Any = None, **options: Any) -> None:
        if str(name).lower() not in self.NAMES:
            raise ValueError('unknown store name %r; mpi_kvstore provides %s'
                             % (name, ', '.join(self.NAMES)))
        comm = MPI.COMM_WORLD if comm is None else comm
        self._config, table = topology.agreed_config(comm, options)
        design = get_design(self._config.design)
        check_thread_level(design)
        engine.set_naive(self._config.naive_engine)
        self._rank, self._size = comm.Get_rank(), comm.Get_size()
        # the options left 'auto', decided before anything is built from the config
        self._config, chosen = topology.resolve(self._config, comm, table)
        if chosen and self._rank == 0:
            log.info('%s', chosen)
        self._keys = KeyTable(self._config, self._rank, self._size)
        self._fitted: set = set()         # keys whose optimizer state is cut to this rank's share
        self._calls = CallCache()         # push and pushpull calls already checked
        self._wire = compression.wire_cast(self._config.compression)
        self._codec = None                # set_gradient_compression's (compression.TwoBit)
        # array_collective's staging buffers, least recently used first out (names may be new
        # every step)
        self._helper_buffers = NameCache(self._config.name_cache_capacity)
        self._clip: shards.ClipStep | None = None   # the clipped step under way
        self._errors = DeferredErrors()
        self._pending: collections.deque = collections.deque()
        self._closed = False
        self._timeline = (Timeline(self._config.timeline, self._rank, self._size)
                          if self._config.timeline else None)
        self._design = design(comm, self._config, self._errors.record, self._timeline, table)
        if self._config.shard_optimizer:
            self._design.shares = shards.JoinedShares(self._joined_share)
        install_abort_hook()  # a rank that raises must end the job, not hang the others
        self._inspector = StallInspector(comm, self._config, self._design,
                                         self._pending_now)
        _LIVE.add(self)

    # -- identity -------------------------------------------------------------
    @property
    def type(self) -> str:
        """MXNet's name for the kind of store (``dist`` and ``_sync``: distributed, synchronous)."""
        # Module multiplies the batch size by num_workers only when the type
        # contains both 'dist' and '_sync'; Trainer checks for 'dist'.
        return 'dist_sync_mpi'

    @property
    def rank(self) -> int:
        """This process's rank in the store's communicator."""
        return self._rank

    @property
    def num_workers(self) -> int:
        """The number of processes the store spans."""
        return self._size

    @property
    def design(self) -> str:
        """The scheduling design in use (``'funneled'``, ``'concurrent'``, ...)."""
        return self._design.name

    @property
    def config(self) -> Config:
        """The store's resolved options (a :class:`~mpi_kvstore.config.Config`)."""
        return self._config

    @property
    def timeline(self) -> Timeline | None:
        """The store's timeline.Timeline (the ``timeline`` option), or None."""
        return self._timeline

    @staticmethod
    def is_capable(capability: str) -> bool:
        """Whether the store supports ``capability``: only MXNet's ``'optimizer'``."""
        return str(capability).lower() == KVStoreBase.OPTIMIZER

    @property
    def _updater(self):
        # Trainer.load_states reads kv._updater.optimizer
        return self._keys.updater

    # -- errors -----------------------------------------------------------------
    def _check_open(self):
        if self._closed:
            raise MPIKVStoreError('the store is closed: create a new one to go on')

    def _begin(self, priority=0):
        """What every call checks first: an open store, an int priority, no error pending."""
        self._check_open()
        check_priority(priority)
        self._errors.raise_pending()

    # -- submission ---------------------------------------------------------------
    def _submit(self, reqs, priority):
        self._check_open()
        self._design.reap()
        while self._pending and self._pending[0].done:
            self._pending.popleft()
        self._pending.extend(reqs)
        self._design.submit(reqs, priority)
        if self._design.synchronous:
            self._errors.raise_pending()

    def _pending_now(self):
        """The collectives not finished yet (the stall inspector's thread asks)."""
        self._design.reap()
        return [req for req in list(self._pending) if not req.done]

    def _request(self, kind, state, array, root=0, in_place=False):
        return request(kind, state, array, average=self._config.average and kind == 'allreduce',
                       root=root, in_place=in_place)

    # -- the contract ---------------------------------------------------------------
    def init(self, key: Keys, value: Values) -> None:
        """Give keys rank 0's values."""
        self._begin()
        entries = normalize(key, value)
        self._keys.validate(entries, fresh=True)
        self._broadcast(entries, 0)

    def broadcast(self, key: Keys, value: Values, out: Values, priority: int = 0) -> None:
        """Rank 0's value lands in every out on every rank (and in the store)."""
        self._begin(priority)
        entries = normalize(key, value, out)
        self._keys.validate(entries)
        self._broadcast(entries, priority)

    def broadcast_from(self, key: Keys, value: Values, out: Values | None = None,
                       root: int = 0, priority: int = 0) -> None:
        """Like broadcast, from any root rank (out=None: in place)."""
        self._begin(priority)
        self._check_root(root)
        entries = normalize(key, value, out)
        self._keys.validate(entries, writes_values=True)
        for entry in entries:
            entry.outs = entry.values if entry.outs is None else entry.outs
        self._broadcast(entries, priority, root)

    def _check_root(self, root):
        if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < self._size:
            raise ValueError('root must be a rank of this %d-process store (0..%d), not %r'
                             % (self._size, self._size - 1, root))

    def _broadcast(self, entries, priority, root=0):
        states = [self._keys.register(entry) for entry in entries]
        for state, entry in zip(states, entries):
            entry.values[0].copyto(state.stored())
        self._submit([self._request('bcast', st, st.value, root) for st in states], priority)
        for state, entry in zip(states, entries):
            for out in entry.outs or ():
                state.value.copyto(out)
            if entry.outs:
                # Module broadcasts its cached _arg_params into the executors' arrays:
                # a join must update both, the arrays in use first.
                state.weights = tuple(entry.outs) + tuple(
                    v for v in entry.values if not any(same_array(v, o) for o in entry.outs))

    def pushpull(self, key: Keys, value: Values, out: Values | None = None,
                 priority: int = 0) -> None:
        """Sum value over devices and ranks into out (in place when out is None).

        An allreduce: the key needs no init; its first use fixes its shape and dtype.
        A call repeated on the same key and the very same arrays skips the checks that
        passed the first time (keys.CallCache).
        """
        self._begin(priority)
        plans = self._calls.find('pushpull', key, value, out)
        if plans is None:
            entries = normalize(key, value, out)
            self._keys.validate(entries, need_weights=self._updater is not None,
                                writes_values=True)
            plans = [self._keys.plan(entry, True) for entry in entries]
            self._calls.remember('pushpull', key, value, out, plans)
        self._exchange(plans, priority)

    def push(self, key: Keys, value: Values, priority: int = 0) -> None:
        """Sum value over devices and ranks into the store (through the optimizer if set).

        As in MXNet's own stores, the key must have been given a value by init() or
        broadcast() first; otherwise UnknownKeyError names the key, and nothing is sent.
        """
        self._begin(priority)
        plans = self._calls.find('push', key, value, None)
        if plans is None:
            entries = normalize(key, value)
            self._keys.validate(entries, need_weights=self._updater is not None,
                                needs_value='push')
            plans = [self._keys.plan(entry, False) for entry in entries]
            self._calls.remember('push', key, value, None, plans)
        self._exchange(plans, priority)

    def _exchange(self, plans, priority):
        """Allreduce each key, or with shard_optimizer reduce-scatter it, update this rank's
        share and allgather the weights (keys.Plan.share)."""
        if self._clip is not None and self._updater is not None:
            self._clip.check([plan.state.key for plan in plans])
        average = self._config.average
        sharded = [plan for plan in plans if plan.share is not None]
        if sharded:
            self._fit_states(sharded)
        reqs = []
        for plan in plans:
            plan.stage()
            req = request('reducescatter' if plan.share is not None else 'allreduce',
                          plan.state, plan.work, average=average, in_place=plan.in_place,
                          place=plan.place)
            req.shard = plan.share is not None
            reqs.append(req)
        if self._codec is not None or self._wire is not None:
            for req in reqs:
                self._compress(req)
        self._submit(reqs, priority)
        step = self._clip if self._updater is not None else None
        if step is None:
            self._deliver(plans, priority)
        elif step.add(plans, priority):
            self._clip = None
            self._clip_step(step)

    def _clip_step(self, step):
        """A whole clipped step (shards.ClipStep): its norm, the scaled gradients, then each
        call's updates and allgathers, in call order."""
        sharded, whole = step.squares()
        if sharded is not None:
            # this rank's shares' squares, summed over the ranks: the sharded keys' part
            self._submit([Collective('allreduce', (CLIP_NORM,), np.dtype('float32'), (1,),
                                     array=sharded)],
                         max(priority for _, priority in step.calls))
        total = sharded if whole is None else whole if sharded is None else sharded + whole
        step.scale(total, self._updater.optimizer.rescale_grad)
        for plans, priority in step.calls:
            self._deliver(plans, priority)

    def _deliver(self, plans, priority):
        """After a call's collectives: the optimizer (on this rank's share where sharded) or
        the sums into the outputs, then the sharded keys' allgathers."""
        sharded = [plan for plan in plans if plan.share is not None]
        lamb = sharded and shards.needs_norms(self._updater.optimizer)
        norms = []
        for plan in plans:
            if lamb and plan.share is not None:
                norms.append(shards.LambShare(self._updater, plan.state.key, plan.views[1],
                                              plan.views[0]))
                note_weights(plan)
            else:
                self._keys.deliver(plan)
        if norms:   # LAMB's norms over the whole weights: the shares' squares, summed
            self._submit([Collective('allreduce', (LAMB_NORMS, plan.state.key),
                                     np.dtype('float32'), (2,), array=share.squares)
                          for plan, share in zip(sharded, norms)], priority)
            for share in norms:
                share.finish()
        if sharded:
            gathers = [request('allgather', plan.state, plan.state.value, place=plan.place)
                       for plan in sharded]
            for req in gathers:
                req.shard = True
            self._submit(gathers, priority)
            for plan in sharded:
                fill(plan, plan.state.value)

    def _joined_share(self, key):
        """shards.JoinedShares' view of a key this rank shards: (weights, bounds, updater),
        or None. Called on the design's thread while this rank waits in join()."""
        state = self._keys.get(key)
        if state is None or state.value is None or not self._keys.sharded(state):
            return None
        bounds = self._keys.share_of(state)
        self._fit_state(key, state.count, bounds)
        return state.value, bounds, self._updater

    def _fit_states(self, plans):
        """Cut a loaded whole-key optimizer state to this rank's share before its first
        sharded update (shards.fit); raises, before anything is sent, for a state of
        another size."""
        for plan in plans:
            self._fit_state(plan.state.key, plan.state.count, plan.share)

    def _fit_state(self, key, count, bounds):
        """Cut ``key``'s state, loaded whole and not yet used, to ``bounds`` (shards.fit)."""
        states = self._updater.states
        if key in states and key not in self._fitted:
            states[key] = shards.fit(key, states[key], count, bounds)
            self._fitted.add(key)

    def pull(self, key: Keys, out: Values | None = None, priority: int = 0,
             ignore_sparse: bool = True) -> None:
        """Copy the stored value of each key into out."""
        self._begin(priority)
        entries = normalize_out(key, out)
        states = [self._keys.with_value(entry.key) for entry in entries]
        self._keys.validate(entries, what='out')
        for state, entry in zip(states, entries):
            for arr in entry.outs:
                state.value.copyto(arr)
            state.weights = tuple(entry.outs)

    def join(self) -> int:
        """This rank has run out of data: until every rank has joined, take part in
        the others' collectives with zeros. Returns, on every rank, the last rank to
        join (the one that issued the most collectives; ties: the highest rank).

        Sums then cover the batches that exist: a joined rank adds nothing. Once all
        joined, the last rank's weights (the arrays Trainer and Module handed the
        store through broadcast, pull, or pushpull with the store's optimizer) and
        the store's optimizer states are broadcast to every rank, so training goes
        on from identical weights. A joined rank cannot mirror broadcasts from
        itself or Python-object collectives: those fail with JoinError everywhere.
        With shard_optimizer it goes on updating its shares of the weights
        (shards.JoinedShares), and each rank keeps its shares' states.
        """
        self._begin()
        self.wait()
        if self._size == 1:
            return 0
        last = self._design.join()
        self._sync_from(last)
        return last

    def _sync_from(self, root):
        """Every rank takes ``root``'s weights and optimizer states (after a join)."""
        mine = [(st.key, st.shape, st.dtype.str) for st in self._keys
                if st.weights or st.value is not None]
        keys, has_updater = self.run_collective(
            lambda comm: comm.bcast((mine, self._updater is not None), root=root), 'join_keys')
        reqs, deliveries = [], []
        for key, shape, dtype in keys:
            state = self._keys.get(key)
            if state is not None and (state.shape, state.dtype.str) == (shape, dtype):
                buf, outs = state.stored(), state.weights
                if outs:
                    outs[0].copyto(buf)
            else:  # a key this rank never held: take part, keep nothing
                buf, outs = mx.nd.zeros(shape, dtype=dtype), ()
            reqs.append(Collective('bcast', ('join', key), np.dtype(dtype), shape, array=buf,
                                   root=root))
            deliveries.append((buf, outs))
        if reqs:
            self._submit(reqs, 0)
        for buf, outs in deliveries:
            for out in outs:
                buf.copyto(out)
        if has_updater:
            states = self.run_collective(lambda comm: comm.bcast(
                self._states_to_sync() if self._rank == root else None, root=root),
                'join_optimizer')
            if self._updater is not None and self._rank != root:
                if self._config.shard_optimizer:   # each keeps its shares (JoinedShares)
                    states = pickle.loads(states)
                    self._updater.states.update(states)
                    self._updater.states_synced.update(dict.fromkeys(states, False))
                else:
                    self._updater.set_states(states)
        self.wait()

    def _states_to_sync(self):
        """The optimizer states a join gives every rank: all of them, or with
        shard_optimizer those of the keys updated whole (each rank updated its own shares
        of the others, after its join too)."""
        if not self._config.shard_optimizer:
            return self._updater.get_states(False)
        sharded = self._sharded_keys()
        return pickle.dumps({key: state for key, state in self._updater.states.items()
                             if key not in sharded})

    def row_sparse_pull(self, key: Keys, out: Values | None = None, priority: int = 0,
                        row_ids: Any = None) -> None:
        """Not supported: the store reduces dense arrays only (raises TypeError)."""
        raise TypeError('mpi_kvstore reduces dense arrays only; row_sparse_pull is not supported')

    # -- optimizer ----------------------------------------------------------------
    def set_optimizer(self, optimizer: Any) -> None:
        """Run the optimizer in the store: every rank applies it to the same sums (with
        shard_optimizer, each rank to its share of every key)."""
        self._begin()
        if self._config.shard_optimizer:
            why = shards.refuse(optimizer)
            if why is not None:
                raise ValueError(why)
        self._keys.updater = mx.optimizer.get_updater(optimizer)
        self._fitted.clear()
        self._calls.clear()   # with an optimizer nothing runs in place: plans change

    def _require_updater(self):
        if self._updater is None:
            raise MPIKVStoreError('no optimizer is set on this store: call set_optimizer first')
        return self._updater

    def clip_global_norm(self, max_norm: float, keys: Sequence[Key]) -> None:
        """Clip the next step's gradient by its global norm before the store's optimizer
        runs it: the step is the push or pushpull calls that push each of ``keys`` once, in
        any grouping and order (gluon.Trainer pushes one key a call). The norm is the one
        of the gradient the optimizer applies (``rescale_grad`` times the sum over the
        ranks) over every key of the step; each gradient is scaled by
        min(1, max_norm / norm). Call it before each step, on every rank, with the same
        keys (``mpi_kvstore.clip_global_norm`` does it for a gluon.Trainer or a Module).

        The collectives go out as the calls come; the updates wait for the step's last
        key. With shard_optimizer the shares' squares are summed by one 1-element
        allreduce a step. Raises ValueError for a bad ``max_norm`` or ``keys``, or while the
        previous clipped step still waits for keys; nothing changes then."""
        self._begin()
        self._require_updater()
        shards.check_max_norm(max_norm)
        if isinstance(keys, (str, bytes, int)) or not hasattr(keys, '__iter__'):
            raise ValueError('clip_global_norm: keys must be a list of the step\'s keys, not %r'
                             % (keys,))
        keys = list(keys)
        if not keys or len(set(keys)) != len(keys):
            raise ValueError('clip_global_norm: keys must be distinct and not empty: %r'
                             % (keys,))
        if self._clip is not None:
            raise ValueError('clip_global_norm: the previous clipped step still waits for '
                             'keys %s: push them first' % (self._clip.waiting,))
        self._clip = shards.ClipStep(float(max_norm), keys)

    def save_optimizer_states(self, fname: str, dump_optimizer: bool = False) -> None:
        """Write the optimizer's states (and the optimizer with ``dump_optimizer``) in
        MXNet's format. With shard_optimizer this is a collective that gathers every rank's
        shares, so every rank must call it; each writes the same whole-model file, which
        loads into a store of any size, sharded or not."""
        updater = self._require_updater()
        if self._config.shard_optimizer and self._size > 1:
            self.wait()
            whole = mx.optimizer.Updater(updater.optimizer)
            whole.states = shards.gather(
                updater.states, self._sharded_keys(), self._size, self._rank,
                lambda obj: self.run_collective(lambda comm: comm.allgather(obj),
                                                'gather_optimizer_states'))
            updater = whole
        data = updater.get_states(dump_optimizer)
        tmp = '%s.tmp.%d' % (fname, os.getpid())   # ranks may share a file system
        with open(tmp, 'wb') as fh:
            fh.write(data)
        os.replace(tmp, fname)

    def load_optimizer_states(self, fname: str) -> None:
        """Read states saved by any store (sharded or not, at any number of ranks). A state
        whose size does not fit its key raises ValueError and changes nothing."""
        updater = self._require_updater()
        with open(fname, 'rb') as fh:
            data = fh.read()
        loaded = mx.optimizer.Updater(updater.optimizer)
        loaded.set_states(data)
        for key, state in loaded.states.items():
            known = self._keys.get(key)
            if known is not None:
                shards.check_sizes(key, state, known.count, None)
        # what Updater.set_states(data) would set, without unpickling the file again
        updater.states, updater.states_synced = loaded.states, loaded.states_synced
        updater.optimizer = loaded.optimizer
        self._fitted.clear()   # whole states: cut to this rank's share at first use

    def _sharded_keys(self):
        return {st.key: (st.shape, st.count) for st in self._keys if self._keys.sharded(st)}

    def set_gradient_compression(self, compression_params: dict) -> None:
        """MXNet's 2-bit compression of push and pushpull: {'type': '2bit', 'threshold': t}
        (t defaults to 0.5), or {'type': 'none'}. Every rank must set the same (their calls
        fail with RankMismatchError otherwise); it applies to the calls made after it, and
        each key keeps its residual (compression/)."""
        self._begin()
        self._codec = compression.from_params(compression_params,
                                              self._config.two_phase_min_ranks)

    def _compress(self, req):
        """Mark a gradient exchange as compressed: its codec, and a signature that says so."""
        for codec in (self._codec, self._wire):
            if codec is not None and codec.applies_to(req.dtype):
                req.codec = codec
                req.sig = compression.sign(req.sig, codec.spec)
                return

    # -- synchronisation ----------------------------------------------------------
    def wait(self) -> None:
        """Block until every collective pushed so far finished; raise what failed."""
        while self._pending:
            self._pending[0].wait()
            self._pending.popleft()
        self._errors.raise_pending()

    def _barrier(self):
        self._begin()
        self.wait()
        req = Collective('barrier', '__barrier__')
        self._submit([req], 0)
        req.wait()
        self._errors.raise_pending()

    def array_collective(self, kind: str, name: str, tensor: NDArray, root: int = 0,
                         average: bool = False, unit: int = 1) -> NDArray:
        """Run one collective on ``tensor`` in place, in collective order: 'allreduce' (the
        sum, or the mean with ``average``), 'bcast' (root's value), 'reducescatter' (this
        rank's share of the flat tensor gets the sum, or the mean; shares are cut in whole
        ``unit``s of elements, fusion.pieces) or 'allgather' (every share gets its owner's
        values). The entry point of the Horovod-style helpers (functional.py); ``name``
        identifies the collective across ranks, as a key does.

        The data travels through a staging buffer the store keeps per (name, shape, dtype,
        context), written and read by MXNet's own copy operator: user arrays (weights after
        an inference forward) may sit in an MKLDNN layout whose bytes are not row-major.
        It keeps ``name_cache_capacity`` of them, dropping the least recently used whose
        collective is done (namecache.NameCache).
        """
        if kind not in _ARRAY_KINDS:
            raise ValueError('array_collective: kind must be one of %s, not %r'
                             % (', '.join(_ARRAY_KINDS), kind))
        if kind == 'bcast':
            self._check_root(root)
        self._begin()
        key = (name, tensor.shape, np.dtype(tensor.dtype), str(tensor.context))
        buf = self._helper_buffers.get(key)
        if buf is None:
            buf = mx.nd.zeros(tensor.shape, ctx=tensor.context, dtype=tensor.dtype)
        tensor.copyto(buf)
        req = Collective(kind, name, np.dtype(tensor.dtype), tensor.shape, array=buf, root=root,
                         average=average, unit=unit)
        self._submit([req], 0)
        # Dropped from the cache only once req is done: the collective reads and writes buf
        # through a raw view. MXNet's own copies hold buf themselves.
        self._helper_buffers.keep(key, buf, req)
        buf.copyto(tensor)
        return tensor

    def run_collective(self, fn: Callable[[Any], Any], name: str = 'custom') -> Any:
        """Run ``fn(mpi_comm)`` in collective order on the store's communicator; return its result."""
        self._begin()
        req = Collective('custom', '__%s__' % name, fn=fn)
        self._submit([req], 0)
        req.wait()
        self._errors.raise_pending()
        return req.result

    def close(self) -> None:
        """Finish in-flight work and stop the communication threads (idempotent).

        Raises the error of any collective that failed and was not raised yet.
        """
        if self._closed:
            return
        self._quiesce()
        self._closed = True
        self._inspector.stop()
        self._design.close()
        if self._timeline:
            self._timeline.write()
        _LIVE.discard(self)
        self._errors.raise_pending()

    def _quiesce(self):
        for req in list(self._pending):
            req.wait(timeout=60)
        engine.consume_raised()  # the engine's copy of an error must not fail waitall
        mx.nd.waitall()
        engine.quiesce()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
            return
        try:  # the exception in flight says more than a collective that failed after it
            self.close()
        except MPIKVStoreError as err:
            log.error('mpi_kvstore: while leaving the store on %s: %s', exc_type.__name__, err)

    def __repr__(self):
        return '<MPIKVStore design=%s rank=%d/%d>' % (self.design, self._rank, self._size)


_ARRAY_KINDS = ('allreduce', 'bcast', 'reducescatter', 'allgather')
_LIVE: weakref.WeakSet = weakref.WeakSet()
_exit_lock = threading.Lock()


@atexit.register
def _close_all():
    # Registered after mxnet's and mpi4py's own exit hooks, so it runs before
    # them: in-flight engine ops finish and threads stop before MPI finalizes.
    failed = False
    with _exit_lock:
        for store in list(_LIVE):
            try:
                store.close()
            except MPIKVStoreError as err:
                log.critical('mpi_kvstore: rank %d exits with an error that was never raised: '
                             '%s', store.rank, err)
                failed = True
            except Exception:
                log.exception('mpi_kvstore: closing %r at exit failed', store)
                failed = True
    if failed:
        _exit_failed()


def _exit_failed():
    """An exit hook cannot change the exit status: finalize MPI, then leave with 1."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed stream must not hide the status
            pass
    try:
        if MPI.Is_initialized() and not MPI.Is_finalized():
            MPI.Finalize()
    finally:
        os._exit(1)
