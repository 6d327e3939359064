"""``elastic.State``: parameters, optimizer states, extra values and random states, committed
together, in memory always and on disk where a directory is given.

A commit copies the state in memory (what ``restore()`` goes back to, Horovod's semantics)
and, with a directory (``State(directory=D)``, the supervisor's ``--state-dir``, else
./mpi_kvstore_state; ``directory=False`` for memory only), writes it as ``commit-<n>``
(disk.py), which a relaunched job restores at construction: rank 0 reads it and broadcasts
it, so every rank starts alike whatever file system it sees.
"""
from __future__ import annotations

import copy
import logging
import os
import pickle
from collections.abc import Callable
from typing import Any

import mxnet as mx

from ..comm.mpiabi import MPI
from ..launch import rendezvous, supervision
from ..store.job import settle_engine
from ..store.kvstore import MPIKVStore
from . import disk
from .base import BaseState
from .exceptions import HostsUpdatedInterrupt
from .fit import fit_module
from .snapshot import (
    Params,
    load_optimizer_states,
    optimizer_states,
    random_states,
    set_random_states,
)

__all__ = ['State', 'DEFAULT_DIRECTORY']

log = logging.getLogger(__name__)

DEFAULT_DIRECTORY = 'mpi_kvstore_state'


def _trainer_point(trainer):
    """Where a gluon trainer stands, for the others' :meth:`State._ready_trainer`: whether it
    stepped (its store made) and its optimizer's rescale_grad; None for no gluon trainer."""
    if trainer is None or not hasattr(trainer, '_init_kvstore'):
        return None
    return {'started': bool(trainer._kv_initialized),
            'rescale': getattr(trainer._optimizer, 'rescale_grad', 1.0)}


class State(BaseState):
    """Parameters, optimizer states, extra values and random states, committed together.

    ``params``: a gluon ParameterDict or Block, a Module, or a dict of NDArrays;
    ``trainer``: a gluon Trainer (DistributedTrainer included), or None (a Module saves
    its own optimizer states); ``directory``: where commits are written (default: the
    supervisor's ``--state-dir``, else ./mpi_kvstore_state; False: in memory only);
    ``keep``: commits kept on disk; ``on_resize``: ``on_resize(old_size, new_size)``, called
    after a restore from disk at another size; ``comm``: the ranks that commit together
    (default COMM_WORLD; or a function returning the communicator of the moment);
    ``bcast_object``: how :meth:`sync` and the host check broadcast rank 0's values
    (default: the communicator's bcast; an elastic world passes its deadline-bound one);
    ``**extra``: values the script reads and sets as attributes (``state.step``), committed
    with the rest.
    """

    def __init__(self, params: Any, trainer: Any = None, directory: str | bool | None = None,
                 keep: int = 2, on_resize: Callable[[int, int], Any] | None = None,
                 comm: MPI.Comm | Callable[[], MPI.Comm] | None = None,
                 bcast_object: Callable[[Any], Any] | None = None, **extra: Any) -> None:
        object.__setattr__(self, 'extra', dict(extra))
        if comm is None or isinstance(comm, MPI.Comm):
            fixed = MPI.COMM_WORLD if comm is None else comm
            self._comm: Callable[[], MPI.Comm] = lambda: fixed
        else:
            self._comm = comm
        super().__init__(bcast_object or (lambda obj: self._comm().bcast(obj, root=0)),
                         lambda: self._comm().Get_rank())
        self._params = Params(params)
        self._trainer = trainer
        self._dir: str | None = None
        if directory is not False:
            self._dir = os.path.abspath(str(directory or os.environ.get(supervision.STATE_ENV)
                                            or DEFAULT_DIRECTORY))
        self._keep = max(1, int(keep))
        self.on_resize = on_resize
        self.restored = False
        """Whether a commit was restored from disk at construction."""
        self.restored_from: tuple[int, int] | None = None
        """(commit number, the number of ranks that wrote it) of the restored commit."""
        self.number = 0
        """The last commit's number (0: none yet)."""
        if self._dir is not None:
            if self._comm().Get_rank() == 0:
                os.makedirs(self._dir, exist_ok=True)
            if os.environ.get(rendezvous.JOIN_ENV) == '1':
                # the running ranks restored long ago: the first sync gives rank 0's state
                log.info('mpi_kvstore elastic: joining a running job: the state comes from '
                         'rank 0, not from %s', self._dir)
            else:
                self._restore_from_disk()
        self._saved = self._snapshot()

    @property
    def directory(self) -> str | None:
        """Where commits are written, or None for a State kept in memory only."""
        return self._dir

    # -- extra values as attributes ----------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        extra = self.__dict__.get('extra', {})
        if name in extra:
            return extra[name]
        raise AttributeError('elastic.State has no value %r (give it to State(..., %s=...))'
                             % (name, name))

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.__dict__.get('extra', {}):
            self.extra[name] = value
        else:
            object.__setattr__(self, name, value)

    # -- commit, restore, sync ---------------------------------------------------------------
    def _snapshot(self):
        """The state now: copies that later steps leave alone."""
        return {'params': self._params.values(),
                'states': optimizer_states(self._trainer, self._params.module),
                'extra': copy.deepcopy(self.extra), 'rng': random_states()}

    def save(self) -> None:
        """Copy the state in memory as the commit :meth:`restore` goes back to (no disk,
        no host check; :meth:`commit` does all three)."""
        self._saved = self._snapshot()

    def commit(self) -> int:
        """Copy the state in memory and, with a directory, write it as the next commit on
        disk; then check for host updates. Every rank calls it. A commit that cannot be
        written raises OSError on every rank and changes nothing: the previous commit stays,
        in memory and on disk. Returns the commit's number."""
        snapshot = self._snapshot()
        number = self.number + 1
        if self._dir is not None:
            self._write(number, snapshot)
        self._saved = snapshot
        self.number = number
        self._just_saved = snapshot
        try:
            self.check_host_updates()
        finally:
            del self._just_saved
        return number

    def check_host_updates(self) -> None:
        """Raise HostsUpdatedInterrupt on every rank if rank 0 heard of a host update since
        the last check. Collective."""
        try:
            super().check_host_updates()
        except HostsUpdatedInterrupt:
            if self._store_optimizer():   # the reset rebuilds the store, and its states
                saved = self.__dict__.get('_just_saved')
                self._carry = (saved['states'] if saved is not None
                               else optimizer_states(self._trainer, self._params.module))
            raise

    def on_world_lost(self, err: BaseException) -> None:
        """The step a lost peer interrupted: every parameter's next read raises
        LostWorldRead, and later ones see NaN (snapshot.Params.poison); once a loss, until
        :meth:`restore`."""
        if not self.__dict__.get('_poisoned'):
            self._poisoned = True
            self._params.poison('the world was lost (%s)' % err)

    def _store_optimizer(self):
        """Whether the optimizer runs in the trainer's (or the Module's) store
        (update_on_kvstore): the store holds the weights and the states, which a reset of
        the store starts anew."""
        trainer, module = self._trainer, self._params.module
        if trainer is None and module is not None:
            return bool(module.optimizer_initialized and module._kvstore is not None
                        and module._update_on_kvstore)
        return bool(trainer is not None and getattr(trainer, '_kv_initialized', False)
                    and getattr(trainer, '_update_on_kvstore', False))

    def _weights_store(self):
        """The store of a trainer or Module whose optimizer runs in it, or None."""
        if not self._store_optimizer():
            return None
        return (self._trainer or self._params.module)._kvstore

    def _module_store(self):
        """The elastic store (an MPIKVStore) of a Module whose optimizer is set up, or None:
        a reset rebuilds it knowing no key, so the Module's weights are given to it again."""
        module = self._params.module
        if self._trainer is not None or module is None or not module.optimizer_initialized:
            return None
        return module._kvstore if isinstance(module._kvstore, MPIKVStore) else None

    def must_sync_after_reset(self) -> bool:
        """Whether the next reset needs a sync even where the hosts were only removed: the
        store's optimizer states and weights are given back to it there (a Module's store
        needs its keys again after any reset)."""
        return '_carry' in self.__dict__ or self._module_store() is not None

    def on_reset(self) -> None:
        """After a reset: the next :meth:`sync` gives a Module's rebuilt store its keys."""
        self._store_reset = True
        super().on_reset()

    def _write(self, number, snapshot):
        comm = self._comm()
        rng = comm.gather(snapshot['rng'], root=0)
        failure = None
        if comm.Get_rank() == 0:
            meta = {'extra': snapshot['extra'], 'size': comm.Get_size(), 'number': number,
                    'rng': rng}
            files = {'params.pkl': pickle.dumps(snapshot['params'], protocol=4),
                     'meta.pkl': pickle.dumps(meta, protocol=4),
                     'trainer.states': snapshot['states']}
            try:
                self._write_files(number, files)
            except Exception as err:   # every rank must hear of it, and none may hang
                failure = '%s: %s' % (type(err).__name__, err)
        failure = comm.bcast(failure, root=0)
        if failure is not None:
            raise OSError('elastic.State: commit %d to %s failed on rank 0 (%s); commit %d '
                          'stays the last, and nothing of commit %d was left behind'
                          % (number, self._dir, failure, self.number, number))

    def _write_files(self, number, files):
        assert self._dir is not None
        disk.write_commit(self._dir, number, files, self._keep)

    def restore(self) -> None:
        """Go back to the last commit (in memory): parameters, optimizer states, extra
        values and this rank's random states. Local: no rank waits for another. With the
        optimizer in the store (update_on_kvstore), its weights and states are given back
        to it by the next :meth:`sync` (which ``run`` calls after each reset)."""
        saved = self._saved
        self._poisoned = False
        store = self._weights_store()
        if store is not None:   # the store's last updates land before, not after
            try:
                store.wait()
            except Exception as err:   # what failed is the loss being answered
                log.info('mpi_kvstore elastic: restore after %s', err)
            settle_engine()
        self._params.assign(saved['params'])
        if store is not None:
            self._carry = saved['states']
            if self._trainer is not None:   # weights to the store (a Module's: in sync)
                self._trainer._params_to_init = list(self._trainer._params)
        elif saved['states'] is not None:
            load_optimizer_states(self._trainer, self._params.module, saved['states'])
        self.extra.clear()
        self.extra.update(copy.deepcopy(saved['extra']))
        set_random_states(saved['rng'])

    def sync(self) -> None:
        """Every rank takes rank 0's parameters, optimizer states and extra values, which
        become each rank's commit. Collective. A rank that joined a running world takes
        them too; with the optimizer in the store, every rank gives the store rank 0's
        weights (the trainer's broadcast of its parameters) and the states its reset lost."""
        comm = self._comm()
        root = comm.Get_rank() == 0
        reset = self.__dict__.pop('_store_reset', False)
        carried = '_carry' in self.__dict__
        # a rank whose trainer never stepped (a newcomer) has none, and gathers nothing
        states = (self.__dict__.pop('_carry') if carried
                  else optimizer_states(self._trainer, self._params.module))
        payload = None
        if root:
            payload = {'params': self._params.values(), 'states': states, 'extra': self.extra,
                       'trainer': _trainer_point(self._trainer)}
        payload = self._bcast_object(payload)
        self._ready_trainer(payload['trainer'])
        if not root:
            self._params.assign(payload['params'])
            self.extra.clear()
            self.extra.update(payload['extra'])
        if reset:
            self._ready_module_store()
        if payload['states'] is not None and (not root or carried):
            self._load_states(payload['states'])
        self._saved = {'params': payload['params'], 'states': payload['states'],
                       'extra': copy.deepcopy(payload['extra']), 'rng': random_states()}

    def _ready_module_store(self):
        """Give a Module's store, rebuilt by the reset, rank 0's weights (now every rank's),
        as the Module's init_optimizer did: a rank that joins does the same in its
        init_optimizer (State.fit), at the same point of the collectives."""
        store = self._module_store()
        if store is None:
            return
        module = self._params.module
        module.get_params()   # the host copies the store is given, up to date
        mx.model._initialize_kvstore(
            kvstore=store, param_arrays=module._exec_group.param_arrays,
            arg_params=module._arg_params, param_names=module._param_names,
            update_on_kvstore=module._update_on_kvstore)

    def _load_states(self, states):
        """Load optimizer states; a Module's before its optimizer is up (a rank that joined,
        a restore at construction) wait for State.fit, which loads them after it."""
        module = self._params.module
        if self._trainer is None and module is not None and not module.optimizer_initialized:
            self._module_states = states
        else:
            load_optimizer_states(self._trainer, module, states)

    def _ready_trainer(self, point):
        """Bring every rank's trainer to rank 0's ``point`` (:func:`_trainer_point`) so
        that no rank broadcasts its parameters alone at its next step. Before rank 0's
        first step: every rank broadcasts at its next step, as rank 0's first step does.
        After: the store is made where it was not (a newcomer), and the parameters are
        broadcast now from rank 0 into a store that holds the weights (the optimizer in the
        store), or left to this sync (the optimizer on the ranks)."""
        trainer = self._trainer
        if point is None or trainer is None or not hasattr(trainer, '_init_kvstore'):
            return
        if not point['started']:
            if trainer._kv_initialized:
                trainer._params_to_init = list(trainer._params)
            return
        if not trainer._kv_initialized:
            trainer._init_kvstore()
            if trainer._update_on_kvstore:   # what rank 0's first step set, checked at each
                trainer._optimizer.rescale_grad = point['rescale']
        if trainer._kvstore is not None and trainer._update_on_kvstore:
            trainer._params_to_init = list(trainer._params)
            trainer._init_params()
        else:
            trainer._params_to_init = [p for p in trainer._params_to_init if p._deferred_init]

    # -- restore from disk, at construction -----------------------------------------------
    def _restore_from_disk(self):
        comm = self._comm()
        rank, size = comm.Get_rank(), comm.Get_size()
        found = None
        if rank == 0:
            assert self._dir is not None
            number, path = disk.latest_commit(self._dir)
            if path is not None:
                found = disk.read_commit(path)
                found['number'] = number
        found = comm.bcast(found, root=0)
        if found is None:
            return
        self._check_not_started()
        meta = found['meta']
        self._params.assign(found['params'])
        if found['states'] is not None:
            self._load_states(found['states'])
        self.extra.update(meta['extra'])
        if meta['size'] == size:   # each rank's own random states
            set_random_states(meta['rng'][rank])
        self.number = found['number']
        self.restored = True
        self.restored_from = (found['number'], meta['size'])
        if rank == 0:
            log.info('mpi_kvstore elastic: restored commit %d (written by %d rank(s)) from %s',
                     found['number'], meta['size'], self._dir)
        if meta['size'] != size and self.on_resize is not None:
            self.on_resize(meta['size'], size)

    def _check_not_started(self):
        """Restored values must reach the store before it copies the weights: the store
        keeps its own copy once the trainer's first step or the Module's optimizer set it
        up, and would go on from that."""
        trainer, module = self._trainer, self._params.module
        if trainer is not None and getattr(trainer, '_kv_initialized', False):
            raise RuntimeError('elastic.State: create the State before the trainer\'s first '
                               'step: its store already holds the weights, and a restored '
                               'commit would not reach it')
        if trainer is None and module is not None and module.optimizer_initialized:
            raise RuntimeError('elastic.State: create the State of a Module before '
                               'init_optimizer (or fit): State.fit initialises the optimizer '
                               'after the restored parameters, then loads its states')

    # -- Module.fit ------------------------------------------------------------------------
    def fit(self, train_data: mx.io.DataIter, commit_every: int, batch_end_callback: Any = None,
            **fit_args: Any) -> None:
        """``Module.fit`` that commits every ``commit_every`` batches and, after a restore,
        goes on from the committed epoch and batch. The Module was bound and its
        parameters initialised before the State was created; this initialises its optimizer
        (``kvstore``, ``optimizer``, ``optimizer_params`` of ``fit_args``), loads the
        committed optimizer states, and skips the batches of the epoch already trained
        (the data's order must be the same each epoch: no shuffling iterator). The State
        needs ``epoch`` and ``batch`` extra values (``State(mod, epoch=0, batch=0)``)."""
        module = self._params.module
        if module is None:
            raise TypeError('elastic.State.fit needs a State of a Module')
        fit_module(self, module, self._load_pending_states, train_data, commit_every,
                   batch_end_callback, **fit_args)

    def _load_pending_states(self):
        pending = self.__dict__.pop('_module_states', None)
        if pending is not None:
            load_optimizer_states(None, self._params.module, pending)
