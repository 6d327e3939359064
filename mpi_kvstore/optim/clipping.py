"""Clipping by the global norm where the store runs the optimizer: the user's code never
holds the summed gradient there (and with shard_optimizer no rank holds it whole), so the
store clips it (MPIKVStore.clip_global_norm), told before each step which keys make it.

With the optimizer outside the store (``update_on_kvstore=False``, DistributedTrainer) the
user clips as in one process, between ``trainer.allreduce_grads()`` and
``trainer.update()``.
"""
from mxnet import gluon

from .shards import check_max_norm

__all__ = ['clip_global_norm']


def clip_global_norm(trainer, max_norm):
    """Clip the gradient of every step of ``trainer`` (a gluon.Trainer with
    ``update_on_kvstore=True``, or an mx.mod.Module, ``fit`` included) by its global norm
    inside its mpi_kvstore store. The norm is that of the gradient the optimizer applies,
    the sum over the ranks times ``rescale_grad``; each step's gradient is scaled by
    min(1, max_norm / norm). Returns ``trainer``."""
    check_max_norm(max_norm)   # here, before a bad value waits for the first step
    if isinstance(trainer, gluon.Trainer):
        _wrap(trainer, '_allreduce_grads', lambda: _gluon_keys(trainer), max_norm)
    elif hasattr(trainer, 'update') and hasattr(trainer, '_exec_group'):
        _wrap(trainer, 'update', lambda: _module_keys(trainer), max_norm)
    else:
        raise TypeError('clip_global_norm: expected a gluon.Trainer or an mx.mod.Module, '
                        'not %s' % type(trainer).__name__)
    return trainer


def _wrap(owner, method, keys, max_norm):
    """``owner.method`` tells the store the step's keys, then runs as before. Trainer.step
    calls _allreduce_grads, Module.fit calls update, after the store was set up."""
    original = getattr(owner, method)

    def clipped(*args, **kwargs):
        store = owner._kvstore
        if store is None or not owner._update_on_kvstore \
                or not hasattr(store, 'clip_global_norm'):
            raise ValueError('clip_global_norm clips inside an mpi_kvstore store that runs '
                             'the optimizer (update_on_kvstore=True); this %s has kvstore=%r, '
                             'update_on_kvstore=%r: clip the summed gradients yourself before '
                             'the update instead' % (type(owner).__name__, store,
                                                      owner._update_on_kvstore))
        store.clip_global_norm(max_norm, keys())
        return original(*args, **kwargs)

    setattr(owner, method, clipped)


def _gluon_keys(trainer):
    """Trainer._allreduce_grads pushes parameter i as key i, unless its grad_req is null."""
    return [i for i, param in enumerate(trainer._params) if param.grad_req != 'null']


def _module_keys(module):
    """Module.update pushes each parameter by name, unless it has no gradient."""
    group = module._exec_group
    return [name for name, grads in zip(group.param_names, group.grad_arrays)
            if grads and grads[0] is not None]
