"""The sharded optimizer's states (shard_optimizer): each rank keeps the state of its
share of every sharded key (fusion.share of the flattened key), and the states travel
in MXNet's own format, whole.

An optimizer state is what ``Optimizer.create_state_multi_precision`` made: an NDArray,
None, or tuples and lists of them (SGD's momentum; Adam's mean and variance; with
multi_precision, the float32 master weights and the state). Every NDArray in it has the
weight's number of elements, so a state of the whole key and a state of one share are
told apart by their size.

- Saving gathers the shares into whole states (:func:`gather`): the file is the one an
  unsharded store writes, and loads into a store of any number of ranks, sharded or not.
- Loading keeps whole states, and :func:`fit` cuts a key's state to this rank's share at
  the key's first sharded update, so a file may be loaded before the keys are known.
- A rank that joined still owns its shares (:class:`JoinedShares`).
"""
import logging
import threading

import mxnet as mx
import numpy as np

from ..comm.fusion import share
from ..comm.poison import poison
from ..engine.arrays import flat_view

__all__ = ['refuse', 'fit', 'gather', 'check_sizes', 'needs_norms', 'leaves', 'LambShare',
           'ClipStep', 'check_max_norm', 'JoinedShares']

log = logging.getLogger(__name__)

# Optimizers whose update of one weight reads norms over the whole weight (layer-wise
# trust ratios): a share's norm is not the weight's. LAMB's are summed over the ranks
# (LambShare); these have no sharded update.
_WHOLE_WEIGHT = ('LARS', 'LANS')


def refuse(optimizer):
    """Why the store cannot shard ``optimizer``'s update (None when it can)."""
    name = type(optimizer).__name__
    if name in _WHOLE_WEIGHT:
        return ('shard_optimizer: %s scales each weight\'s update by norms over the whole '
                'weight, which the store computes over shares only for LAMB; use '
                'shard_optimizer=0 with %s, or LAMB, or an elementwise optimizer (SGD, NAG, '
                'Adam, RMSProp, AdaGrad, ...)' % (name, name))
    return None


def needs_norms(optimizer):
    """The sharded update of ``optimizer`` needs the whole weight's norms (LambShare)."""
    return type(optimizer).__name__ == 'LAMB'


def check_max_norm(max_norm):
    """Raise ValueError unless ``max_norm`` is a finite number > 0 (clip_global_norm's)."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float, np.floating)) \
            or not np.isfinite(max_norm) or max_norm <= 0:
        raise ValueError('clip_global_norm: max_norm must be a finite number > 0, not %r'
                         % (max_norm,))


class ClipStep:
    """One training step whose summed gradient is clipped by its global norm before the
    store's optimizer runs (MPIKVStore.clip_global_norm): the calls that push each of
    ``keys`` once. Their collectives go out as each call comes; the updates (and, sharded,
    the weights' allgathers) wait for the last key, because the norm is over every key.

    The norm is the one of the gradient the optimizer applies, ``rescale_grad`` times the
    sum: the square root of the sum of every key's squares, a sharded key's as its shares'
    squares summed over the ranks (one 1-element allreduce a step). Every gradient is then
    scaled by min(1, max_norm / (norm + 1e-8)), as gluon.utils.clip_global_norm scales."""

    EPSILON = 1e-8

    def __init__(self, max_norm, keys):
        self.max_norm = max_norm
        self.keys = list(keys)
        self._left = set(self.keys)
        self.calls = []          # [(plans, priority)] in call order

    def check(self, keys):
        """Raise ValueError, before anything is sent, where a call pushes a key that is not
        in the step or that the step already had."""
        seen = set()
        for key in keys:
            if key not in self._left or key in seen:
                why = ('is not one of its keys' if key not in set(self.keys)
                       else 'was already pushed in it')
                raise ValueError('clip_global_norm: key %r %s (the step\'s keys: %s; still '
                                 'to push: %s)' % (key, why, _shown(self.keys),
                                                   _shown(sorted(self._left, key=str))))
            seen.add(key)

    def add(self, plans, priority):
        """A call's plans, after their collectives went out; True when the step is whole."""
        self.calls.append((plans, priority))
        self._left.difference_update(plan.state.key for plan in plans)
        return not self._left

    @property
    def waiting(self):
        return sorted(self._left, key=str)

    def squares(self):
        """(sharded, whole): float32 1-element NDArrays of the squared norms of this rank's
        shares of the sharded keys (to be summed over the ranks) and of the whole keys'
        gradients (the same on every rank); None for a kind the step lacks."""
        parts = {True: [], False: []}
        for plans, _ in self.calls:
            for plan in plans:
                grad = plan.views[0].astype('float32', copy=False)
                parts[plan.share is not None].append(mx.nd.sum(mx.nd.square(grad)).reshape((1,)))
        return tuple(mx.nd.add_n(*parts[kind]) if parts[kind] else None
                     for kind in (True, False))

    def scale(self, total, rescale_grad):
        """Scale every gradient by min(1, max_norm / norm), ``total`` being the summed
        squares (engine ops: nothing waits here)."""
        norm = mx.nd.sqrt(total) * abs(rescale_grad)
        factor = mx.nd.minimum(self.max_norm / (norm + self.EPSILON), mx.nd.ones((1,)))
        for plans, _ in self.calls:
            for plan in plans:
                grad = plan.views[0]
                mx.nd.broadcast_mul(grad, factor.astype(grad.dtype, copy=False), out=grad)


def _shown(keys, most=8):
    keys = list(keys)
    text = ', '.join(repr(k) for k in keys[:most])
    return text + (', ... (%d in all)' % len(keys) if len(keys) > most else '')


class LambShare:
    """MXNet's LAMB update (optimizer.LAMB, one weight at a time) of this rank's share:
    phase 1 as MXNet runs it, then the norms of the weight and of the update over the
    whole weight, as the square root of the shares' squared norms summed over the ranks
    (``squares``, a 2-element array the store allreduces), then phase 2 with them.

    ``LambShare(updater, key, weight, grad)`` queues phase 1 and the squares; the caller
    allreduces ``squares`` and calls :meth:`finish`.
    """

    def __init__(self, updater, key, weight, grad):
        opt = updater.optimizer
        if key not in updater.states:
            updater.states[key] = opt.create_state_multi_precision(key, weight)
            updater.states_synced[key] = True
        elif not updater.states_synced.get(key, True):
            updater.states[key] = updater.sync_state_context(updater.states[key],
                                                             weight.context)
            updater.states_synced[key] = True
        state = updater.states[key]
        self._mp = opt.multi_precision and weight.dtype == np.float16
        opt._update_count(key)
        self._lr, wd = opt._get_lr(key), opt._get_wd(key)
        kwargs = {'beta1': opt.beta1, 'beta2': opt.beta2, 'epsilon': opt.epsilon,
                  'bias_correction': opt.bias_correction, 'rescale_grad': opt.rescale_grad,
                  't': opt._index_update_count[key], 'wd': wd}
        if opt.clip_gradient:
            kwargs['clip_gradient'] = opt.clip_gradient
        self._bounds = {name: getattr(opt, name) for name in ('lower_bound', 'upper_bound')
                        if getattr(opt, name)}
        self._weight = weight
        if self._mp:
            self._weight32 = state[0]
            mean, var = state[1]
            self._g = mx.nd.mp_lamb_update_phase1(weight, grad, mean, var, self._weight32,
                                                  **kwargs)
            measured = self._weight32
        else:
            mean, var = state
            self._g = mx.nd.lamb_update_phase1(weight, grad, mean, var, **kwargs)
            measured = weight
        self.squares = mx.nd.concat(mx.nd.sum(mx.nd.square(measured.astype('float32')))
                                    .reshape((1,)),
                                    mx.nd.sum(mx.nd.square(self._g.astype('float32')))
                                    .reshape((1,)), dim=0)

    def finish(self):
        """Phase 2 with the whole weight's norms (after ``squares`` was summed over ranks)."""
        norms = mx.nd.sqrt(self.squares)
        r_1, r_2 = norms[0:1], norms[1:2]
        if self._mp:
            # MXNet 1.9.1's mp_lamb_update_phase2 writes the float16 weight but leaves the
            # float32 master weights as they were (its multi-tensor LAMB, which Updater runs,
            # updates both): update the master weights, then cast them into the weight.
            mx.nd.lamb_update_phase2(self._weight32, self._g, r_1, r_2, lr=self._lr,
                                     out=self._weight32, **self._bounds)
            mx.nd.cast(self._weight32, dtype=self._weight.dtype, out=self._weight)
        else:
            mx.nd.lamb_update_phase2(self._weight, self._g, r_1, r_2, lr=self._lr,
                                     out=self._weight, **self._bounds)


def leaves(state):
    """The NDArrays of an optimizer state, in order (tuples and lists walked, None skipped)."""
    if isinstance(state, mx.nd.NDArray):
        return [state]
    if isinstance(state, (tuple, list)):
        return [leaf for item in state for leaf in leaves(item)]
    return []


def _rebuild(state, leaves):
    """``state`` with its NDArrays replaced, in order, by the next of ``leaves`` (an
    iterator)."""
    if isinstance(state, mx.nd.NDArray):
        return next(leaves)
    if isinstance(state, (tuple, list)):
        return type(state)(_rebuild(item, leaves) for item in state)
    return state


def check_sizes(key, state, count, bounds):
    """Raise unless every array of ``state`` holds the whole key (``count`` elements) or
    this rank's share of it (``bounds``, None when unsharded)."""
    sizes = {count} if bounds is None else {count, bounds[1] - bounds[0]}
    for leaf in leaves(state):
        if leaf.size not in sizes:
            raise ValueError(
                'optimizer state of key %r has an array of %d elements, but the key has %d '
                '(the state file is from another model, or from other parameters)'
                % (key, leaf.size, count))


def fit(key, state, count, bounds):
    """``state`` cut to this rank's share ``bounds`` of a key of ``count`` elements: the
    whole-key arrays a loaded file holds are sliced (copies), shares kept as they are."""
    check_sizes(key, state, count, bounds)
    start, stop = bounds
    if stop - start == count:
        return state
    cut = (leaf.reshape((-1,))[start:stop].copy() if leaf.size == count else leaf
           for leaf in leaves(state))
    return _rebuild(state, cut)


def gather(states, sharded, size, rank, allgather):
    """Whole states of every key from every rank's shares (a collective: every rank calls it).

    ``states``: the updater's {key: state}; ``sharded``: {key: (shape, count)} of the keys
    whose updates are sharded; ``allgather(obj)``: every rank's ``obj``, in rank order.
    """
    mine = {}
    for key in sharded:
        if key in states:
            shape, count = sharded[key]
            bounds = share(count, size, rank)
            fitted = fit(key, states[key], count, bounds)
            mine[key] = [leaf.asnumpy() for leaf in leaves(fitted)]
    everyone = allgather(mine)
    if any(set(theirs) != set(mine) for theirs in everyone):
        raise ValueError('ranks hold optimizer states of different keys: every rank must '
                         'push the same keys before saving the sharded optimizer\'s states')
    whole = dict(states)
    for key, arrays in mine.items():
        shape = sharded[key][0]
        ctx = [leaf.context for leaf in leaves(states[key])]
        joined = (mx.nd.array(np.concatenate([theirs[key][i] for theirs in everyone])
                              .reshape(shape), ctx=ctx[i], dtype=arrays[i].dtype)
                  for i in range(len(arrays)))
        whole[key] = _rebuild(states[key], joined)
    return whole


class JoinedShares:
    """A joined rank's part in the sharded optimizer (store.join). No other rank updates
    its share of a key, so it goes on doing so while the others train: the mirror of their
    reduce-scatter leaves the active ranks' gradient sum of the share in the mirror's
    buffer; this rank updates its share of its copy of the weights with it, as the store's
    pushpull does; and the mirror of their weights' allgather sends that share from its
    copy and brings theirs into it.

    The order is the active ranks' engine's: a key's update follows its reduce-scatter and
    the previous allgather of the key (which wrote the weights), and its allgather follows
    the update. Here the mirrors complete on the design's threads (a lane each in the
    concurrent design), and the next step's reduce-scatter may be agreed before this
    step's allgather, so the updates run in issue order when the allgather that sends them
    is taken: it waits for the reduce-scatters issued before it (not later ones) and for
    the key's previous allgather. These waits end: the active ranks issued the allgather after their own
    update, so those collectives already ran on every rank.

    ``find(key)`` -> (weights, (start, stop), updater) of a key this rank shards, else None.
    """

    def __init__(self, find):
        self._find = find
        self._keys = {}   # key: _KeyOrder

    def take(self, req):
        """Point the mirror ``req`` (join.mirror, on the design's thread) at this rank's part
        in it."""
        found = self._find(req.key)
        if found is None:
            # a key this rank never held: it has no share to give, and zeros would read as
            # weights; the poison does not (the active ranks' weights show it)
            log.error('joined rank: %s is of a key this rank does not shard; its share is '
                      'poisoned', req.describe())
            if req.kind == 'allgather':
                poison(req.view)
            return
        order = self._keys.setdefault(req.key, _KeyOrder(*found))
        if req.kind == 'allgather':
            order.before_allgather(req)
        else:
            order.reduced.append(_Done(req))


class _Done:
    """A mirror's completion (collective.Collective.complete calls done): an event."""

    def __init__(self, req):
        self.req, self.error, self.event = req, None, threading.Event()
        req.complete_with(self)

    def done(self, err):
        self.error = err
        self.event.set()


class _KeyOrder:
    """One key's reduce-scatters not yet applied, and its last allgather."""

    def __init__(self, weights, bounds, updater):
        self.weights, self.bounds, self.updater = weights, bounds, updater
        self.reduced = []
        self.gathered = None

    def before_allgather(self, req):
        if self.gathered is not None:   # it wrote the weights the update reads
            self.gathered.event.wait()
        start, stop = self.bounds
        weight = self.weights.reshape((-1,))[start:stop]
        due = [rs for rs in self.reduced if rs.req.seq < req.seq]
        self.reduced = [rs for rs in self.reduced if rs.req.seq > req.seq]
        for rs in due:
            rs.event.wait()
            if rs.error is not None:   # the active ranks' step fails with it
                log.error('joined rank: no update of %s: %s', rs.req.describe(), rs.error)
            elif not needs_norms(self.updater.optimizer):   # join.refusal fails LAMB's step
                grad = mx.nd.array(rs.req.view[start:stop], dtype=rs.req.dtype)
                self.updater(rs.req.key, grad, weight)
        self.weights.wait_to_read()
        req.attach(flat_view(self.weights, req.nbytes, req.dtype))
        self.gathered = _Done(req)
