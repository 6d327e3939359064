"""The store's caches: of push and pushpull calls already checked (CallCache, whose
entries, Replay, hold what a repeated call reuses), and a bounded one of what named
collectives leave behind (NameCache: their staging buffers).

A script may name a collective per step (``allreduce(x, name='metric_%d' % step)``):
whatever is kept per name must be bounded, or memory grows with the steps. Horovod bounds
its name cache the same way (HOROVOD_CACHE_CAPACITY, 1024 entries).
"""
import collections

import mxnet as mx

from .. import debug

__all__ = ['NameCache', 'CallCache', 'Replay', 'Batch', 'again_key']


class NameCache:
    """At most ``capacity`` values, the least recently used dropped first, except those
    still in use.

    Each value comes with its user (a Collective): while ``user.done`` is False an
    asynchronous op may still read or write the value, so it stays, past the capacity if
    need be, until a later ``keep`` finds its user done. The overshoot is bounded by the
    collectives in flight. Capacity 0 keeps nothing: each call stages in a fresh value.
    """

    def __init__(self, capacity):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ValueError('NameCache: capacity must be an int >= 0, not %r' % (capacity,))
        self.capacity = capacity
        self._entries = collections.OrderedDict()   # key -> [value, user], oldest first

    def __len__(self):
        return len(self._entries)

    def __contains__(self, key):
        return key in self._entries

    def get(self, key):
        """The value kept for ``key`` (now the most recently used), or None."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def keep(self, key, value, user=None):
        """Keep ``value`` for ``key``, in use by ``user`` until ``user.done``; then drop
        the least recently used values whose users are done, down to the capacity."""
        if self.capacity == 0:
            return
        self._entries[key] = [value, user]
        self._entries.move_to_end(key)
        if len(self._entries) > self.capacity:
            self._evict()

    def _evict(self):
        excess = len(self._entries) - self.capacity
        newest = next(reversed(self._entries))   # just kept: it goes last of all, never now
        gone = []
        # The oldest come first and are the likeliest done: the scan stops as soon as
        # enough went, so it costs about one entry a call plus those in flight.
        for key, (_, user) in self._entries.items():
            if excess == 0 or key == newest:
                break
            if user is None or user.done:
                gone.append(key)   # collected first: an OrderedDict cannot shrink mid-scan
                excess -= 1
        for key in gone:
            del self._entries[key]


def _flatten(obj):
    """(form, arrays) of a value or out argument: an NDArray, or a list of NDArrays or of
    lists of them; None for anything else (the full check then says what is wrong)."""
    if isinstance(obj, mx.nd.NDArray):
        return -1, (obj,)
    if type(obj) not in (list, tuple):
        return None
    form, arrays = [], []
    for item in obj:
        if isinstance(item, mx.nd.NDArray):
            form.append(-1)
            arrays.append(item)
        elif type(item) in (list, tuple):
            form.append(len(item))
            for arr in item:
                if not isinstance(arr, mx.nd.NDArray):
                    return None
                arrays.append(arr)
        else:
            return None
    return tuple(form), tuple(arrays)


class Batch(list):
    """The requests of one call, with what a design may reuse for it (``prepared``: an
    engine.records.Prepared, or None)."""

    __slots__ = ('prepared',)

    @classmethod
    def renewed(cls, models, prepared):
        """The requests of a prepared call repeated: each of ``models`` renewed
        (Collective.renewed); a key alone (the common call) without a comprehension."""
        # a moving call's (Prepared.move_to) array in its model's stead
        moved = None if prepared is None else prepared.moved
        reqs = cls([models[0].renewed(moved)] if len(models) == 1
                   else [model.renewed() for model in models])
        reqs.prepared = prepared
        return reqs


class Replay:
    """A push or pushpull call already checked and planned (:class:`CallCache`), and what
    its repeats reuse: ``plans``; the requests, unnumbered (``models``: each repeat renews
    them, Collective.renewed; made by the exchange at the first repeat) with the codec and
    priority they were made for; the plans that stage and deliver through a copy (``staged``); the engine's
    prepared call (``prepared``); the arrays the collectives reduce (``works``: with the
    store's optimizer, where keys.KeyTable.aim pointed them)."""

    __slots__ = ('forms', 'arrays', 'handles', 'plans', 'value', 'out', 'flat', 'models',
                 'codec', 'priority', 'staged', 'prepared', 'works', 'sharded', 'call')

    def __init__(self, forms, arrays, plans, value, out, priority):
        self.forms, self.arrays, self.plans = forms, arrays, plans
        self.handles = tuple(a.handle.value for a in arrays)
        # one NDArray each (out may be None): matched by identity alone; lists may change
        single = forms[0] == -1 and forms[1] in (None, -1)
        self.value, self.out = (value, out) if single else (None, None)
        # lists (or tuples) of NDArrays alone: matched item by item, without flattening
        self.flat = not single and all(
            form is None or (form != -1 and all(item == -1 for item in form))
            for form in forms)
        self.models = self.codec = self.staged = self.prepared = None
        self.works = self.sharded = None   # the arrays aimed at; whether a key is sharded
        self.priority = priority
        self.call = 'pushpull'   # or 'push' (CallCache.remember)

    def matches(self, value, out):
        """Whether ``value`` and ``out`` are the very arrays of this call, with their
        handles, in the same form."""
        if self.value is not None:
            if value is not self.value or out is not self.out:
                return False
            for arr, handle in zip(self.arrays, self.handles):
                if arr.handle.value != handle:
                    return False
            return True
        if (out is None) != (self.forms[1] is None):
            return False
        if self.flat:   # lists of arrays (gluon.Trainer's list_grad, list_data): no nesting
            if type(value) not in (list, tuple) or len(value) != len(self.forms[0]):
                return False
            current = value
            if out is not None:
                if type(out) not in (list, tuple) or len(out) != len(self.forms[1]):
                    return False
                current = (*value, *out)
            for arr, known, handle in zip(current, self.arrays, self.handles):
                if arr is not known or arr.handle.value != handle:
                    return False
            return True
        value, out = _flatten(value), (None if out is None else _flatten(out))
        if (value is None or value[0] != self.forms[0]
                or (out is not None and out[0] != self.forms[1])):
            return False
        current = value[1] if out is None else value[1] + out[1]
        if len(current) != len(self.arrays):
            return False
        for arr, known, handle in zip(current, self.arrays, self.handles):
            if arr is not known or arr.handle.value != handle:
                return False
        return True


class CallCache:
    """The plans of push and pushpull calls already checked (:class:`Replay`), so that a
    training loop's repeated call (the same key or keys, the same arrays) skips the
    normalisation, the metadata queries, the validation and the planning, and only checks
    identity.

    An entry holds its arrays, so their objects and handles cannot be reused for others
    while it exists: an entry matches only the very same NDArray objects, with the
    handles they had, in the same form. A reshape, a cast or a new array is another
    object and takes the full path (and its checks) again. ``clear()`` is called where
    a store-wide decision changes (set_optimizer changes what runs in place).
    """

    LIMIT = 4096   # entries (a model has a few per parameter); cleared when reached

    def __init__(self):
        self._entries = {}
        # the entries prepared for the one-function path (Exchange.again), by call and
        # then by key (a list of keys as a tuple): no optimizer in the store
        self.pushpull, self.push = {}, {}

    @staticmethod
    def _slot(call, key):
        kind = key.__class__
        if kind is int or kind is str:
            return call, kind, key
        if isinstance(key, (list, tuple)):
            key = tuple(key)
        try:
            hash(key)
        except TypeError:
            return None
        return call, type(key), key

    def find(self, call, key, value, out):
        """The :class:`Replay` of an earlier call with these very arguments, or None."""
        slot = self._slot(call, key)
        entry = self._entries.get(slot) if slot is not None else None
        if entry is not None and not entry.matches(value, out):
            entry = None
        debug.count('call_cache', 'miss' if entry is None else 'hit')
        return entry

    def remember(self, call, key, value, out, plans, priority=0):
        slot = self._slot(call, key)
        flat_out = None if out is None else _flatten(out)
        flat = _flatten(value)
        if slot is None or flat is None or (out is not None and flat_out is None):
            return
        arrays = flat[1] + (flat_out[1] if flat_out is not None else ())
        if len(self._entries) >= self.LIMIT:
            self._entries.clear()
        # the key's prepared entry, of other arrays, goes with the entry it replaces
        (self.pushpull if call == 'pushpull' else self.push).pop(again_key(key), None)
        entry = self._entries[slot] = Replay(
            (flat[0], None if flat_out is None else flat_out[0]), arrays, plans, value, out,
            priority)
        entry.call = call

    def prepared(self, call, key, entry):
        """``entry`` (of ``call``'s ``key``) is prepared: its repeats may take the
        one-function path (Exchange.again)."""
        ready = self.pushpull if call == 'pushpull' else self.push
        found = again_key(key)
        if found is None:
            return
        if len(ready) >= self.LIMIT:
            ready.clear()
        ready[found] = entry

    def clear(self):
        self._entries.clear()
        self.pushpull.clear()
        self.push.clear()


def again_key(key):
    """The key of a call in CallCache's prepared tables: an int or a str as it is, a list
    or tuple of keys as a tuple, anything else None."""
    kind = key.__class__
    if kind is int or kind is str:
        return key
    if kind is list or kind is tuple:
        try:
            key = tuple(key)
            hash(key)
        except TypeError:
            return None
        return key
    return None
