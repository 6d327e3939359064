"""What a commit copies: the parameters' values, the optimizer states' bytes, and the random
states, taken from and given back to a gluon ParameterDict (or Block), a Module, or a dict of
NDArrays and their trainer; and the parameters' poisoning after a lost world."""
from __future__ import annotations

import logging
import os
import random
import tempfile
from typing import Any

import mxnet as mx
import numpy as np

from ..comm.poison import poison_value
from ..engine import core as engine
from ..engine.arrays import array_pointer, host_view

__all__ = ['Params', 'optimizer_states', 'load_optimizer_states', 'random_states',
           'set_random_states']

log = logging.getLogger(__name__)


class Params:
    """The parameters as a list of (name, NDArray): a gluon ParameterDict (or a Block), a
    Module, or a dict of NDArrays."""

    def __init__(self, params: Any) -> None:
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

    def _every_copy(self):
        """[(name, NDArray)]: every device's copy of each value: a Module's in its executors
        (which its store's pulls write) and the host copies its get_params returns."""
        if self.module is not None:
            return _module_copies(self.module)
        if isinstance(self.params, dict):
            return sorted(self.params.items())
        found = []
        for name, param in self.params.items():
            try:
                found.extend((name, array) for array in param.list_data())
            except RuntimeError:   # not initialised yet: it holds no value
                continue
        return found

    def poison(self, why: str) -> None:
        """After every op already pushed on each parameter (one that failed too), fill it
        with NaN (its dtype's poison value) and fail: its next read raises, naming ``why``,
        and later ones see NaN, never the value it had."""
        for name, array in self._every_copy():
            _poison(array, 'mpi_kvstore: %s was not updated: %s' % (name, why))

    def values(self) -> list[tuple[str, np.ndarray]]:
        """[(name, numpy array)] in a fixed order: copies, which later steps leave alone."""
        return [(name, array.asnumpy()) for name, array in self._arrays()]

    def assign(self, saved: list[tuple[str, np.ndarray]]) -> None:
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
            # into the arrays, not set_data: that would reset a trainer whose store holds the
            # weights (State gives them to the store itself, by the trainer's broadcast)
            for param, (_, value) in zip(self.params.values(), saved):
                for array in param.list_data():
                    array[:] = mx.nd.array(value, ctx=array.context, dtype=value.dtype)


def _module_copies(module):
    if not (module.binded and module.params_initialized):
        return []
    group = module._exec_group
    found = [(name, array) for name, arrays in zip(group.param_names, group.param_arrays)
             for array in arrays]
    # get_params copies the executors' values here, then hands these out until the next
    # update: a read of them after the failed step must fail too
    return found + sorted(module._arg_params.items())


def _poison(array, message):
    host = array.context.device_type in ('cpu', 'cpu_pinned', 'cpu_shared')
    dtype = np.dtype(array.dtype)

    def run(completion):
        try:
            if host and array.size:
                address = array_pointer(array)[0]
                host_view(address, array.size * dtype.itemsize, dtype).fill(
                    poison_value(dtype))
        except Exception:   # a device array, an MKLDNN layout, a bool: the read fails anyway
            log.debug('mpi_kvstore elastic: %s not filled', message, exc_info=True)
        completion.done(message)
    engine.push(run, mutable=[array], name='mpi_kvstore_lost_world', always=True)


def _saver(trainer, module):
    if trainer is not None:
        if not getattr(trainer, '_kv_initialized', True):
            return None   # no step yet: its optimizer has no states to copy
        return trainer.save_states
    if module is not None and module.optimizer_initialized:
        return module.save_optimizer_states
    return None


def optimizer_states(trainer: Any, module: Any) -> bytes | None:
    """The optimizer states' bytes in MXNet's format, or None where the optimizer has none
    yet (collective for a sharded store: every rank calls it)."""
    saver = _saver(trainer, module)
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


def load_optimizer_states(trainer: Any, module: Any, data: bytes) -> None:
    """Give the trainer (or the Module's optimizer) the states ``data`` holds."""
    fd, path = tempfile.mkstemp(prefix='mpi_kvstore_states_')
    try:
        with os.fdopen(fd, 'wb') as fh:
            fh.write(data)
        if trainer is not None:
            trainer.load_states(path)
        elif module is not None and module.optimizer_initialized:
            module.load_optimizer_states(path)
        else:
            log.warning('mpi_kvstore elastic: the commit holds optimizer states, but this '
                        'State has no trainer and no initialised Module to load them into')
    finally:
        os.unlink(path)


def random_states() -> tuple[Any, Any]:
    """This process's Python and numpy random states."""
    return random.getstate(), np.random.get_state()


def set_random_states(states: tuple[Any, Any]) -> None:
    random.setstate(states[0])
    np.random.set_state(states[1])
