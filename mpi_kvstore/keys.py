"""The store's per-key data path: what it knows of each key, and how a value
reaches the collective and its result reaches the outputs.

Nothing here changes state before :meth:`KeyTable.validate` accepted the whole
call, so a rejected call leaves the store as it was.
"""
import mxnet as mx
import numpy as np

from .collective import Collective, place_of, signature
from .errors import UnknownKeyError

__all__ = ['KeyState', 'KeyTable', 'same_array', 'request']


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


def _check_once(entries, writes_values):
    keys, written = set(), {}
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


def _conflict(entry, shape, dtype, what, since):
    return ValueError('%s for key %r has shape %s and dtype %s, but the key has shape %s and '
                      'dtype %s (%s)' % (what, entry.key, entry.shape, entry.dtype.name,
                                         shape, dtype.name, since))


class KeyTable:
    """Every key the store has seen, and the data path of push, pushpull and pull."""

    def __init__(self, config):
        self._config = config
        self._keys = {}
        self.updater = None

    def __iter__(self):
        return iter(self._keys.values())

    def get(self, key):
        return self._keys.get(key)

    def with_value(self, key):
        """The state of a key that holds a value (for pull)."""
        state = self._keys.get(key)
        if state is None or state.value is None:
            raise UnknownKeyError('key %r has no value in the store: init(), push() or '
                                  'broadcast() it first (pushpull alone stores nothing)' % (key,))
        return state

    # -- validation: no state changes -------------------------------------------
    def validate(self, entries, what='value', need_weights=False, fresh=False,
                 writes_values=False):
        """Check a whole call against the known keys and against itself.

        A key may appear once per call, and an array the call writes (an out, or a
        value reduced in place when ``writes_values``) once: MXNet's engine cannot run
        an op that lists one array twice, and two results for one array are ambiguous.
        """
        _check_once(entries, writes_values)
        for entry in entries:
            state = self._keys.get(entry.key)
            if fresh and state is not None and state.value is not None:
                raise ValueError('key %r is already initialised' % (entry.key,))
            if need_weights and (state is None or state.value is None):
                raise UnknownKeyError(
                    'key %r has no weights in the store, and the store runs an optimizer '
                    '(set_optimizer): init() or broadcast() the key before pushing '
                    'gradients for it' % (entry.key,))
            if state is not None and (entry.shape, entry.dtype) != (state.shape, state.dtype):
                raise _conflict(entry, state.shape, state.dtype, what, 'from its first use')

    # -- the data path (after validation) ----------------------------------------
    def register(self, entry):
        state = self._keys.get(entry.key)
        if state is None:
            state = self._keys[entry.key] = KeyState(entry)
        return state

    def plan(self, entry, in_place_ok):
        """-> (state, work array for the collective, output targets, in place?)."""
        state = self.register(entry)
        values = entry.values
        targets = values if entry.outs is None else entry.outs
        in_place = (in_place_ok and self._config.zero_copy and self.updater is None
                    and len(values) == 1 and all(same_array(t, values[0]) for t in targets))
        if in_place:
            work = values[0]
        else:
            work = state.staging()
            _reduce_into(values, work)
        return state, work, (targets if in_place_ok else ()), in_place

    def deliver(self, state, work, targets):
        """After the collective: run the optimizer or store the sum, then fill the outputs."""
        source = work
        if self.updater is not None:
            self.updater(state.key, work, state.value)
            source = state.value
            if not state.weights:  # those of the broadcast that gave the weights come first
                state.weights = tuple(targets)
        elif not targets:
            work.copyto(state.stored())
            return
        for arr in targets:
            if not same_array(arr, source):
                source.copyto(arr)


def request(kind, state, array, average=False, root=0, in_place=False):
    """The collective of one key."""
    place = place_of(array)
    req = Collective(kind, state.key, state.dtype, state.shape, array=array, root=root,
                     average=average, nbytes=state.nbytes, sig=state.signature(kind, root, place),
                     place=place)
    req.in_place = in_place
    return req
