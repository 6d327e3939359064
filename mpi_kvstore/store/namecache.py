"""A bounded cache of what named collectives leave behind (their staging buffers).

A script may name a collective per step (``allreduce(x, name='metric_%d' % step)``):
whatever is kept per name must be bounded, or memory grows with the steps. Horovod bounds
its name cache the same way (HOROVOD_CACHE_CAPACITY, 1024 entries).
"""
import collections

__all__ = ['NameCache']


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
