"""The store's optimizer updater: MXNet's own (``mx.optimizer.Updater``), whose call with a
list of keys (a step's batch, store.keys.KeyTable.flush) runs MXNet's SGD the way MXNet
runs it, with each group's arguments kept from one step to the next.

MXNet's Updater, called with lists, splits the keys by dtype and runs the optimizer on
``aggregate_num`` keys at a time (``MXNET_OPTIMIZER_AGGREGATION_SIZE``, 4 by default for
SGD): SGD pushes one ``multi_sgd_update`` (``multi_sgd_mom_update`` with momentum) a
group. For 200 small keys most of that step is Python: per key a state check, a dtype
and two storage-type queries (C calls), the lists zipped and flattened; per group the
operator wrapper's checks and a ctypes array of every handle. :class:`Updater` makes the
groups once, with their handle arrays, and from then on only asks the optimizer for each
group's counts, learning rates and weight decays (``_update_count``, ``_get_lrs``,
``_get_wds``, as MXNet's SGD does, in its order) and pushes the very operator with the
very parameter strings MXNet's wrapper would give: the same weights, bitwise.

It applies to MXNet's own ``SGD`` (not a subclass, which may update otherwise) with
``aggregate_num`` >= 1, dense NDArrays whose states exist (MXNet's Updater makes them at
a key's first update), and no float16 master weights (``multi_precision``); anything
else, or a call whose keys, arrays, states or optimizer are not the ones the groups were
made of, goes through MXNet's Updater (and the next such call makes the groups anew).
"""
import ctypes
import operator

import mxnet as mx
import numpy as np
from mxnet.base import _LIB, NDArrayHandle, OpHandle, c_handle_array, c_str_array, check_call

__all__ = ['Updater']

_OPS = {}   # operator name: its handle


def _op(name):
    handle = _OPS.get(name)
    if handle is None:
        handle = OpHandle()
        check_call(_LIB.NNGetOpHandle(name.encode(), ctypes.byref(handle)))
        _OPS[name] = handle
    return handle


class _Group:
    """One operator's keys (of one dtype, at most aggregate_num), its inputs' and outputs'
    handle arrays (whose NDArrays the plan holds, so that the handles stay theirs)."""

    __slots__ = ('indices', 'inputs', 'count', 'outputs', 'nout')

    def __init__(self, indices, inputs, outputs):
        self.indices = indices
        self.inputs, self.count = c_handle_array(inputs), len(inputs)
        self.outputs = ctypes.cast(c_handle_array(outputs), ctypes.POINTER(NDArrayHandle))
        self.nout = len(outputs)


class _Plan:
    """The groups of one list of keys, and what they were made of (:meth:`fits`)."""

    def __init__(self, updater, keys, grads, weights, momentum):
        opt = updater.optimizer
        self.optimizer, self.aggregate = opt, opt.aggregate_num
        self.momentum, self.states = momentum, updater.states
        self.keys, self.grads, self.weights = tuple(keys), tuple(grads), tuple(weights)
        self.state_arrays = tuple(updater.states[key] for key in keys)
        self.device = weights[0].context.device_id
        self.op = _op('multi_sgd_mom_update' if momentum else 'multi_sgd_update')
        by_dtype = {}   # MXNet's Updater: by dtype, in order of first appearance
        for i, weight in enumerate(weights):
            by_dtype.setdefault(weight.dtype, []).append(i)
        self.groups = []
        for rows in by_dtype.values():
            for start in range(0, len(rows), self.aggregate):
                part = rows[start:start + self.aggregate]
                inputs = []
                for i in part:
                    inputs += ((weights[i], grads[i], self.state_arrays[i]) if momentum
                               else (weights[i], grads[i]))
                self.groups.append(_Group(tuple(self.keys[i] for i in part), inputs,
                                          [weights[i] for i in part]))

    def fits(self, updater, keys, grads, weights):
        """Whether a call of ``keys``, ``grads`` and ``weights`` is the one planned: the same
        optimizer and settings, the very arrays, states and state table."""
        opt, states = updater.optimizer, updater.states
        return (opt is self.optimizer and opt.aggregate_num == self.aggregate
                and (opt.momentum > 0) == self.momentum and not opt.multi_precision
                and states is self.states and len(keys) == len(self.keys)
                and all(map(operator.eq, keys, self.keys))
                and all(map(operator.is_, grads, self.grads))
                and all(map(operator.is_, weights, self.weights))
                and all(map(operator.is_, map(states.get, self.keys), self.state_arrays))
                and all(map(updater.states_synced.get, self.keys)))

    def run(self):
        """Each group's operator, as MXNet's SGD._update_impl pushes it."""
        opt = self.optimizer
        opt._set_current_context(self.device)
        tail = [('rescale_grad', opt.rescale_grad)]
        if self.momentum:
            tail.append(('momentum', opt.momentum))
        if opt.clip_gradient:
            tail.append(('clip_gradient', opt.clip_gradient))
        names = c_str_array(['num_weights', 'lrs', 'wds'] + [name for name, _ in tail])
        nkeys = ctypes.c_int(3 + len(tail))
        values = [str(value) for _, value in tail]
        stypes = ctypes.POINTER(ctypes.c_int)()
        for group in self.groups:
            indices = group.indices
            opt._update_count(indices)
            lrs, wds = opt._get_lrs(indices), opt._get_wds(indices)
            nout = ctypes.c_int(group.nout)
            check_call(_LIB.MXImperativeInvokeEx(
                self.op, ctypes.c_int(group.count), group.inputs, ctypes.byref(nout),
                ctypes.byref(group.outputs), nkeys, names,
                c_str_array([str(group.nout), str(lrs), str(wds)] + values),
                ctypes.byref(stypes)))


def _plannable(updater, keys, grads, weights):
    """Whether :class:`_Plan` runs this call as MXNet's Updater would (see the module)."""
    opt = updater.optimizer
    if (type(opt) is not mx.optimizer.SGD or not updater.aggregate_updates
            or opt.aggregate_num < 1 or opt.multi_precision or not keys
            or len(keys) != len(grads) or len(keys) != len(weights)
            or len(set(keys)) != len(keys)):
        return False
    states, synced = updater.states, updater.states_synced
    for key, grad, weight in zip(keys, grads, weights):
        # an exact NDArray is dense (sparse ones are its subclasses) and not mx.np's
        if (type(key) not in (int, str) or type(grad) is not mx.nd.NDArray
                or type(weight) is not mx.nd.NDArray or key not in states
                or not synced.get(key)):
            return False
        if opt.momentum > 0 and type(states[key]) is not mx.nd.NDArray:
            return False
    contexts = {weight.context for weight in weights}
    return len(contexts) == 1 and all(grad.context in contexts for grad in grads) \
        and all(np.dtype(g.dtype) == np.dtype(w.dtype) for g, w in zip(grads, weights))


class Updater(mx.optimizer.Updater):
    """``mx.optimizer.Updater``, whose call with lists of keys runs MXNet's SGD from kept
    groups where it can (see the module). ``planned``: the calls that did."""

    def __init__(self, optimizer):
        super().__init__(optimizer)
        self._plan = None
        self.planned = 0

    def __call__(self, index, grad, weight):
        if isinstance(index, (list, tuple)) and self._planned(index, grad, weight):
            return
        super().__call__(index, grad, weight)

    def _planned(self, keys, grads, weights):
        plan = self._plan
        if plan is None or not plan.fits(self, keys, grads, weights):
            self._plan = None
            if not _plannable(self, keys, grads, weights):
                return False
            plan = self._plan = _Plan(self, keys, grads, weights, self.optimizer.momentum > 0)
        plan.run()
        self.planned += 1
        return True

    def __getstate__(self):
        state = dict(self.__dict__)
        state['_plan'] = None   # ctypes arrays: made again at the next call
        return state
