"""One store's job: the design that runs its collectives, the requests not finished yet,
and the errors that wait for the user's thread.

Every unit of the store (exchange, optimizer, collectives) submits through :class:`Job`,
so that the error gate, the pending list the stall inspector reads and the order of
submission are kept in one place.

On an elastic world (``world``: an object whose ``check()`` raises once a peer is lost,
mpi_kvstore.elastic.world.World) every wait of the store's collectives calls the check
between its slices (progress.set_abort_check). The first check that raises ends the job's
world: its design is swapped for one that fails every later call at once, its thread is
stopped without an MPI call, and each request still pending completes with the error (its
output poisoned, its engine op failed, the error raised as it was on the user's thread).
A lost world's op fails in the engine even where its array is a staging buffer: a read the
user began before the loss is queued before the state's poisoning (:func:`on_world_lost`),
so the error must reach it along the ops that deliver the buffer (which MXNet then skips),
not as NaN delivered without an error. A request whose engine op MXNet skipped (an earlier
op on its array failed) never reaches the design; a fence behind it tells the drain so.
:meth:`Job.reset` then builds the design on the new communicator; the old one's
communicators are abandoned, not freed (freeing may wait for the lost peer). Until the reset
ends, the world's check also ends its waits at the re-forming's deadline
(World.settled), so that a peer lost during the reset ends it too.
"""
import collections
import functools
import logging
import threading
import time
import weakref

import mxnet as mx
from mxnet.base import MXNetError

from ..comm import abandoned, progress
from ..designs.base import new_comm
from ..engine import core as engine
from ..engine.takeup import Slot
from ..errors import MPIKVStoreError
from ..faults.abort import install_abort_hook
from ..faults.stall import StallInspector
from .contract import check_priority
from .deferred import DeferredErrors
from .namecache import Batch

__all__ = ['Job', 'jobs_on', 'lost_world', 'on_world_lost']

log = logging.getLogger(__name__)

DRAIN_TIMEOUT = 120.0   # seconds a lost world's requests may take to reach their engine ops
_ELASTIC: weakref.WeakSet = weakref.WeakSet()   # the jobs on an elastic world
_MARK = '_mpi_kvstore_lost'   # on the exception that ends a lost world's waits
_PRIORITY_BOUND = 1 << 30     # contract.check_priority's: a plain int inside needs no call
_LOST_HOOKS = []              # on_world_lost's functions


class Job:
    """The design of one store, its pending requests and its deferred errors.

    ``design(comm, config, sink, timeline, table, shares=shares)`` is built here, with this
    job's error queue as its sink and the store's shards.JoinedShares (or None).
    """

    def __init__(self, comm, config, design, timeline, table, shares=None, world=None):
        self.errors = DeferredErrors()
        self.pending = collections.deque()
        self.closed = False
        self.timeline = timeline
        self.world = world
        self.lost = None     # the error that ended this job's world (elastic), else None
        self._drainer = None
        self._ended = None   # the design of a world that end_world ended
        # held by a call while its requests are pending and their ops not all pushed
        self._pushing = None if world is None else threading.Lock()
        self.design = None
        if world is not None:   # first: the design's build waits (its Idup) end at a loss too
            _watch(self)
        try:
            self.design = self._design(design, comm, config, table, shares)
        except BaseException:
            _ELASTIC.discard(self)   # a job never built holds no world's loss
            raise
        self.again_direct = self._again_direct()
        install_abort_hook()  # a rank that raises must end the job, not hang the others
        self._inspector = StallInspector(comm, config, self.design, self.pending_now)

    def _again_direct(self):
        """The design's one function for a prepared call repeated (Chained.again_direct:
        ``again_direct(prepared, models, priority, pending) -> bool``), which the store's repeats
        call straight, once they checked the store open, with ``pending``: Job.again's
        work in it. None on an elastic world (the general path holds the drain's lock,
        _pushing) or a design without one: the store calls :meth:`again`."""
        return None if self.world is not None else getattr(self.design, 'again_direct', None)

    def _design(self, design, comm, config, table, shares):
        """The design on ``comm``; on an elastic world its communicators broadcast and wait
        at barriers in polled form (comm.host.Comm.abortable)."""
        if self.world is None:
            return design(comm, config, self.errors.record, self.timeline, table, shares=shares)

        def make_comm(concurrent=False):
            return new_comm(comm, config, table, concurrent).abortable()
        return design(comm, config, self.errors.record, self.timeline, table,
                      make_comm=make_comm, shares=shares)

    def check_open(self):
        if self.closed:
            raise MPIKVStoreError('the store is closed: create a new one to go on')

    def begin(self, priority=0):
        """What every call checks first: an open store, an int priority, no error pending."""
        if self.closed:
            self.check_open()
        if priority.__class__ is not int or not -_PRIORITY_BOUND < priority < _PRIORITY_BOUND:
            check_priority(priority)   # says what is wrong, or accepts an np.integer
        self.errors.raise_pending()

    def submit(self, reqs, priority):
        """Hand complete requests to the design, in call order."""
        if self.closed:
            self.check_open()
        pending, design = self.pending, self.design
        design.reap()
        while pending and pending[0].done:
            pending.popleft()
        if self._pushing is None:
            pending.extend(reqs)
            design.submit(reqs, priority)
        else:   # elastic: the drain fences no request whose op is not pushed yet (_drain)
            with self._pushing:   # read again: a drain may have ended the world meanwhile
                pending.extend(reqs)
                self.design.submit(reqs, priority)
        if self.design.synchronous:
            self.errors.raise_pending()

    def again(self, prepared, models, priority):
        """:meth:`submit` of a prepared call repeated (store/exchange.py, Exchange.again):
        its requests renewed from ``models``, by the design's one function where it has one
        for the call (Design.again), else made here and submitted. On an elastic world the
        general path, which holds the drain's lock (_pushing)."""
        if self._pushing is None and not self.closed:
            design = self.design
            design.reap()
            pending = self.pending
            while pending and pending[0].done:
                pending.popleft()
            if design.again(prepared, models, priority, pending):
                if design.synchronous:
                    self.errors.raise_pending()
                return
        self.submit(Batch.renewed(models, prepared), priority)

    def pending_now(self):
        """The collectives not finished yet (the stall inspector's thread asks)."""
        self.design.reap()
        return [req for req in list(self.pending) if not req.done]

    def wait(self):
        """Block until every collective pushed so far finished; raise what failed."""
        while self.pending:
            self.pending[0].wait()
            self.pending.popleft()
        self.errors.raise_pending()

    def shut(self):
        """Finish in-flight work and stop the threads; the caller then raises what failed
        (errors.raise_pending)."""
        if self.lost is not None:   # nothing more to finish: the world is gone
            self._join_drainer()
            self.closed = True
            _ELASTIC.discard(self)
            return
        for req in list(self.pending):
            req.wait(timeout=60)
        engine.consume_raised()  # the engine's copy of an error must not fail waitall
        mx.nd.waitall()
        engine.quiesce()
        self.closed = True
        _ELASTIC.discard(self)
        self._inspector.stop()
        self.design.close()
        if self.timeline:
            self.timeline.write()

    # -- an elastic world ---------------------------------------------------------------
    def check_world(self):
        """Raise (and end this job's world) once the world says a peer is lost."""
        try:
            self.world.check("the store's collectives")
        except Exception as err:
            setattr(err, _MARK, True)
            if self.design is not None:   # a design still being built has nothing pending
                self.end_world(err)
            raise

    def end_world(self, err):
        """The world is lost: fail every call from now on and every pending request with
        ``err`` (from a thread of its own: a waiting thread may call this), once."""
        with _watch_lock:
            if self.lost is not None:
                return
            self.lost = err
        log.warning('mpi_kvstore: the store ends its world: %s', err)
        for hook in list(_LOST_HOOKS):
            try:
                hook(err)
            except Exception:   # the requests must fail all the same
                log.exception('mpi_kvstore: a hook of the lost world failed')
        self.errors.keep_types = (type(err),)
        self.errors.record_error('the world', err)
        old, self.design = self.design, _Lost(self.design, err, self.errors)
        self.again_direct = None
        self._ended = old
        # the lost world's collectives stay MPI's: keep what owns their memory
        abandoned.keep(old, *self.pending)
        self._drainer = threading.Thread(target=self._drain, args=(old, err),
                                         name='mpi_kvstore-drain', daemon=True)
        self._drainer.start()

    def _drain(self, design, err):
        self._inspector.stop()
        _stop_without_mpi(design)
        collect = getattr(design, '_collect', None)
        fences = {}   # request -> Event: every op pushed on its array before the fence is past
        ends = time.monotonic() + DRAIN_TIMEOUT
        while time.monotonic() < ends:
            past = {req for req, fence in fences.items() if fence.is_set()}   # before collect
            if collect is not None:
                with _quiet():
                    collect()       # native ops that ran since: their requests get completions
            left = 0
            reqs = list(self.pending)
            # A fence must follow its request's op: one pushed first passes at once, the
            # request ends as skipped, and its op, pushed next onto a design that no longer
            # runs, never completes. A call holds _pushing from its requests' entry in
            # pending to the push of their ops: free now, every op of ``reqs`` is pushed.
            # (Without a world, reset drains from the only calling thread.)
            pushed = self._pushing is None or self._pushing.acquire(blocking=False)
            if pushed and self._pushing is not None:
                self._pushing.release()
            for req in reqs:
                if req.done:
                    continue
                if req.completion is None and req.array is not None:
                    if req in past:   # MXNet skipped its op (an earlier op on it failed)
                        if req.error is None:
                            req.fail(err)
                        req.finish()
                        continue
                    if pushed and req not in fences:   # its op waits, or was skipped
                        fences[req] = _fence(req.array)
                    left += 1
                    continue
                if req.error is None:
                    req.fail(err)
                _pass_errors(req.completion)
                req.complete()
            if not left:
                return
            time.sleep(0.001)
        log.error('mpi_kvstore: %d request(s) of a lost world never reached their engine op '
                  'in %g s', left, DRAIN_TIMEOUT)

    def _join_drainer(self):
        if self._drainer is not None:
            self._drainer.join(DRAIN_TIMEOUT)
            self._drainer = None

    def reset(self, comm, config, design, table, shares=None):
        """Build the design on ``comm`` (every rank of the new world calls it at once): the
        old design's requests are failed (if the world was lost) or finished, its threads
        stopped without MPI calls and its communicators abandoned."""
        if self.lost is None:
            for req in list(self.pending):
                req.wait(timeout=60)
            self._inspector.stop()
            _stop_without_mpi(self.design)
        old = self.design if self.lost is None else self._ended
        self._join_drainer()
        settle_engine()
        _close_waker(old)
        self.errors.take()
        self.errors.keep_types = ()
        self.pending.clear()
        self.lost = None
        self.design = self._design(design, comm, config, table, shares)
        self.again_direct = self._again_direct()
        self._inspector = StallInspector(comm, config, self.design, self.pending_now)
        settled = getattr(self.world, 'settled', None)
        if settled is not None:   # the reset's waits were bounded by the re-forming's deadline
            settled()


class _Lost:
    """The design of a lost world: every call fails at once with its error."""

    synchronous = True
    in_engine = False
    tuner = None
    pushed = 0

    def __init__(self, design, err, errors):
        self.name, self.config, self._err, self._errors = design.name, design.config, err, errors

    def submit(self, reqs, priority=0):
        for req in reqs:
            req.fail(self._err)
            req.finish()
        self._errors.record_error('the world', self._err)

    def reap(self):
        return None

    def close(self):
        return None

    def join(self):
        raise self._err


def _fence(array):
    """An Event set once every op pushed on ``array`` so far ran or was skipped: an op that
    writes it and that MXNet runs even after a failure (kNoSkip)."""
    passed = threading.Event()
    engine.push(functools.partial(_pass_fence, passed), mutable=[array],
                name='mpi_kvstore_lost_world_fence', always=True)
    return passed


def _pass_fence(passed, completion):
    passed.set()
    completion.done()


def _pass_errors(completion):
    """Have a lost world's failing op pass its error to the engine, also where its array is
    a staging buffer (a Slot or Countdown that would drop it: see the module's docstring)."""
    if isinstance(completion, Slot):
        completion.forward = True
    elif isinstance(completion, engine.Countdown):
        completion.pass_errors()


def _stop_without_mpi(design):
    """Stop a design's thread without freeing its communicators (their peers may be gone:
    a negotiated design ends its loop; a blocked wait ends at the abort check)."""
    thread = getattr(design, '_thread', None)
    if thread is None:
        return
    with design._lock:
        design._stop = True
    design._waker.notify()
    thread.join(timeout=10)
    if thread.is_alive():
        log.warning("mpi_kvstore: the lost world's %s thread did not stop in 10 s",
                    design.name)


def _close_waker(design):
    """Close the eventfd of a design whose thread has stopped and whose engine ops have all
    run (else each reset keeps one open)."""
    thread, waker = getattr(design, '_thread', None), getattr(design, '_waker', None)
    if waker is not None and (thread is None or not thread.is_alive()):
        waker.close()


class _quiet:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if exc[0] is not None:
            log.debug('mpi_kvstore: collecting a lost world\'s native ops failed',
                      exc_info=exc)
        return True


def settle_engine():
    """Clear the engine's errors of a lost world's failed ops (MXNet keeps each on every
    array computed from them, so a restore into those arrays would fail too): wait for
    every op, and read the errors off."""
    engine.consume_raised()
    for _ in range(3):
        try:
            mx.nd.waitall()
            return
        except MXNetError:
            continue


def on_world_lost(hook):
    """Call ``hook(err)`` whenever a store's world is lost, from the thread that saw it,
    before the store fails its pending requests (elastic.base's: the state poisons what the
    failed step leaves unfinished)."""
    if hook not in _LOST_HOOKS:
        _LOST_HOOKS.append(hook)


def jobs_on(world):
    """The open jobs of the stores on the elastic ``world``."""
    return [job for job in list(_ELASTIC) if job.world is world and not job.closed]


def lost_world():
    """The error that ended an elastic store's world, or None."""
    for job in list(_ELASTIC):
        if job.lost is not None:
            return job.lost
    return None


_watch_lock = threading.Lock()


def _check_worlds():
    first = None
    for job in list(_ELASTIC):   # every job learns of the loss, not only the first
        try:
            job.check_world()
        except Exception as err:
            first = first or err
    if first is not None:
        raise first


def _watch(job):
    """Have every wait check ``job``'s world, and a thread ended by its error end quietly."""
    with _watch_lock:
        if not _ELASTIC:
            progress.set_abort_check(_check_worlds)
            if not getattr(threading.excepthook, _MARK, False):
                threading.excepthook = _quiet_on_lost(threading.excepthook)
        _ELASTIC.add(job)


def _quiet_on_lost(previous):
    def excepthook(args):
        if getattr(args.exc_value, _MARK, False):
            log.info('mpi_kvstore: thread %s ended: %s', getattr(args.thread, 'name', '?'),
                     args.exc_value)
            return
        previous(args)
    setattr(excepthook, _MARK, True)
    return excepthook
