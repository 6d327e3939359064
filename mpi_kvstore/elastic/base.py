"""Horovod's elastic pattern: a state that commits, restores and syncs, and ``run_fn``, which
calls the training function again after each reset.

The semantics are Horovod's (horovod.common.elastic): a commit is an in-memory copy plus a
check for host updates; a :class:`HorovodInternalError` restores the last commit, then the
world is reset and the state synced from rank 0; a :class:`HostsUpdatedInterrupt` resets
without a restore. Horovod's callers pass ``bcast_object`` and ``get_rank``; the world's
reset is the caller's (mpi_kvstore.horovod.elastic passes one).

A step that a lost peer interrupts leaves arrays half done: MXNet skips the ops after a failed
collective, so the weights keep their values of before the step, and the engine's error sits
on them only until the first read of any of them. While ``run_fn`` runs a state, the store
tells it of the loss (store.job.on_world_lost) and the state makes every read of its values
raise :class:`~.exceptions.LostWorldRead` (a HorovodInternalError), then give NaN: never a
weight that looks right. MXNet raises the error type a message names first
(``mxnet.base.register_error``): the store's messages begin ``mpi_kvstore:``, read here as
LostWorldRead once a store's world is lost, else as MXNetError, as before.
"""
from __future__ import annotations

import abc
import functools
import logging
import os
import queue
import threading
from collections.abc import Callable, Iterable
from typing import Any

from mxnet.base import MXNetError, register_error

from ..launch import supervision
from ..store.job import lost_world, on_world_lost, settle_engine
from .exceptions import HorovodInternalError, HostsUpdatedInterrupt, LostWorldRead

__all__ = ['BaseState', 'ObjectState', 'run_fn', 'notify_hosts_updated']

log = logging.getLogger(__name__)

_listeners: list[BaseState] = []   # the states inside run_fn, told of host updates
_listeners_lock = threading.Lock()


def _store_error(message: str) -> Exception:
    """The error of a read whose message the store wrote (``mpi_kvstore: ...``)."""
    return LostWorldRead(message) if lost_world() is not None else MXNetError(message)


def _world_lost(err: BaseException) -> None:
    """store.job's word of a lost world: every state inside ``run_fn`` hears of it."""
    with _listeners_lock:
        states = list(_listeners)
    for state in states:
        state.on_world_lost(err)


register_error('mpi_kvstore', _store_error)
on_world_lost(_world_lost)


def notify_hosts_updated(timestamp: float, removed_only: bool = False) -> None:
    """Tell every state inside ``run_fn`` that the hosts changed at ``timestamp``: their next
    ``commit()`` or ``check_host_updates()`` raises HostsUpdatedInterrupt on every rank."""
    with _listeners_lock:
        states = list(_listeners)
    for state in states:
        state.on_hosts_updated(timestamp, removed_only)


class BaseState(abc.ABC):
    """The state Horovod's elastic mode tracks across resets (``hvd.elastic.State``).

    ``bcast_object(obj)``: rank 0's ``obj`` on every rank; ``get_rank()``: this rank.
    Subclasses define :meth:`save`, :meth:`restore` and :meth:`sync`.
    """

    def __init__(self, bcast_object: Callable[[Any], Any], get_rank: Callable[[], int]) -> None:
        self._bcast_object = bcast_object
        self._get_rank = get_rank
        self._host_messages: queue.Queue = queue.Queue()
        self._last_updated_timestamp = 0.0
        self._reset_callbacks: list[Callable[[], Any]] = []

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], Any]]) -> None:
        """Functions called (without arguments) after each reset, once the world is
        re-formed: to rescale the learning rate or repartition the data by the new size."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Called by ``run`` after a reset: forgets host updates, calls the reset callbacks."""
        self._host_messages = queue.Queue()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: float, removed_only: bool = False) -> None:
        """Record that the hosts changed at ``timestamp`` (the notification channel calls
        this); the next :meth:`check_host_updates` acts on it."""
        self._host_messages.put((timestamp, removed_only))

    def on_world_lost(self, err: BaseException) -> None:
        """A store's world was lost while ``run_fn`` runs this state (called from the thread
        that saw it, before the store fails its requests): a state whose values the
        interrupted step leaves half done makes their reads fail. Nothing here."""
        return None

    def commit(self) -> Any:
        """Copy the state in memory (:meth:`save`), then :meth:`check_host_updates`.
        Collective: every rank calls it."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise HostsUpdatedInterrupt on every rank if rank 0 heard of a host update since
        the last check (collective: rank 0's view is broadcast, so all ranks agree)."""
        latest, removed_only = self._last_updated_timestamp, True
        while True:
            try:
                timestamp, removed = self._host_messages.get_nowait()
            except queue.Empty:
                break
            if timestamp > latest:
                latest = timestamp
                removed_only = removed_only and removed
        # rank 0's previous timestamp too: a rank that joined later has none of its own
        previous, latest, removed_only = self._bcast_object(
            (self._last_updated_timestamp, latest, removed_only))
        self._last_updated_timestamp = latest
        if latest > previous:
            raise HostsUpdatedInterrupt(skip_sync=removed_only)

    def must_sync_after_reset(self) -> bool:
        """Whether a reset after hosts were only removed needs a sync all the same (False:
        the survivors' states agree; a state whose store lost what it held says True)."""
        return False

    @abc.abstractmethod
    def save(self) -> None:
        """Copy the state in memory (the commit's copy)."""

    @abc.abstractmethod
    def restore(self) -> None:
        """Go back to the last commit, undoing what changed since."""

    @abc.abstractmethod
    def sync(self) -> None:
        """Give every rank rank 0's state."""


class ObjectState(BaseState):
    """Python values kept across resets, as attributes (``state.epoch``): Horovod's
    ``ObjectState``. ``bcast_object`` and ``get_rank`` as for :class:`BaseState`."""

    def __init__(self, bcast_object: Callable[[Any], Any], get_rank: Callable[[], int],
                 **kwargs: Any) -> None:
        self._saved_state = dict(kwargs)
        self._set_attrs()
        super().__init__(bcast_object, get_rank)

    def save(self) -> None:
        """Copy the attributes' current values as the commit."""
        self._saved_state = {name: getattr(self, name) for name in self._saved_state}

    def restore(self) -> None:
        """Set the attributes back to the last commit's values."""
        self._set_attrs()

    def sync(self) -> None:
        """Every rank takes rank 0's committed values."""
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self):
        for name, value in self._saved_state.items():
            setattr(self, name, value)


def reset_limit(environ: Any = None) -> int:
    """The supervisor's ``--reset-limit`` (0: no limit)."""
    try:
        return int((os.environ if environ is None else environ).get(
            supervision.RESET_LIMIT_ENV, '0'))
    except ValueError:
        return 0


def _reset_until_formed(reset: Callable[[], Any], resets: int, bound: int) -> int:
    """``reset()``, again while it raises HorovodInternalError; the resets counted so far."""
    while True:
        resets += 1
        if bound and resets > bound:
            raise RuntimeError('mpi_kvstore elastic: %d resets, more than the limit of %d'
                               % (resets, bound))
        try:
            reset()
            return resets
        except (HorovodInternalError, MXNetError) as err:
            if not isinstance(err, HorovodInternalError) and lost_world() is None:
                raise
            log.warning('mpi_kvstore elastic: the reset lost the world too (%s); '
                        're-forming again', err)
            settle_engine()


def run_fn(func: Callable[..., Any], reset: Callable[[], Any],
           limit: int | None = None) -> Callable[..., Any]:
    """``func(state, ...)`` run to its end through resets: after a HorovodInternalError the
    state is restored to its last commit, ``reset()`` re-forms the world, and the state is
    synced from rank 0 before ``func`` is called again; after a HostsUpdatedInterrupt, the
    same without the restore. A reset that loses a worker itself (HorovodInternalError out
    of ``reset()``: a peer died while the world re-formed) is tried again, each try counted
    as a reset. More than ``limit`` resets (default: the supervisor's ``--reset-limit``, 0
    for none) raise RuntimeError."""
    @functools.wraps(func)
    def wrapper(state: BaseState, *args: Any, **kwargs: Any) -> Any:
        bound = reset_limit() if limit is None else limit
        resets, skip_sync = 0, False
        with _listeners_lock:
            _listeners.append(state)
        try:
            while True:
                try:
                    if not skip_sync:
                        state.sync()
                    return func(state, *args, **kwargs)
                except (HorovodInternalError, MXNetError) as err:
                    # a read of an output that a lost world's collective failed raises
                    # MXNet's error: the loss is the store's to tell
                    if not isinstance(err, HorovodInternalError) and lost_world() is None:
                        raise
                    log.warning('mpi_kvstore elastic: %s; restoring the last commit',
                                lost_world() or err)
                    settle_engine()   # the failed ops' errors off the arrays restored into
                    state.restore()
                    skip_sync = False
                except HostsUpdatedInterrupt as err:
                    log.info('mpi_kvstore elastic: %s; re-forming the world', err)
                    skip_sync = err.skip_sync and not state.must_sync_after_reset()
                resets = _reset_until_formed(reset, resets, bound)
                state.on_reset()
        finally:
            with _listeners_lock:
                _listeners.remove(state)
    return wrapper
