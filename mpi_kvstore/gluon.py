"""Gluon conveniences: broadcast_parameters and DistributedTrainer."""
import types

import numpy as np
from mxnet import gluon

from .functional import broadcast_, default_store
from .optim import batched

__all__ = ['broadcast_parameters', 'DistributedTrainer']


def _params_in_order(params):
    """(name, Parameter) sorted by name, so every rank broadcasts in one order."""
    items = params.items() if hasattr(params, 'items') else ((p.name, p) for p in params)
    return sorted(items, key=lambda item: item[0])


def _broadcast_param(param, name, root, store):
    for i, array in enumerate(param.list_data()):
        broadcast_(array, root=root, name='param:%s:%d' % (name, i), store=store)


def _defer_broadcast(param, name, root, store):
    """Broadcast a deferred parameter right after its data exists, before any forward uses it."""
    original = param._init_impl

    def init_then_broadcast(self, *args, **kwargs):
        original(*args, **kwargs)
        _broadcast_param(self, name, root, store)

    param._init_impl = types.MethodType(init_then_broadcast, param)


def broadcast_parameters(params, root=0, store=None):
    """Give every rank root's parameter values (collective).

    ``params``: a ParameterDict, a dict name -> Parameter, or a list of Parameters.
    A parameter whose initialisation is deferred is broadcast when its shape
    becomes known, inside the first forward and before its data is used; this
    needs every rank to run that forward, which data-parallel training does.
    """
    store = store if store is not None else default_store()
    for name, param in _params_in_order(params):
        if param._deferred_init:
            _defer_broadcast(param, name, root, store)
        elif param._data is not None:
            _broadcast_param(param, name, root, store)


# Bytes of gradients per grouped pushpull of DistributedTrainer (group_bytes).
GROUP_BYTES = 4 << 20


def _groups(items, limit):
    """Split (key, grads, nbytes) items, in order, into runs of at most `limit` bytes
    (a larger single item is a run of its own); limit <= 0: one run of everything."""
    runs, run, size = [], [], 0
    for item in items:
        if run and limit > 0 and size + item[2] > limit:
            runs.append(run)
            run, size = [], 0
        run.append(item)
        size += item[2]
    if run:
        runs.append(run)
    return runs


class DistributedTrainer(gluon.Trainer):
    """A gluon.Trainer that broadcasts parameters at construction and exchanges
    gradients in grouped pushpulls, last layer first.

    Backward produces the last layer's gradients first, while gluon.Trainer
    pushes the first layer first. So this trainer pushes the parameters in
    reverse, in groups of about ``group_bytes`` (default 4 MB): each group is
    one engine operation that runs as soon as its own gradients exist, in the
    order backward makes them, so every design (chained too, whose order is the
    push order) overlaps the exchange with the rest of backward.
    ``group_bytes=0``: one pushpull of every gradient (no overlap, the least
    overhead per step).

    Gradients are summed over ranks: call ``step(global_batch_size)``; or pass
    ``average=True`` to the store and ``step(local_batch_size)``.
    ``compression_params``: as gluon.Trainer's ({'type': '2bit', 'threshold': t}).
    """

    def __init__(self, params, optimizer, optimizer_params=None, store=None, root=0,
                 group_bytes=GROUP_BYTES, compression_params=None):
        if not isinstance(group_bytes, int) or isinstance(group_bytes, bool) or group_bytes < 0:
            raise ValueError('DistributedTrainer: group_bytes must be an int >= 0, not %r'
                             % (group_bytes,))
        store = store if store is not None else default_store()
        broadcast_parameters(params, root=root, store=store)
        super().__init__(params, optimizer, optimizer_params, kvstore=store,
                         compression_params=compression_params, update_on_kvstore=False)
        self._group_bytes = group_bytes
        self._calls = batched.StepCalls()   # the step's pushpulls, kept while they hold

    def _init_optimizer(self, optimizer, optimizer_params):
        """gluon.Trainer's, with the store's updater (optim.batched.Updater): MXNet's SGD on
        a step's keys from kept groups, the same weights at a fifth of the CPU."""
        super()._init_optimizer(optimizer, optimizer_params)
        self._updaters = [batched.Updater(self._optimizer) for _ in self._updaters]

    def _allreduce_grads(self):
        if not self._kvstore:
            return
        entries = [(i, param.list_grad()) for i, param in reversed(list(enumerate(self._params)))
                   if param.grad_req != 'null']
        for keys, grads, priority in self._calls.get(self._group_bytes, entries, self._runs):
            self._kvstore.pushpull(keys, grads, priority=priority)

    def _runs(self, entries):
        """The step's pushpulls (keys, gradient lists, priority): gradients grouped up to
        group_bytes (batched.StepCalls keeps them while the arrays are the same)."""
        items = [(i, grads, grads[0].size * np.dtype(grads[0].dtype).itemsize)
                 for i, grads in entries]
        # Gluon's convention: the lower the key, the higher the priority.
        calls = [([key for key, _, _ in run], [grads for _, grads, _ in run], -run[-1][0])
                 for run in _groups(items, self._group_bytes)]
        return calls
