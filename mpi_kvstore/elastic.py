"""Committed state that survives a lost rank: ``mpi_kvstore.elastic.State``.

    state = elastic.State(net.collect_params(), trainer, step=0)   # restores the last commit
    for step in range(state.step, steps):
        ...train one step, with data chosen by `step`...
        state.step = step + 1
        if state.step % 5 == 0:
            state.commit()

Under ``python -m mpi_kvstore run --state-dir D`` a lost rank makes the supervisor relaunch
the job (supervisor.py), and the new job goes on from the last commit. Horovod's elastic
``State`` is the model; here nothing survives in memory: every launch starts from files.

A commit is one directory, ``commit-<n>``, written by rank 0 under a temporary name and
renamed into place (one atomic rename), then the older commits beyond ``keep`` are removed.
A process killed at any point leaves the previous commit whole: a reader takes the highest
``commit-<n>`` and ignores temporary directories. A commit holds:

- ``params.pkl``: the parameters' values, in order, with their names and shapes;
- ``trainer.states``: the trainer's optimizer states in MXNet's format
  (``Trainer.save_states``; the store's, gathered from every rank when it is sharded), or a
  Module's (``save_optimizer_states``);
- ``meta.pkl``: the user's extra values (``step``, ``epoch``...), the job's size, and every
  rank's Python and numpy random states (MXNet's own generator has no state to read: seed
  it from the step where the model draws random numbers, as the example does).

Every rank takes part in ``commit()`` (it is collective when the optimizer is sharded, and
ends with a barrier). At construction, rank 0 reads the last commit and broadcasts it, so
every rank starts alike whatever file system it sees.
"""
from __future__ import annotations

import logging
import os
import pickle
import random
import re
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import mxnet as mx
import numpy as np

from .comm.mpiabi import MPI
from .launch import supervision

__all__ = ['State', 'latest_commit']

log = logging.getLogger(__name__)

_COMMIT = re.compile(r'^commit-(\d+)$')
DEFAULT_DIRECTORY = 'mpi_kvstore_state'


def latest_commit(directory: str) -> tuple[int, str | None]:
    """(number, path) of the newest whole commit in ``directory``, or (0, None)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return 0, None
    found = [(int(m.group(1)), name) for name in names for m in [_COMMIT.match(name)] if m]
    if not found:
        return 0, None
    number, name = max(found)
    return number, os.path.join(directory, name)


class _Params:
    """The parameters as a list of (name, NDArray getter/setter): a gluon ParameterDict (or
    a Block), a Module, or a dict of NDArrays."""

    def __init__(self, params):
        if isinstance(params, mx.gluon.Block):
            params = params.collect_params()
        self.module = params if isinstance(params, mx.mod.BaseModule) else None
        self.params = params

    def _arrays(self):
        """[(name, NDArray)] in a fixed order."""
        if self.module is not None:
            args, auxs = self.module.get_params()
            return ([('arg:' + k, v) for k, v in sorted(args.items())]
                    + [('aux:' + k, v) for k, v in sorted(auxs.items())])
        if isinstance(self.params, dict):
            return sorted(self.params.items())
        return [(name, p.data()) for name, p in self.params.items()]

    def values(self):
        """[(name, numpy array)] in a fixed order."""
        return [(name, array.asnumpy()) for name, array in self._arrays()]

    def assign(self, saved):
        """Set every parameter from ``saved`` ([(name, array)], as :meth:`values` gives).
        Names may differ (gluon prefixes count blocks per process); shapes must not."""
        mine = [array.shape for _, array in self._arrays()]
        if mine != [value.shape for _, value in saved]:
            raise ValueError('elastic.State: the committed parameters (%d, shapes %s...) '
                             'do not fit this model\'s (%d, shapes %s...)'
                             % (len(saved), [v.shape for _, v in saved[:3]], len(mine),
                                mine[:3]))
        if self.module is not None:
            args = {n[4:]: mx.nd.array(v, dtype=v.dtype) for n, v in saved if n[:4] == 'arg:'}
            auxs = {n[4:]: mx.nd.array(v, dtype=v.dtype) for n, v in saved if n[:4] == 'aux:'}
            self.module.set_params(args, auxs, allow_missing=False, force_init=True)
        elif isinstance(self.params, dict):
            for (_, array), (_, value) in zip(sorted(self.params.items()), saved):
                array[:] = mx.nd.array(value, ctx=array.context, dtype=value.dtype)
        else:
            for param, (_, value) in zip(self.params.values(), saved):
                param.set_data(mx.nd.array(value, dtype=value.dtype))


class State:
    """Parameters, optimizer states, extra values and random states, committed together.

    ``params``: a gluon ParameterDict or Block, a Module, or a dict of NDArrays;
    ``trainer``: a gluon Trainer (DistributedTrainer included), or None (a Module saves
    its own optimizer states); ``directory``: where commits go (default: the supervisor's
    ``--state-dir``, else ./mpi_kvstore_state); ``keep``: commits kept; ``on_resize``:
    ``on_resize(old_size, new_size)``, called after a restore at another size;
    ``comm``: the ranks that commit together (default COMM_WORLD); ``**extra``: values
    the script reads and sets as attributes (``state.step``), committed with the rest.
    """

    def __init__(self, params: Any, trainer: Any = None, directory: str | None = None,
                 keep: int = 2, on_resize: Callable[[int, int], Any] | None = None,
                 comm: MPI.Comm | None = None, **extra: Any) -> None:
        object.__setattr__(self, 'extra', dict(extra))
        self._params = _Params(params)
        self._trainer = trainer
        self._dir = os.path.abspath(directory or os.environ.get(supervision.STATE_ENV)
                                    or DEFAULT_DIRECTORY)
        self._keep = max(1, int(keep))
        self._comm = comm if comm is not None else MPI.COMM_WORLD
        self._rank, self._size = self._comm.Get_rank(), self._comm.Get_size()
        self.on_resize = on_resize
        self.restored = False
        """Whether a commit was restored at construction."""
        self.restored_from: tuple[int, int] | None = None
        """(commit number, the number of ranks that wrote it) of the restored commit."""
        self.number = 0
        """The last commit's number (0: none yet)."""
        if self._rank == 0:
            os.makedirs(self._dir, exist_ok=True)
        self._restore()

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

    # -- commit ----------------------------------------------------------------------------
    def commit(self) -> int:
        """Write the state as the next commit (every rank calls it; returns its number)."""
        states = self._optimizer_states()
        rng = self._comm.gather((random.getstate(), np.random.get_state()), root=0)
        number = self.number + 1
        failure = None
        if self._rank == 0:
            try:
                self._write(number, states, rng)
            except Exception as err:   # every rank must hear of it, and none may hang
                failure = '%s: %s' % (type(err).__name__, err)
        failure = self._comm.bcast(failure, root=0)
        if failure is not None:
            raise OSError('elastic.State: commit %d to %s failed on rank 0: %s'
                          % (number, self._dir, failure))
        self.number = number
        return number

    def _optimizer_states(self):
        """The optimizer states' bytes in MXNet's format (collective for a sharded store)."""
        saver = self._saver()
        if saver is None:
            return None
        fd, path = tempfile.mkstemp(prefix='mpi_kvstore_states_')
        os.close(fd)
        try:
            saver(path)
            with open(path, 'rb') as fh:
                return fh.read()
        finally:
            os.unlink(path)

    def _saver(self):
        if self._trainer is not None:
            return self._trainer.save_states
        module = self._params.module
        if module is not None and module.optimizer_initialized:
            return module.save_optimizer_states
        return None

    def _write(self, number, states, rng):
        tmp = tempfile.mkdtemp(prefix='.tmp-commit-%d-' % number, dir=self._dir)
        meta = {'extra': self.extra, 'size': self._size, 'number': number, 'rng': rng}
        for name, data in (('params.pkl', pickle.dumps(self._params.values(), protocol=4)),
                           ('meta.pkl', pickle.dumps(meta, protocol=4)),
                           ('trainer.states', states)):
            if data is None:
                continue
            with open(os.path.join(tmp, name), 'wb') as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
        final = os.path.join(self._dir, 'commit-%08d' % number)
        os.rename(tmp, final)      # the commit exists whole, or not at all
        _fsync_dir(self._dir)
        for _, path in sorted(_commits(self._dir))[:-self._keep]:
            shutil.rmtree(path, ignore_errors=True)
        for name in os.listdir(self._dir):   # temporaries of commits killed half-way
            if name.startswith('.tmp-commit-'):
                shutil.rmtree(os.path.join(self._dir, name), ignore_errors=True)

    # -- restore ---------------------------------------------------------------------------
    def _restore(self):
        found = None
        if self._rank == 0:
            number, path = latest_commit(self._dir)
            if path is not None:
                found = _read(path)
                found['number'] = number
        found = self._comm.bcast(found, root=0)
        if found is None:
            return
        self._check_not_started()
        meta = found['meta']
        self._params.assign(found['params'])
        if found['states'] is not None:
            if self._trainer is None and self._params.module is not None:
                self._module_states = found['states']   # loaded by fit(), after its optimizer
            else:
                self._load_states(found['states'])
        self.extra.update(meta['extra'])
        if meta['size'] == self._size:   # each rank's own random states
            random.setstate(meta['rng'][self._rank][0])
            np.random.set_state(meta['rng'][self._rank][1])
        self.number = found['number']
        self.restored = True
        self.restored_from = (found['number'], meta['size'])
        if self._rank == 0:
            log.info('mpi_kvstore elastic: restored commit %d (written by %d rank(s)) from %s',
                     found['number'], meta['size'], self._dir)
        if meta['size'] != self._size and self.on_resize is not None:
            self.on_resize(meta['size'], self._size)

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
        for name in ('epoch', 'batch'):
            if name not in self.extra:
                raise TypeError('elastic.State.fit needs State(mod, epoch=0, batch=0)')
        module.init_optimizer(kvstore=fit_args.get('kvstore', 'local'),
                              optimizer=fit_args.get('optimizer', 'sgd'),
                              optimizer_params=fit_args.get('optimizer_params',
                                                            (('learning_rate', 0.01),)))
        pending = self.__dict__.pop('_module_states', None)
        if pending is not None:
            self._load_states(pending)
        callbacks = batch_end_callback or []
        callbacks = list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
        # an extra value (State(mod, batch=0)); mypy reads the tuple assignment below as its
        # definition and cannot type it
        skip = self.batch  # type: ignore[has-type]

        def commit(param):
            self.epoch, self.batch = param.epoch, param.nbatch + 1 + (
                skip if param.epoch == first_epoch else 0)
            if self.batch % commit_every == 0:
                self.commit()

        def next_epoch(epoch, symbol, arg, aux):
            self.epoch, self.batch = epoch + 1, 0

        first_epoch = self.epoch
        fit_args.pop('begin_epoch', None)   # the State's epoch
        epoch_end = fit_args.pop('epoch_end_callback', None) or []
        epoch_end = list(epoch_end) if isinstance(epoch_end, (list, tuple)) else [epoch_end]
        try:
            module.fit(_Skipping(train_data, skip), batch_end_callback=[commit] + callbacks,
                       epoch_end_callback=[next_epoch] + epoch_end,
                       begin_epoch=self.epoch, **fit_args)
        except _EpochDone:   # committed after the epoch's last batch: go on with the next
            train_data.reset()
            self.epoch, self.batch, skip, first_epoch = self.epoch + 1, 0, 0, None
            module.fit(train_data, batch_end_callback=[commit] + callbacks,
                       epoch_end_callback=[next_epoch] + epoch_end,
                       begin_epoch=self.epoch, **fit_args)

    def _load_states(self, data):
        fd, path = tempfile.mkstemp(prefix='mpi_kvstore_states_')
        try:
            with os.fdopen(fd, 'wb') as fh:
                fh.write(data)
            if self._trainer is not None:
                self._trainer.load_states(path)
            elif self._params.module is not None and self._params.module.optimizer_initialized:
                self._params.module.load_optimizer_states(path)
            else:
                log.warning('mpi_kvstore elastic: the commit holds optimizer states, but this '
                            'State has no trainer and no initialised Module to load them into')
        finally:
            os.unlink(path)


class _EpochDone(Exception):
    """The batches to skip were the whole epoch: it was committed after its last batch."""


class _Skipping(mx.io.DataIter):
    """A data iterator whose first pass skips ``skip`` batches (a resumed epoch); raises
    _EpochDone, before Module.fit trains anything, where they were the whole epoch."""

    def __init__(self, inner, skip):
        super().__init__(inner.batch_size)
        self._inner, self._skip = inner, skip

    @property
    def provide_data(self):
        return self._inner.provide_data

    @property
    def provide_label(self):
        return self._inner.provide_label

    def reset(self):
        self._inner.reset()

    def next(self):
        skipped = self._skip > 0
        try:
            while self._skip:
                self._skip -= 1
                self._inner.next()
            return self._inner.next()
        except StopIteration:
            if skipped:   # nothing left of this epoch after the batches already trained
                raise _EpochDone() from None
            raise


def _commits(directory):
    return [(int(m.group(1)), os.path.join(directory, name)) for name in os.listdir(directory)
            for m in [_COMMIT.match(name)] if m]


def _read(path):
    with open(os.path.join(path, 'params.pkl'), 'rb') as fh:
        params = pickle.load(fh)
    with open(os.path.join(path, 'meta.pkl'), 'rb') as fh:
        meta = pickle.load(fh)
    states = None
    if os.path.exists(os.path.join(path, 'trainer.states')):
        with open(os.path.join(path, 'trainer.states'), 'rb') as fh:
            states = fh.read()
    return {'params': params, 'meta': meta, 'states': states}


def _fsync_dir(path):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
