"""Horovod's broadcast_parameters, DistributedTrainer and DistributedOptimizer, averaging as
Horovod does."""
from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import mxnet as mx
import numpy as np
from mxnet import gluon

from ..optim import batched
from ._state import _require_init
from .basics import (
    NDArray,
    Sum,
    elastic_world,
    size,
    store,
)
from .compression import Compression, _ours, _trainer_store
from .ops import (
    _OWN_PRECISION,
    _allreduce_inplace,
    _fold,
    _scale,
    _set_root,
    _set_store,
    broadcast_,
)
from .process_sets import ProcessSet, global_process_set


# -- parameters, trainer, optimizer -----------------------------------------------------------
def _broadcast_after_init(param, root_rank, name):
    """Wrap a deferred parameter's initialisation so that root's values follow it, inside
    the first forward and before the data is used (every rank runs that forward)."""
    original = param._init_impl

    def init_then_broadcast(self, *args, **kwargs):
        original(*args, **kwargs)
        for i, array in enumerate(self.list_data()):
            broadcast_(array, root_rank, name='%s.%d' % (name, i))

    param._init_impl = init_then_broadcast.__get__(param)


def broadcast_parameters(params: Mapping[str, Any], root_rank: int = 0,
                         prefix: str | None = None) -> None:
    """Give every process ``root_rank``'s values: ``params`` is a ParameterDict or a dict of
    Parameters (Block.collect_params()), or a dict of NDArrays (Module.get_params()), broadcast
    in place in name order. A Parameter whose initialisation is deferred is broadcast when it
    is initialised. ``prefix`` names the collectives of one call apart from another's.
    Returns once the values arrived: a broadcast that failed (a peer lost) raises here, never
    leaving NaN in the parameters for a later call to report."""
    _require_init()
    if prefix is not None and not isinstance(prefix, str):
        raise ValueError('broadcast_parameters: prefix must be a str or None, not %r'
                         % (prefix,))
    if not isinstance(params, (dict, gluon.ParameterDict)):
        raise ValueError('invalid params of type: %s' % type(params))
    _set_root(global_process_set, root_rank, 'broadcast_parameters')
    if size() == 1:
        return
    prefix = prefix or ''
    for name, value in sorted(params.items(), key=lambda item: str(item[0])):
        full = 'hvd.param:%s%s' % (prefix, name)
        if isinstance(value, gluon.Parameter):
            if value._deferred_init:
                _broadcast_after_init(value, root_rank, full)
                continue
            for i, array in enumerate(value.list_data()):
                broadcast_(array, root_rank, name='%s.%d' % (full, i))
        elif isinstance(value, mx.nd.NDArray):
            broadcast_(value, root_rank, name=full)
        else:
            raise ValueError('broadcast_parameters: %r is a %s, not a Parameter or an NDArray'
                             % (name, type(value).__name__))
    store().wait()


def _split_list(items, parts):
    """``items`` cut into ``parts`` runs of near-equal length, in order (the first runs get
    one more), empty runs left out."""
    return [run for run in np.array_split(np.arange(len(items)), parts) if len(run)]


# Bytes of gradients a pushpull when num_groups is 0 (as mpi_kvstore.DistributedTrainer).
GROUP_BYTES = 4 << 20


def _byte_groups(entries):
    """(key, grads) entries, last first, in runs of about GROUP_BYTES."""
    runs, run, total = [], [], 0
    for entry in reversed(entries):
        nbytes = entry[1][0].size * np.dtype(entry[1][0].dtype).itemsize
        if run and total + nbytes > GROUP_BYTES:
            runs.append(run)
            run, total = [], 0
        run.append(entry)
        total += nbytes
    if run:
        runs.append(run)
    return runs


class DistributedTrainer(gluon.Trainer):
    """Horovod's DistributedTrainer: a gluon.Trainer whose gradients are averaged over the
    processes of ``process_set``, so ``step(local batch size)`` trains as one process would on
    every process's batch together. Gradients are scaled by ``1/gradient_predivide_factor``
    before the sum and ``gradient_predivide_factor/size`` after (in the optimizer's
    rescale_grad, as Horovod does on a CPU). Where every gradient is float32 or float64 and
    the exchange is uncompressed, the two cancel in rescale_grad (``1/size``; the result
    differs by rounding only) and no gradient is scaled by an engine op of its own.

    The exchange is the store's pushpull (engine ops, fused): ``num_groups=0`` in groups of
    about 4 MB, last layer first (mpi_kvstore.DistributedTrainer's order); ``num_groups=n``:
    the parameters cut into n near-equal groups, one pushpull each. ``compression``: a
    :class:`Compression` member (fp16, bf16: the store's wire cast; twobit: MXNet's 2-bit), or
    any Horovod-style compressor (compress, a sum, decompress). Unlike Horovod, the trainer
    also gives every process rank 0's parameters at its first step (gluon.Trainer's own
    broadcast), a no-op after broadcast_parameters."""

    def __init__(self, params: Any, optimizer: Any, optimizer_params: dict | None = None,
                 compression: Any = Compression.none, gradient_predivide_factor: float = 1.0,
                 prefix: str | None = None, num_groups: int = 0,
                 process_set: ProcessSet = global_process_set) -> None:
        if isinstance(optimizer, DistributedOptimizer):
            optimizer = optimizer._optimizer
            warnings.warn('DistributedTrainer does not take DistributedOptimizer as its '
                          'optimizer. We have unwrapped it for you.', stacklevel=2)
        if prefix is not None and not isinstance(prefix, str):
            raise ValueError('DistributedTrainer: prefix must be a str or None')
        if not float(gradient_predivide_factor) > 0:
            raise ValueError('DistributedTrainer: gradient_predivide_factor must be > 0, not %r'
                             % (gradient_predivide_factor,))
        if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 0:
            raise ValueError('DistributedTrainer: num_groups must be an int >= 0, not %r'
                             % (num_groups,))
        kv = _trainer_store(process_set, compression)
        self._custom = None if _ours(compression) else compression
        # an elastic world of one may grow: its trainer exchanges from the start
        exchange = kv.num_workers > 1 or elastic_world() is not None
        super().__init__(params, optimizer, optimizer_params,
                         kvstore=kv if exchange else None,
                         update_on_kvstore=False if exchange else None)
        self._predivide = float(gradient_predivide_factor)
        self._scale *= self._predivide / kv.num_workers
        # whether _scale holds the predivide factor (the gradients prescaled by engine
        # ops), or not (it cancelled: _prescale_ops); its fold needs the wire in the
        # gradients' own precision, as horovod.ops._fold
        self._prescaled = True
        self._foldable = _ours(compression) and compression.name == 'none'
        self._workers = kv.num_workers
        self._prefix = prefix or ''
        self._num_groups = num_groups
        self._hvd_store = kv
        self._process_set = process_set
        self._calls = batched.StepCalls()   # the step's pushpulls, kept while they hold

    def _init_optimizer(self, optimizer, optimizer_params):
        """gluon.Trainer's, with the store's updater (optim.batched.Updater): MXNet's SGD on
        a step's keys from kept groups, the same weights at a fifth of the CPU."""
        super()._init_optimizer(optimizer, optimizer_params)
        self._updaters = [batched.Updater(self._optimizer) for _ in self._updaters]

    def _allreduce_grads(self):
        entries = [(i, param.list_grad()) for i, param in enumerate(self._params)
                   if param.grad_req != 'null']
        # a custom compressor's exchange prescales what it compressed (_allreduce_custom)
        custom = self._custom is not None and self._kvstore
        if self._predivide != 1.0 and self._prescale_ops(entries) and not custom:
            # on one process too: rescale_grad holds the factor
            for _, grads in entries:
                for grad in grads:
                    _scale(grad, 1.0 / self._predivide)
        if not self._kvstore:
            return
        if self._hvd_store.num_workers != self._workers:   # hvd.elastic re-formed the world
            ratio, self._workers = self._workers / self._hvd_store.num_workers, \
                self._hvd_store.num_workers
            self._scale *= ratio
            self._optimizer.rescale_grad *= ratio
        if self._custom is not None:
            self._allreduce_custom(entries)
            return
        for keys, grads, priority in self._calls.get(self._num_groups, entries, self._runs):
            self._kvstore.pushpull(keys, grads, priority=priority)

    def _runs(self, entries):
        """The step's pushpulls (keys, gradient lists, priority): num_groups runs, else by
        bytes (batched.StepCalls keeps them while the arrays are the same)."""
        if self._num_groups > 0:
            runs = [[entries[j] for j in run] for run in _split_list(entries, self._num_groups)]
        else:
            runs = _byte_groups(entries)
        # gluon's convention: the lower the key, the higher the priority
        calls = [([key for key, _ in run], [grads for _, grads in run],
                  -min(key for key, _ in run)) for run in runs]
        return calls

    def _prescale_ops(self, entries):
        """Whether the gradients take the predivide factor by engine ops of their own: not
        where every one is float32 or float64 and the exchange is uncompressed, for the
        factor then cancels in rescale_grad (set to hold it or not, here, before the
        update reads it). A float16 sum (or a compressed wire) keeps it: it guards the sum
        against overflow, as horovod.ops._fold keeps a float16 prescale."""
        ops = not (self._foldable and all(np.dtype(grad.dtype) in _OWN_PRECISION
                                          for _, grads in entries for grad in grads))
        if ops != self._prescaled:
            ratio = self._predivide if ops else 1.0 / self._predivide
            self._scale *= ratio
            self._optimizer.rescale_grad *= ratio
            self._prescaled = ops
        return ops

    def _allreduce_custom(self, entries):
        """A compressor of Horovod's kind: compress, sum, decompress, as Horovod does, the
        compressed tensor summed as Horovod's allreduce_(compressed, prescale_factor=
        1/gradient_predivide_factor): folded into the sum where its dtype allows
        (horovod.ops._fold: float32/64; float16 keeps the prescale op, as the overflow
        guard), never an op on the gradient before it is compressed."""
        pre = 1.0 / self._predivide
        for key, grads in entries:
            for j, grad in enumerate(grads):
                compressed, ctx = self._custom.compress(grad)
                name = 'hvd.trainer:%s%d.%d' % (self._prefix, key, j)
                _allreduce_inplace([compressed], Sum, [name], pre, 1.0, self._process_set,
                                   'DistributedTrainer', again=False)
                grad[:] = self._custom.decompress(compressed, ctx)


class DistributedOptimizer(mx.optimizer.Optimizer):
    """Horovod's DistributedOptimizer, for Module (``mod.fit(..., kvstore=None,
    optimizer=hvd.DistributedOptimizer(opt))``): each update first averages its gradients
    over the processes (a sum of ``grad / gradient_predivide_factor``, with the wrapped
    optimizer's rescale_grad multiplied by ``gradient_predivide_factor / size`` here, as
    Horovod does on a CPU; the ``1/gradient_predivide_factor`` folded into the sum's scaling
    where the dtype allows, horovod.ops._fold), then runs the wrapped optimizer. Other attributes are the wrapped
    optimizer's. ``num_groups`` is accepted: each gradient is its own collective, and the
    store fuses those ready together."""

    def __init__(self, optimizer: mx.optimizer.Optimizer, gradient_predivide_factor: float = 1.0,
                 num_groups: int = 0, process_set: ProcessSet = global_process_set) -> None:
        if not float(gradient_predivide_factor) > 0:
            raise ValueError('DistributedOptimizer: gradient_predivide_factor must be > 0')
        kv = _set_store(process_set, 'DistributedOptimizer')
        self._optimizer = optimizer
        self._predivide = float(gradient_predivide_factor)
        self._num_groups = num_groups
        self._process_set = process_set
        self._hvd_store = kv
        optimizer.rescale_grad *= self._predivide / kv.num_workers

    def __getattr__(self, item):
        if item.startswith('__') or item == '_optimizer':
            raise AttributeError(item)
        return getattr(self._optimizer, item)

    def create_state(self, index: int, weight: NDArray) -> Any:
        """The wrapped optimizer's state for this weight."""
        return self._optimizer.create_state(index, weight)

    def create_state_multi_precision(self, index: int, weight: NDArray) -> Any:
        """The wrapped optimizer's multi-precision state for this weight."""
        return self._optimizer.create_state_multi_precision(index, weight)

    def _do_allreduce(self, index, grad):
        indices = list(index) if isinstance(index, (tuple, list)) else [index]
        grads = list(grad) if isinstance(grad, (tuple, list)) else [grad]
        pre, size = 1.0 / self._predivide, self._hvd_store.num_workers
        if size == 1:
            for g in grads:   # on one process too: rescale_grad holds the factor
                _scale(g, pre)
            return
        names = ['hvd.opt:%s' % (i,) for i in indices]
        # Horovod's allreduce_(grad, prescale_factor=1/predivide): folded into the sum's
        # scaling where the dtype allows (horovod.ops._fold), in the signature as given
        folds = [_fold(dtype, False, pre, 1.0, size)
                 for dtype in self._hvd_store.collectives.dtypes(names, grads)]
        if any(fold[0] != 1.0 for fold in folds):
            # what the store would reject the call for, before a prescale op changes a
            # gradient (as horovod.ops._allreduce_inplace): a rejected call leaves them as
            # they were, and a retried one scales them once
            self._hvd_store.collectives.check(names, grads)
        for g, fold in zip(grads, folds):
            _scale(g, fold[0])
        self._hvd_store.collectives.allreduce(names, grads, factors=[f[2] for f in folds],
                                              scale=None if pre == 1.0 else (pre, 1.0))

    def update(self, index: Any, weight: Any, grad: Any, state: Any) -> None:
        """Sum ``grad`` over the processes in place (rescale_grad makes it their mean), then
        run the wrapped optimizer's update."""
        self._do_allreduce(index, grad)
        self._optimizer.update(index, weight, grad, state)

    def update_multi_precision(self, index: Any, weight: Any, grad: Any, state: Any) -> None:
        """Sum ``grad`` over the processes in place (rescale_grad makes it their mean), then
        run the wrapped optimizer's multi-precision update."""
        self._do_allreduce(index, grad)
        self._optimizer.update_multi_precision(index, weight, grad, state)

    def set_learning_rate(self, lr: float) -> None:
        """Set the wrapped optimizer's learning rate."""
        self._optimizer.set_learning_rate(lr)

    def set_lr_mult(self, args_lr_mult: dict) -> None:
        """Set the wrapped optimizer's per-parameter learning-rate multipliers."""
        self._optimizer.set_lr_mult(args_lr_mult)

    def set_wd_mult(self, args_wd_mult: dict) -> None:
        """Set the wrapped optimizer's per-parameter weight-decay multipliers."""
        self._optimizer.set_wd_mult(args_wd_mult)
