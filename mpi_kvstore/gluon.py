"""Gluon conveniences: broadcast_parameters and DistributedTrainer."""
import types

from mxnet import gluon

from .collectives import broadcast_, default_store

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


class DistributedTrainer(gluon.Trainer):
    """A gluon.Trainer that broadcasts parameters at construction and exchanges
    all gradients in one grouped pushpull per step.

    Gradients are summed over ranks: call ``step(global_batch_size)``; or pass
    ``average=True`` to the store and ``step(local_batch_size)``.
    """

    def __init__(self, params, optimizer, optimizer_params=None, store=None, root=0):
        store = store if store is not None else default_store()
        broadcast_parameters(params, root=root, store=store)
        super().__init__(params, optimizer, optimizer_params, kvstore=store,
                         update_on_kvstore=False)

    def _allreduce_grads(self):
        if not self._kvstore:
            return
        keys, grads = [], []
        for i, param in enumerate(self._params):
            if param.grad_req != 'null':
                keys.append(i)
                grads.append(param.list_grad())
        if keys:
            self._kvstore.pushpull(keys, grads, priority=0)
