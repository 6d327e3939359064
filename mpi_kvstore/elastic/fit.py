"""``Module.fit`` that commits every few batches and, after a restore, goes on from the
committed epoch and batch (elastic.State.fit calls :func:`fit_module`)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mxnet as mx

__all__ = ['fit_module']


def fit_module(state: Any, module: Any, load_pending: Callable[[], Any],
               train_data: mx.io.DataIter, commit_every: int, batch_end_callback: Any = None,
               **fit_args: Any) -> None:
    """State.fit's body: ``state`` holds ``epoch`` and ``batch`` extra values;
    ``load_pending()`` loads the restored optimizer states once the optimizer is up."""
    for name in ('epoch', 'batch'):
        if name not in state.extra:
            raise TypeError('elastic.State.fit needs State(mod, epoch=0, batch=0)')
    module.init_optimizer(kvstore=fit_args.get('kvstore', 'local'),
                          optimizer=fit_args.get('optimizer', 'sgd'),
                          optimizer_params=fit_args.get('optimizer_params',
                                                        (('learning_rate', 0.01),)))
    load_pending()
    callbacks = batch_end_callback or []
    callbacks = list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
    progress = {'skip': state.extra['batch'], 'first_epoch': state.extra['epoch']}

    def commit(param):
        skip = progress['skip'] if param.epoch == progress['first_epoch'] else 0
        state.extra['epoch'], state.extra['batch'] = param.epoch, param.nbatch + 1 + skip
        if state.extra['batch'] % commit_every == 0:
            state.commit()

    def next_epoch(epoch, symbol, arg, aux):
        state.extra['epoch'], state.extra['batch'] = epoch + 1, 0

    fit_args.pop('begin_epoch', None)   # the State's epoch
    epoch_end = fit_args.pop('epoch_end_callback', None) or []
    epoch_end = list(epoch_end) if isinstance(epoch_end, (list, tuple)) else [epoch_end]
    try:
        module.fit(_Skipping(train_data, progress['skip']),
                   batch_end_callback=[commit] + callbacks,
                   epoch_end_callback=[next_epoch] + epoch_end,
                   begin_epoch=state.extra['epoch'], **fit_args)
    except _EpochDone:   # committed after the epoch's last batch: go on with the next
        train_data.reset()
        state.extra['epoch'], state.extra['batch'] = state.extra['epoch'] + 1, 0
        progress.update(skip=0, first_epoch=None)
        module.fit(train_data, batch_end_callback=[commit] + callbacks,
                   epoch_end_callback=[next_epoch] + epoch_end,
                   begin_epoch=state.extra['epoch'], **fit_args)


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
