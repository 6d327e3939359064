"""The store's optimizer updater: MXNet's own (``mx.optimizer.Updater``), whose call with a
list of keys (a step's batch, store.keys.KeyTable.flush) runs MXNet's SGD the way MXNet
runs it, with each group's arguments kept from one step to the next.

MXNet's Updater, called with lists, splits the keys by dtype and runs the optimizer on
``aggregate_num`` keys at a time (``MXNET_OPTIMIZER_AGGREGATION_SIZE``, 4 by default for
SGD): SGD pushes one ``multi_sgd_update`` (``multi_sgd_mom_update`` with momentum) a
group. For 200 small keys most of that step is Python: per key a state check, a dtype
and two storage-type queries (C calls), the lists zipped and flattened; per group the
operator wrapper's checks and a ctypes array of every handle. :class:`Updater` makes the
groups once, with their handle arrays, and from then on only asks the optimizer for the
counts, learning rates and weight decays (``_update_count``, ``_get_lrs``, ``_get_wds``,
as MXNet's SGD does) and pushes the very operator with the very parameter strings MXNet's
wrapper would give: the same weights, bitwise.

One operator takes a dtype's keys in MXNet's order, up to the operator's own limit of 60
weights (MXNet's kernel parameter; the documented maximum of
MXNET_OPTIMIZER_AGGREGATION_SIZE): the kernel updates each element of each weight alone,
so the weights are those of an operator a group of MXNet's, and a step of 200 keys is 4
operators instead of 50 (the updater's CPU 1.2 -> 0.55 ms a step; MXNet's Updater: 2.9
ms). The counts and rates are asked for as MXNet asks, a group at a time, where a
learning-rate schedule reads the update count between groups; without one, once for all
the keys (the same counts and rates), and an operator's parameter strings are made again
only when its rates change.

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

__all__ = ['Updater', 'StepCalls']

_OPS = {}   # operator name: its handle


def _op(name):
    handle = _OPS.get(name)
    if handle is None:
        handle = OpHandle()
        check_call(_LIB.NNGetOpHandle(name.encode(), ctypes.byref(handle)))
        _OPS[name] = handle
    return handle


# The most weights one multi_sgd(_mom)_update takes (MXNet's MultiSGDKernelParam::N; more
# overruns its fixed arrays).
KERNEL_WEIGHTS = 60


class _Group:
    """One operator's keys (of one dtype, consecutive in MXNet's order, at most
    KERNEL_WEIGHTS), its inputs' and outputs' handle arrays (whose NDArrays
    the plan holds, so that the handles stay theirs), its slice of the plan's order, and its
    last parameter strings with the rates they were made of."""

    __slots__ = ('indices', 'inputs', 'count', 'outputs', 'nout', 'span', 'rates', 'strings')

    def __init__(self, indices, inputs, outputs, start):
        self.indices = indices
        self.inputs, self.count = c_handle_array(inputs), len(inputs)
        self.outputs = ctypes.cast(c_handle_array(outputs), ctypes.POINTER(NDArrayHandle))
        self.nout = len(outputs)
        self.span = slice(start, start + len(indices))
        self.rates = self.strings = None


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
        # MXNet's groups (the keys of one of its operators), in its order; each dtype's
        # keys in that order, KERNEL_WEIGHTS an operator (elementwise: any cut gives the
        # same weights, and none overruns the kernel, even where MXNet's groups would)
        self.parts = []
        runs = []
        for rows in by_dtype.values():
            for start in range(0, len(rows), self.aggregate):
                self.parts.append(tuple(self.keys[i] for i in rows[start:start + self.aggregate]))
            runs += [rows[start:start + KERNEL_WEIGHTS]
                     for start in range(0, len(rows), KERNEL_WEIGHTS)]
        self.order = tuple(key for part in self.parts for key in part)
        self.groups, start = [], 0
        for rows in runs:
            inputs = []
            for i in rows:
                inputs += ((weights[i], grads[i], self.state_arrays[i]) if momentum
                           else (weights[i], grads[i]))
            self.groups.append(_Group(tuple(self.keys[i] for i in rows), inputs,
                                      [weights[i] for i in rows], start))
            start += len(rows)

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

    def _rates(self, opt):
        """The counts updated, and the learning rates and weight decays of self.order: as
        MXNet's SGD asks, a group at a time, where a schedule reads the count between groups
        (num_update, the largest count, may grow from one group to the next); else once."""
        if opt.lr_scheduler is None:
            opt._update_count(self.order)
            return opt._get_lrs(self.order), opt._get_wds(self.order)
        lrs, wds = [], []
        for part in self.parts:
            opt._update_count(part)
            lrs += opt._get_lrs(part)
            wds += opt._get_wds(part)
        return lrs, wds

    def run(self):
        """The groups' operators, with the parameters MXNet's SGD._update_impl gives each of
        its own groups."""
        opt = self.optimizer
        opt._set_current_context(self.device)
        tail = [('rescale_grad', opt.rescale_grad)]
        if self.momentum:
            tail.append(('momentum', opt.momentum))
        if opt.clip_gradient:
            tail.append(('clip_gradient', opt.clip_gradient))
        names = c_str_array(['num_weights', 'lrs', 'wds'] + [name for name, _ in tail])
        nkeys = ctypes.c_int(3 + len(tail))
        values = [value for _, value in tail]
        lrs, wds = self._rates(opt)
        stypes = ctypes.POINTER(ctypes.c_int)()
        for group in self.groups:
            rates = (lrs[group.span], wds[group.span], values)
            if rates != group.rates:
                group.rates = rates
                group.strings = c_str_array([str(group.nout), str(rates[0]), str(rates[1])]
                                            + [str(value) for value in values])
            nout = ctypes.c_int(group.nout)
            check_call(_LIB.MXImperativeInvokeEx(
                self.op, ctypes.c_int(group.count), group.inputs, ctypes.byref(nout),
                ctypes.byref(group.outputs), nkeys, names, group.strings,
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


class StepCalls:
    """A DistributedTrainer's step of pushpulls (keys, gradient lists, priority), made
    again (by ``make``) only where a gradient array, the keys or the trainer's grouping
    ``setting`` is not the last step's: sizing 200 gradients by their shapes and dtypes is
    C calls each (0.4 ms a step), checking them by identity is not. One for both trainers
    (mpi_kvstore.gluon's, keyed by group_bytes, and horovod.training's, by num_groups)."""

    __slots__ = ('_made',)

    def __init__(self):
        self._made = None   # (setting, the gradient arrays, the keys, the calls) of the last

    def get(self, setting, entries, make):
        """The calls of ``entries`` ((key, gradient list), in the step's order)."""
        made = self._made
        arrays = [grad for _, grads in entries for grad in grads]
        keys = [key for key, _ in entries]
        if (made is not None and made[0] == setting and len(made[1]) == len(arrays)
                and all(map(operator.is_, arrays, made[1])) and keys == made[2]):
            return made[3]
        calls = make(entries)
        self._made = (setting, arrays, keys, calls)
        return calls
