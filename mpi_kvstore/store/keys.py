"""The store's per-key data path: what it knows of each key, and how a value
reaches the collective and its result reaches the outputs.

Nothing here changes state before :meth:`KeyTable.validate` accepted the whole
call, so a rejected call leaves the store as it was.
"""
import mxnet as mx
import numpy as np

from .. import compression, debug
from ..comm.collective import Collective, place_of, signature
from ..comm.fusion import share
from ..engine.arrays import storage_of
from ..errors import UnknownKeyError

__all__ = ['KeyState', 'KeyTable', 'Plan', 'same_array', 'request', 'fill', 'note_weights']


def same_array(a, b):
    return a is b or a.handle.value == b.handle.value


def _reduce_into(values, target):
    """Sum per-device values into ``target`` with MXNet operators (which handle layouts)."""
    if len(values) == 1:
        values[0].copyto(target)
    else:
        mx.nd.add_n(*[v.as_in_context(target.context) for v in values], out=target)


class KeyState:
    """One key: its shape and dtype (fixed by its first use), and its stored value.

    ``value`` is None until an init, push or broadcast gives the key one: a plain
    pushpull (an allreduce) defines the key's shape but stores nothing.
    """

    __slots__ = ('key', 'shape', 'dtype', 'ctx', 'nbytes', 'value', 'weights', '_staging',
                 '_sigs')

    def __init__(self, entry):
        self.key, self.shape, self.dtype = entry.key, entry.shape, entry.dtype
        self.ctx = entry.values[0].context
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        self.value = None
        # The arrays the store last wrote this key's value into (broadcast, pull, or
        # the optimizer's pushpull): Trainer's and Module's weights. join() syncs them.
        self.weights = ()
        self._staging = None
        self._sigs = {}

    @property
    def count(self):
        """Elements of the key."""
        return self.nbytes // self.dtype.itemsize

    def stored(self):
        """The stored value, allocated on first use."""
        if self.value is None:
            self.value = mx.nd.zeros(self.shape, ctx=self.ctx, dtype=self.dtype)
        return self.value

    def staging(self):
        if self._staging is None:
            self._staging = mx.nd.zeros(self.shape, ctx=self.ctx, dtype=self.dtype)
        return self._staging

    def signature(self, kind, root, place='cpu'):
        sig = self._sigs.get((kind, root, place))
        if sig is None:
            sig = self._sigs[(kind, root, place)] = signature(kind, self.key, self.dtype,
                                                              self.shape, root, place)
        return sig


def _check_once(entries, writes_values, in_place=False):
    keys, written, storage = set(), {}, {}
    for entry in entries:
        if entry.key in keys:
            raise ValueError('key %r appears more than once in one call; give each key once '
                             '(sum its values first, or make separate calls)' % (entry.key,))
        keys.add(entry.key)
        targets = entry.outs if entry.outs is not None else (
            entry.values if writes_values else ())
        for arr in targets:
            other = written.setdefault(arr.handle.value, entry.key)
            if other != entry.key:
                raise ValueError('the same array is an output of keys %r and %r in one call; '
                                 'give each key its own array' % (other, entry.key))
            if sum(same_array(arr, t) for t in targets) > 1:
                raise ValueError('the same array is given twice as an output of key %r'
                                 % (entry.key,))
        if in_place and len(entry.values) == 1 and all(same_array(t, entry.values[0])
                                                       for t in targets):
            # reduced where it is, in the call's one engine op, which must not list one
            # engine variable twice (it would wait for itself and never run)
            found = storage_of(entry.values[0])
            other = storage.setdefault(found, entry.key) if found is not None else entry.key
            if other != entry.key:
                raise ValueError('the arrays of keys %r and %r in one call share memory (one '
                                 'is a view of the other, or both of one array): make '
                                 'separate calls, or give each key an array of its own'
                                 % (other, entry.key))


def _no_value(call, key):
    return UnknownKeyError('%s: key %r has no value in the store: it has not been initialised; '
                           'call init() or broadcast() for it on every rank first (pushpull '
                           'alone stores nothing, and needs no init)' % (call, key))


def _conflict(entry, shape, dtype, what, since):
    return ValueError('%s for key %r has shape %s and dtype %s, but the key has shape %s and '
                      'dtype %s (%s)' % (what, entry.key, entry.shape, entry.dtype.name,
                                         shape, dtype.name, since))


class KeyTable:
    """Every key the store has seen, and the data path of push, pushpull and pull."""

    def __init__(self, config, rank=0, size=1):
        self._config = config
        self._rank, self._size = rank, size
        self._keys = {}
        self._updater = None
        self._held = []   # plans whose update waits for a batch (hold, flush)
        self._held_keys = set()

    @property
    def updater(self):
        """The store's optimizer updater (mx.optimizer.Updater), or None: push and pushpull
        apply it to the sums. Set only by :meth:`set_updater` (set_optimizer)."""
        return self._updater

    def set_updater(self, updater):
        """set_optimizer's updater, from the next push on."""
        self._updater = updater

    def __iter__(self):
        self.flush()
        return iter(self._keys.values())

    def get(self, key):
        return self._keys.get(key)

    def with_value(self, key, call='pull'):
        """The state of a key that holds a value (for pull)."""
        self.flush()
        state = self._keys.get(key)
        if state is None or state.value is None:
            raise _no_value(call, key)
        return state

    # -- validation: no state changes -------------------------------------------
    def validate(self, entries, what='value', need_weights=False, fresh=False,
                 writes_values=False, needs_value=None, reduced_in_place=False):
        """Check a whole call against the known keys and against itself.

        ``needs_value``: the name of a call (push) whose keys must hold a value already, as
        MXNet's own stores require ("key has not been inited").

        A key may appear once per call, and an array the call writes (an out, or a
        value reduced in place when ``writes_values``) once: MXNet's engine cannot run
        an op that lists one array twice, and two results for one array are ambiguous.
        ``reduced_in_place`` (pushpull): a value that is its own out is reduced where it is
        (with zero_copy, and no optimizer in the store), so no two keys' may share memory.
        """
        _check_once(entries, writes_values, reduced_in_place and self._config.zero_copy
                    and self.updater is None)
        for entry in entries:
            state = self._keys.get(entry.key)
            if state is None or state.value is None:
                if need_weights:
                    raise UnknownKeyError(
                        'key %r has no weights in the store, and the store runs an optimizer '
                        '(set_optimizer): init() or broadcast() the key before pushing '
                        'gradients for it' % (entry.key,))
                if needs_value:
                    raise _no_value(needs_value, entry.key)
            elif fresh:
                raise ValueError('key %r is already initialised' % (entry.key,))
            if state is not None and (entry.shape, entry.dtype) != (state.shape, state.dtype):
                raise _conflict(entry, state.shape, state.dtype, what, 'from its first use')

    # -- the data path (after validation) ----------------------------------------
    def register(self, entry):
        self.flush()
        return self._register(entry)

    def _register(self, entry):
        state = self._keys.get(entry.key)
        if state is None:
            state = self._keys[entry.key] = KeyState(entry)
        return state

    def plan(self, entry, in_place_ok):
        """How one key of a push or pushpull runs (a :class:`Plan`), decided once per call
        shape: :class:`CallCache` keeps it for the next call on the same arrays. Held
        updates stay held: the optimizer delivers them before the plan stages anything
        (StoreOptimizer.before)."""
        state = self._register(entry)
        values = tuple(entry.values)
        targets = values if entry.outs is None else tuple(entry.outs)
        in_place = (in_place_ok and self._config.zero_copy and self.updater is None
                    and len(values) == 1 and all(same_array(t, values[0]) for t in targets))
        if in_place:
            work = values[0]
        elif not in_place_ok and self.updater is None:
            # a push without the store's optimizer: summed in the stored value itself (one
            # copy in, none out)
            work = state.stored()
        else:
            work = state.staging()
        found = Plan(state, values, work, targets if in_place_ok else (), in_place,
                     place_of(work))
        if self.sharded(state):
            found.share = self.share_of(state)
            found.views = (_flat_slice(work, found.share), _flat_slice(state.value, found.share))
        elif self.updater is not None:
            found.views = (work, state.value)
            if len(values) == 1 and len(found.targets) == 1:
                weights = found.targets[0]
                if (not same_array(weights, values[0]) and weights.stype == 'default'
                        and values[0].stype == 'default'
                        and (weights.shape, weights.dtype) == (state.shape, state.dtype)
                        and weights.context == values[0].context):
                    found.weights = weights
        return found

    def aim(self, plan, direct):
        """Where a non-sharded key's update runs this call (StoreOptimizer.before). Direct
        (gluon.Trainer's loop, a single-device key): the gradient is reduced in place and
        the optimizer updates the call's out, the Trainer's weights, which become the
        key's value (so that no copy goes in or out, and a later read or update of the key
        sees them). Otherwise: the gradient is copied into the staging buffer and the
        optimizer updates the key's value, which is then copied into the outs. Held plans
        are delivered before (a plan is aimed only when it is not held)."""
        state = plan.state
        weights = plan.weights if direct else None
        if weights is not None:
            if not same_array(state.value, weights):
                state.value = weights
            work = plan.values[0]
        else:
            work = state.staging()
        if work is not plan.work:
            plan.work, plan.in_place, plan.place = work, weights is not None, place_of(work)
        plan.views = (work, state.value)

    def aimed(self, plan, direct):
        """The array :meth:`aim` makes ``plan``'s work (read as aim reads it), found without
        changing anything (heldloop.HeldLoop.again asks before it commits): a direct key's
        gradient, else the key's staging buffer, None until made."""
        if direct and plan.weights is not None:
            return plan.values[0]
        return plan.state._staging

    def share_of(self, state):
        """[start, stop) of the flat key that this rank's sharded optimizer updates."""
        return share(state.count, self._size, self._rank)

    def sharded(self, state):
        """Whether the store's optimizer updates only this rank's share of the key
        (shard_optimizer): keys of fewer elements than ranks are updated whole."""
        return (self.updater is not None and self._config.shard_optimizer and self._size > 1
                and state.count >= self._size)

    def deliver(self, plan):
        """After the collective: run the optimizer or store the sum, then fill the outputs.
        A sharded plan's optimizer updates this rank's share only; its outputs are filled by
        :meth:`fill` after the weights' allgather."""
        state = plan.state
        if self.updater is not None:
            debug.count('optimizer', 'key')
            self.updater(state.key, *plan.views)
            note_weights(plan)
            if plan.share is None:
                fill(plan, state.value)
        elif plan.targets:
            fill(plan, plan.work)
        elif plan.work is not state.value:
            plan.work.copyto(state.stored())


    # -- a step's updates, batched ----------------------------------------------------
    def hold(self, plans):
        """Keep plans whose collectives were submitted, to :meth:`deliver` them later in
        one batch (:meth:`flush`). Every method that reads or writes a key's value flushes
        first, so no caller of the table sees a held key's old weights."""
        self._held.extend(plans)
        self._held_keys.update(plan.state.key for plan in plans)

    def holding(self):
        """Whether any update is held (:meth:`flush` delivers it)."""
        return bool(self._held)

    def holds(self, plans):
        """Whether a key of ``plans`` is held (its update must come before their staging)."""
        return bool(self._held_keys) and any(plan.state.key in self._held_keys
                                             for plan in plans)

    def flush(self):
        """Deliver the held plans: one updater call with the lists of keys, sums and
        weights, which the optimizer runs as MXNet's multi-tensor updates (aggregate_num
        keys an operator, as gluon.Trainer's own updates do), then fill the outputs."""
        if not self._held:
            return
        plans, self._held = self._held, []
        self._held_keys.clear()
        debug.count('optimizer', 'batch')
        self._updater([plan.state.key for plan in plans], [plan.views[0] for plan in plans],
                      [plan.views[1] for plan in plans])
        for plan in plans:
            note_weights(plan)
            fill(plan, plan.state.value)


def note_weights(plan):
    """The arrays a store's optimizer writes a key's weights into (join() syncs them);
    those of the broadcast that gave the weights come first."""
    if not plan.state.weights:
        plan.state.weights = plan.targets


def fill(plan, source):
    """``source`` (the sum, or the stored weights) into the call's outputs."""
    for arr in plan.targets:
        if not same_array(arr, source):
            source.copyto(arr)


class Plan:
    """One key of a push or pushpull: its state, the arrays it sums (``values``), the
    array the collective reduces (``work``: the value itself in place, else the key's
    staging buffer), where the sum goes (``targets``), and the work array's place."""

    __slots__ = ('state', 'values', 'work', 'targets', 'in_place', 'place', 'share', 'views',
                 'weights')

    def __init__(self, state, values, work, targets, in_place, place):
        self.state, self.values, self.work = state, values, work
        self.targets, self.in_place, self.place = targets, in_place, place
        # with the store's optimizer: the gradient and the weights it updates (``views``),
        # and with shard_optimizer (KeyTable.sharded) this rank's [start, stop) of the flat
        # key (``share``), the views then being of that share of ``work`` and the value
        self.share = self.views = None
        # the one out that a gluon.Trainer loop's update may write directly (KeyTable.aim)
        self.weights = None

    def stage(self):
        """Sum the per-device values into the staging buffer (nothing to do in place)."""
        if not self.in_place:
            _reduce_into(self.values, self.work)


def _flat_slice(array, bounds):
    """Elements [start, stop) of the flattened array: a view that shares its memory and its
    engine variable, so that engine ops on it are ordered with those on the array."""
    return array.reshape((-1,))[bounds[0]:bounds[1]]


def request(kind, state, array, average=False, root=0, in_place=False, place=None, codec=None,
            shard=False):
    """The collective of one key, built whole (``place``: the array's, when the caller knows
    it; ``codec``: the compression that runs it, whose spec marks its signature; ``shard``:
    the sharded optimizer's reduce-scatter or allgather)."""
    place = place_of(array) if place is None else place
    sig = state.signature(kind, root, place)
    if codec is not None:
        sig = compression.sign(sig, codec.spec)
    return Collective(kind, state.key, state.dtype, state.shape, array=array, root=root,
                      average=average, nbytes=state.nbytes, sig=sig, place=place, codec=codec,
                      shard=shard, in_place=in_place)
