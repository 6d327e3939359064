"""``hvd.elastic``: Horovod's elastic API for MXNet (Horovod has it for PyTorch and
TensorFlow only).

    state = hvd.elastic.MXNetState(net.collect_params(), trainer, epoch=0, batch=0)
    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...
            state.commit()

    train(state)

The semantics are Horovod's: ``commit()`` copies the state in memory and checks for host
updates; a :class:`HorovodInternalError` restores the last commit, re-forms the world, syncs
the state from rank 0 and calls the function again; a :class:`HostsUpdatedInterrupt` does
the same without the restore. Under ``python -m mpi_kvstore run --state-dir D`` every commit
is written to disk too, and a relaunched job restores it (mpi_kvstore.elastic).

The world is re-formed by the function :func:`set_world_reset` registers; without one, under
``python -m mpi_kvstore run --elastic`` the survivors re-form their world in memory and the
stores of ``hvd.init`` are rebuilt on it (basics.reform_world); else the job's world is the
fixed MPI world, and a reset keeps it.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from .. import elastic as _elastic
from ..elastic import HorovodInternalError, HostsUpdatedInterrupt
from ..launch import supervision
from . import basics
from ._state import _require_init, _state
from .ops import broadcast_object

__all__ = ['run', 'State', 'ObjectState', 'MXNetState', 'HorovodInternalError',
           'HostsUpdatedInterrupt', 'set_world_reset']

log = logging.getLogger(__name__)

State = _elastic.BaseState
"""Horovod's base state (``bcast_object``, ``get_rank``; subclasses define save, restore
and sync): commit, check_host_updates, register_reset_callbacks."""

_world_reset: list[Callable[[], Any]] = []


def set_world_reset(reset: Callable[[], Any] | None) -> None:
    """Register the function that re-forms the world after a lost rank or a host update
    (None: the fixed MPI world, kept as it is)."""
    _world_reset[:] = [] if reset is None else [reset]


def _reset() -> None:
    if _world_reset:
        _world_reset[0]()
    elif basics.elastic_world() is not None:   # under run --elastic: the survivors re-form
        try:
            basics.reform_world()
        finally:   # the stores' reset and the ranks' identities are done with
            basics.elastic_world().settled()
    else:
        log.info('mpi_kvstore elastic: a reset in a fixed MPI world keeps its %d rank(s)',
                 basics.size())


def _rank() -> int:
    return basics.rank()


class ObjectState(_elastic.ObjectState):
    """Python values kept across resets, as attributes (Horovod's ``ObjectState``).
    ``bcast_object`` and ``get_rank`` default to :func:`broadcast_object` and :func:`rank`."""

    def __init__(self, bcast_object: Callable[[Any], Any] | None = None,
                 get_rank: Callable[[], int] | None = None, **kwargs: Any) -> None:
        super().__init__(bcast_object or _bcast_object, get_rank or _rank, **kwargs)


def _bcast_object(obj: Any) -> Any:
    """The elastic world's broadcast where there is one (a lost worker ends it), else the
    store's."""
    world_bcast = basics.world_bcast_object()
    return broadcast_object(obj) if world_bcast is None else world_bcast(obj)


class MXNetState(_elastic.State):
    """A Gluon model's state kept across resets: the parameters (a ParameterDict or a
    Block), the trainer's optimizer states (the sharded ones too), and the keyword values as
    attributes (``state.epoch``). Commits live in memory, and on disk too under the
    supervisor's ``--state-dir``. The optimizer may run on the ranks (DistributedTrainer) or
    in the store (a gluon.Trainer on the store, sharded or not): after a reset the store
    gets back the weights and the states. A worker that joins takes rank 0's state at the
    first sync, never the disk's."""

    def __init__(self, params: Any, trainer: Any = None, **kwargs: Any) -> None:
        _require_init()
        directory = os.environ.get(supervision.STATE_ENV) or False
        super().__init__(params, trainer, directory=directory,
                         comm=lambda: _state['comm'],
                         bcast_object=basics.world_bcast_object(), **kwargs)
        world = _state.get('world')
        if world is not None:   # the launcher's host notices: HostsUpdatedInterrupt at commit
            world.listeners.append(self.on_hosts_updated)


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: ``func(state, ...)`` runs to its end through resets (Horovod's
    ``hvd.elastic.run``). The state is synced from rank 0 before each call; no collective
    may run between the decorator's call and ``func``'s first line."""
    return _elastic.run_fn(func, _reset)
