"""MPIKVStore: MXNet's KVStore contract on top of the designs.

The store checks each call against the contract and hands it down: to the key table
(keys), the exchange of keys' collectives (exchange), the optimizer inside the store
(optimizer), the named collectives (collectives) and its job (job: the design, what is
pending, the errors to raise). None of them calls the store back.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

from mxnet.kvstore import KVStoreBase

from .. import debug
from ..comm import topology
from ..comm.mpiabi import MPI
from ..comm.timeline import Timeline
from ..config import Config
from ..designs import autotune, check_thread_level, get_design
from ..engine import core as engine
from ..errors import ConfigError, MPIKVStoreError
from ..optim import shards
from . import shutdown
from .collectives import Collectives
from .contract import check_root, normalize, normalize_out
from .exchange import Exchange
from .job import Job
from .keys import KeyTable
from .namecache import CallCache
from .optimizer import StoreOptimizer

__all__ = ['MPIKVStore', 'elastic_options', 'ELASTIC_DESIGNS']

# MXNet ships no type information: an NDArray is Any to a type checker. A key is an int or a
# str; a call takes one key or a list of them, and one value (or list of values per device)
# per key.
NDArray = Any
Key = int | str
Keys = Key | Sequence[Key]
Values = NDArray | Sequence[Any]

log = logging.getLogger(__name__)

# The designs whose every wait is polled (progress.set_abort_check), so a lost peer ends it
ELASTIC_DESIGNS = ('funneled', 'blocking')
# On an elastic world every collective is a polled nonblocking MPI call, on the flat
# communicator: the blocking forms (hierarchy, a table's algorithms, autotune's rounds, the
# stall inspector's queries) would wait for a lost peer forever.
_ELASTIC_FIXED = {'progress_min_bytes': 0, 'hierarchical': 'off', 'autotune': False,
                  'tune_table': '', 'stall_warning': 0.0, 'stall_abort': 0.0}


class WorldLost(MPIKVStoreError):
    """What a store's pending calls fail with when told of a lost world at its reset."""


def elastic_options(options: dict) -> dict:
    """The store options on an elastic world: ``options`` with every wait polled."""
    fixed = dict(options, **_ELASTIC_FIXED)
    sleep = options.get('progress_sleep_us', 'auto')
    fixed['progress_sleep_us'] = 200.0 if sleep == 'auto' or not float(sleep) else sleep
    return fixed


class MPIKVStore(KVStoreBase, AbstractContextManager):
    """A KVStore whose push, pull, pushpull and broadcast are MPI collectives
    pushed into MXNet's dependency engine. Reductions are sums over devices and
    ranks (``average=True`` divides by the number of workers).

    Parameters
    ----------
    name : str
        'dist_mpi' (alias 'dist_sync_mpi').
    comm : mpi4py communicator, optional
        The processes to span; the store duplicates it. Default COMM_WORLD, or the world's.
    world : mpi_kvstore.elastic.world.World, optional
        An elastic world: the store's collectives end with HorovodInternalError once it
        loses a peer, and :meth:`reset` rebuilds the store on its next communicator.
    **options
        See :mod:`mpi_kvstore.config` (design, fusion_threshold, ...).
    """

    NAMES = ('dist_mpi', 'dist_sync_mpi')
    """The store names ``create`` and ``mx.kv.create`` accept."""
    # Module multiplies the batch size by num_workers only when the type contains both
    # 'dist' and '_sync'; Trainer checks for 'dist'.
    type = 'dist_sync_mpi'
    """MXNet's name for the kind of store (``dist`` and ``_sync``: distributed, synchronous)."""

    def __init__(self, name: str = 'dist_mpi', comm: Any = None, world: Any = None,
                 **options: Any) -> None:
        if str(name).lower() not in self.NAMES:
            raise ValueError('unknown store name %r; mpi_kvstore provides %s'
                             % (name, ', '.join(self.NAMES)))
        if world is not None:
            comm = world.comm if comm is None else comm
            options = elastic_options(options)
        self._options, self._world = options, world
        self._build(MPI.COMM_WORLD if comm is None else comm, None)
        shutdown.LIVE.add(self)

    def _build(self, comm: Any, job: Job | None) -> None:
        """Everything that depends on the communicator: the agreed options, the design, the
        key table, the named buffers, the optimizer's shares. ``job``: the store's Job to
        reset on ``comm`` (None: a new one)."""
        # On an elastic world every wait of the agreement and of the host count ends when a
        # worker is lost or at a deadline (World.waiter): MPI never completes a collective
        # with a lost peer. A reset's deadline is the re-forming's (World.check bounds the
        # design's waits by it too); a first build's is the world's timeout, since its ranks
        # may come to it apart.
        wait = None if self._world is None else self._world.waiter(
            "the store's build", None if job is not None else self._world.timeout)
        config, table = topology.agreed_config(comm, self._options, wait)
        if self._world is not None and config.design not in ELASTIC_DESIGNS + ('auto',):
            raise ConfigError('design %r cannot run on an elastic world: choose one of %s'
                              % (config.design, ', '.join(ELASTIC_DESIGNS)))
        self._rank, self._size = comm.Get_rank(), comm.Get_size()
        # the options left 'auto' (the design too), decided before anything is built from
        # the config
        config, chosen = topology.resolve(config, comm, table, elastic=self._world is not None,
                                          wait=wait)
        if chosen and self._rank == 0:
            log.info('%s', chosen)
        design = get_design(config.design)
        check_thread_level(design)
        engine.set_naive(config.naive_engine)
        self._keys = KeyTable(config, self._rank, self._size)
        self._calls = CallCache()         # push and pushpull calls already checked
        # key -> (out, its handle, the key's state, (out,)) of its last pull into one array
        self._pulls: dict = {}
        if job is None:
            self.timeline: Timeline | None = (Timeline(config.timeline, self._rank, self._size)
                                              if config.timeline else None)
            """The store's :class:`~mpi_kvstore.comm.timeline.Timeline` (the ``timeline``
            option), or None. An attribute, not a property: it is made here, once, and the
            designs record into the same object."""
        # a joined rank goes on updating its shares (handed to the design here, once)
        shares = shards.JoinedShares(self._joined_share) if config.shard_optimizer else None
        if job is None:
            self._job = Job(comm, config, design, self.timeline, table, shares, self._world)
        else:
            job.reset(comm, config, design, table, shares)
        self.collectives = Collectives(self._job, config, self._size)
        """Collectives by name outside the key/value contract, in collective order with the
        store's own (:class:`~mpi_kvstore.store.collectives.Collectives`): ``array`` on an
        NDArray, ``run`` of a function of the communicator. The functional helpers and
        mpi_kvstore.horovod go through it."""
        self._optimizer = StoreOptimizer(self._keys, config, self._rank, self._size,
                                         self._job, self.collectives.run)
        # the exchange submits through the optimizer's gate, which holds the collectives of
        # MXNet's per-key loops until the loop's last key (heldloop.LoopGate)
        self._exchange = Exchange(self._keys, config, self._optimizer.gate, self._optimizer,
                                  self.collectives.run, self._job)

    def reset(self, comm: Any = None, lost: bool = False) -> None:
        """Run on ``comm`` from now on (default: the elastic world's communicator of the
        moment): every rank of it calls this at once, after an elastic world re-formed.
        Rank, size, the design and its communicators, the hierarchy, the tune table, the
        autotune state, the key table, the named buffers and the optimizer's shares are
        built anew; what was in flight on the old world has failed (HorovodInternalError),
        and the old communicators are abandoned, not freed. The store's optimizer, if one
        was set, is set again (its states start anew: restore them from a commit).
        ``lost``: the old world lost a peer (what is pending there fails, untouched by MPI)."""
        self._job.check_open()
        if self._job.lost is None and (lost or self._job.pending_now()):
            self._job.end_world(WorldLost('a peer of the old world was lost'))
        if comm is None:
            if self._world is None:
                raise ValueError('MPIKVStore.reset: give the new communicator (this store '
                                 'is not on an elastic world)')
            comm = self._world.comm
        optimizer = self._keys.updater.optimizer if self._keys.updater is not None else None
        self._build(comm, self._job)
        if optimizer is not None:
            self._optimizer.set(optimizer)

    def _joined_share(self, key):
        # The optimizer is made after the job (it submits through it); a join comes only
        # after construction, so it is there when a joined rank's mirror asks.
        return self._optimizer.joined_share(key)

    # -- identity -------------------------------------------------------------
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
        return self._job.design.name

    @property
    def config(self) -> Config:
        """The store's options in use (a :class:`~mpi_kvstore.config.Config`): 'auto'
        resolved, a tune table's schedule and autotune's switches applied."""
        return self._job.design.config

    @property
    def autotune_state(self) -> autotune.State | None:
        """Where the online search of the schedule stands (option ``autotune``): a
        :class:`~mpi_kvstore.designs.autotune.State` (``active`` until it settles,
        ``values`` in use, ``bound`` in steps, ``switches``), or None where this store does
        not search (autotune off, or a design without negotiation rounds)."""
        tuner = self._job.design.tuner
        return None if tuner is None else tuner.state()

    @staticmethod
    def is_capable(capability: str) -> bool:
        """Whether the store supports ``capability``: only MXNet's ``'optimizer'``."""
        return str(capability).lower() == KVStoreBase.OPTIMIZER

    @property
    def _updater(self):
        # Trainer.load_states reads kv._updater.optimizer; the key table holds the updater
        return self._keys.updater

    # -- the contract ---------------------------------------------------------------
    def init(self, key: Keys, value: Values) -> None:
        """Give keys rank 0's values."""
        self._job.begin()
        self._optimizer.release()
        entries = normalize(key, value)
        self._keys.validate(entries, fresh=True)
        self._exchange.broadcast(entries, 0)

    def broadcast(self, key: Keys, value: Values, out: Values | None = None,
                  priority: int = 0, root: int = 0) -> None:
        """Rank ``root``'s value lands in every out on every rank, and in the store.

        MXNet's signature, plus ``root`` (any rank; MXNet's stores broadcast from rank 0)
        and ``out=None``, which broadcasts in place: ``value`` itself receives root's value
        on every other rank, as Horovod's broadcast does.
        """
        self._job.begin(priority)
        self._optimizer.release()
        check_root(root, self._size)
        entries = normalize(key, value, out)
        self._keys.validate(entries, writes_values=out is None)
        if out is None:
            for entry in entries:
                entry.outs = entry.values
        self._exchange.broadcast(entries, priority, root)

    def pushpull(self, key: Keys, value: Values, out: Values | None = None,
                 priority: int = 0) -> None:
        """Sum value over devices and ranks into out (in place when out is None).

        An allreduce: the key needs no init; its first use fixes its shape and dtype.
        A call repeated on the same key and the very same arrays skips the checks that
        passed the first time (namecache.CallCache), and from then on takes the prepared
        path of its requests (Exchange.replay); without the store's optimizer, that path is
        one function (Exchange.again).
        """
        if self._exchange.again(self._calls.pushpull, key, value, out, priority):
            return
        self._job.begin(priority)
        replay = self._calls.find('pushpull', key, value, out)
        if replay is not None:
            if self._exchange.replay(replay, priority):
                self._calls.prepared('pushpull', key, replay)
            return
        entries = normalize(key, value, out)
        self._keys.validate(entries, need_weights=self._updater is not None,
                            writes_values=True, reduced_in_place=True)
        plans = [self._keys.plan(entry, True) for entry in entries]
        self._calls.remember('pushpull', key, value, out, plans, priority)
        self._exchange.run(plans, priority)

    def push(self, key: Keys, value: Values, priority: int = 0) -> None:
        """Sum value over devices and ranks into the store (through the optimizer if set).

        As in MXNet's own stores, the key must have been given a value by init() or
        broadcast() first; otherwise UnknownKeyError names the key, and nothing is sent.
        """
        if self._exchange.again(self._calls.push, key, value, None, priority):
            return
        self._job.begin(priority)
        replay = self._calls.find('push', key, value, None)
        if replay is not None:
            if self._exchange.replay(replay, priority):
                self._calls.prepared('push', key, replay)
            return
        entries = normalize(key, value)
        self._keys.validate(entries, need_weights=self._updater is not None,
                            needs_value='push')
        plans = [self._keys.plan(entry, False) for entry in entries]
        self._calls.remember('push', key, value, None, plans, priority)
        self._exchange.run(plans, priority)

    def pull(self, key: Keys, out: Values | None = None, priority: int = 0,
             ignore_sparse: bool = True) -> None:
        """Copy the stored value of each key into out. A pull of one key into the very
        array of its last pull, with nothing held, is one function (the copy)."""
        kind = key.__class__
        if kind is int or kind is str:
            known = self._pulls.get(key)
            if (known is not None and known[0] is out and out.handle.value == known[1]
                    and not self._job.closed and self._optimizer.idle()):
                self._job.begin(priority)
                known[2].value.copyto(out)
                known[2].weights = known[3]
                debug.count('again', 'pull')
                return
        self._job.begin(priority)
        self._optimizer.release()
        entries = normalize_out(key, out)
        states = [self._keys.with_value(entry.key) for entry in entries]
        self._keys.validate(entries, what='out')
        for state, entry in zip(states, entries):
            for arr in entry.outs:
                state.value.copyto(arr)
            state.weights = tuple(entry.outs)
        if (kind is int or kind is str) and len(entries) == 1 and entries[0].outs[0] is out:
            if len(self._pulls) >= CallCache.LIMIT:
                self._pulls.clear()
            self._pulls[key] = (out, out.handle.value, states[0], states[0].weights)

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
        self._job.begin()
        self._optimizer.release()
        self._job.wait()
        if self._size == 1:
            return 0
        last = self._job.design.join()
        self._exchange.sync_from(last)
        return last

    def row_sparse_pull(self, key: Keys, out: Values | None = None, priority: int = 0,
                        row_ids: Any = None) -> None:
        """Not supported: the store reduces dense arrays only (raises TypeError)."""
        raise TypeError('mpi_kvstore reduces dense arrays only; row_sparse_pull is not supported')

    # -- optimizer (optimizer.StoreOptimizer) ---------------------------------------
    def set_optimizer(self, optimizer: Any) -> None:
        """Run the optimizer in the store: every rank applies it to the same sums (with
        shard_optimizer, each rank to its share of every key)."""
        self._job.begin()
        self._optimizer.set(optimizer)
        self._calls.clear()   # with an optimizer nothing runs in place: plans change

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
        self._job.begin()
        self._optimizer.clip_next_step(max_norm, keys)

    def save_optimizer_states(self, fname: str, dump_optimizer: bool = False) -> None:
        """Write the optimizer's states (and the optimizer with ``dump_optimizer``) in
        MXNet's format. With shard_optimizer this is a collective that gathers every rank's
        shares, so every rank must call it; each writes the same whole-model file, which
        loads into a store of any size, sharded or not."""
        self._optimizer.save(fname, dump_optimizer)

    def load_optimizer_states(self, fname: str) -> None:
        """Read states saved by any store (sharded or not, at any number of ranks). A state
        whose size does not fit its key raises ValueError and changes nothing."""
        self._optimizer.load(fname)

    def set_gradient_compression(self, compression_params: dict) -> None:
        """MXNet's 2-bit compression of push and pushpull: {'type': '2bit', 'threshold': t}
        (t defaults to 0.5), or {'type': 'none'}. Every rank must set the same (their calls
        fail with RankMismatchError otherwise); it applies to the calls made after it, and
        each key keeps its residual (compression/)."""
        self._job.begin()
        self._optimizer.release()
        self._exchange.set_compression(compression_params)

    # -- synchronisation (named collectives: the ``collectives`` attribute) ---------------
    def wait(self) -> None:
        """Block until every collective pushed so far finished; raise what failed."""
        self._optimizer.release()
        self._job.wait()

    def _barrier(self):
        self.collectives.barrier()

    def close(self) -> None:
        """Finish in-flight work and stop the communication threads (idempotent).

        Raises the error of any collective that failed and was not raised yet.
        """
        if self._job.closed:
            return
        try:   # what a loop left held (it raised before its last key) goes first
            if self._job.lost is None:
                self._optimizer.release()
        finally:
            self._job.shut()
            shutdown.LIVE.discard(self)
        self._job.errors.raise_pending()

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
