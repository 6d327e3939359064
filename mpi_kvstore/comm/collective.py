"""One collective as the designs see it: what it is, and where it is in the sequence."""
import threading
import zlib

from .poison import poison

__all__ = ['Collective', 'signature', 'place_of', 'SIG_LIMIT', 'SHARDED', 'LAMB_NORMS',
           'CLIP_NORM']

# Signatures travel in an int32 negotiation message with +1 and complement
# encodings (see agreement.py), so they stay below 2**30.
SIG_LIMIT = 1 << 30

# reducescatter and allgather run in place on the whole flat array: after a reducescatter
# this rank's share (fusion.share) holds the sum, after an allgather every share holds its
# owner's values. The sharded optimizer (keys.Plan.sharded) runs one, then the other.
KINDS = ('allreduce', 'bcast', 'barrier', 'custom', 'reducescatter', 'allgather')
SHARDED = ('reducescatter', 'allgather')
# The first element of the key of the sharded LAMB update's norms allreduce
# (store/optimizer.py), which a joined rank cannot take part in (designs/join.py)
LAMB_NORMS = '__lamb_norms__'
# The key of global-norm clipping's allreduce of the shares' squares (store/optimizer.py),
# which a joined rank cannot take part in either
CLIP_NORM = '__clip_norm__'


def signature(kind, key, dtype, shape, root, place='cpu'):
    """Rank-independent fingerprint; Python's hash() is salted per process. ``place``
    ('cpu' or 'gpu', see place_of) joins it off the CPU, so that ranks agree on where
    every array lives before fusion plans buckets from it."""
    text = '%s|%r|%s|%s|%d' % (kind, key, dtype, tuple(shape), root)
    if place != 'cpu':
        text += '|' + place
    return zlib.crc32(text.encode()) % SIG_LIMIT


def place_of(array):
    """'gpu' for an NDArray in GPU memory, else 'cpu': known on the user's thread, before
    any engine op reads the array (unlike its buffer, which a failed read leaves unset)."""
    context = getattr(array, 'context', None)
    return 'gpu' if context is not None and context.device_type == 'gpu' else 'cpu'


class Collective:
    """A collective with its place in the push sequence.

    What it is (kind, key, dtype, shape, array, root, average, unit, place, codec, shard,
    in_place, mirror) is decided before it is built, by whoever builds it (store.keys.request,
    the store's units, designs.join.mirror), and never changed afterwards.

    What happens to it is recorded as it runs, by the design that runs it and by nobody
    else: ``seq`` (a mirror's is the active rank's, given when it is built), ``priority``
    and the signature's marks (Design.submit, fail_all), the ``view`` or ``scratch``
    memory it reads and writes (Design.attach, the reducer, shards.JoinedShares for a
    joined rank's mirror), its engine op's ``completion`` and ``waiter``, its ``result``,
    ``error`` and ``done``.

    ``seq`` is assigned on the user's thread in call order, so it is the same on
    every rank; designs derive the collective order from it, never from the
    order in which the engine finds data ready.
    """

    __slots__ = ('seq', 'kind', 'key', 'dtype', 'shape', 'nbytes', 'root', 'sig', 'place',
                 'array', 'view', 'scratch', 'completion', 'fn', 'result', 'error',
                 'average', 'done', 'priority', 'in_place', 'mirror', 'waiter', 'codec',
                 'unit', 'shard')

    def __init__(self, kind, key, dtype=None, shape=(), array=None, root=0, fn=None,
                 average=False, priority=0, nbytes=None, sig=None, place=None, unit=1,
                 codec=None, shard=False, in_place=False, mirror=False, seq=-1, view=None):
        """``sig``: a signature decided by the caller (a codec's mark or the active rank's
        own, for a mirror), which then already holds ``unit``; by default it is computed
        here from what the collective is."""
        assert kind in KINDS
        self.seq = seq
        self.kind, self.key, self.fn = kind, key, fn
        self.dtype, self.shape, self.array = dtype, tuple(shape), array
        if nbytes is None:
            size = 1
            for d in self.shape:
                size *= d
            nbytes = size * dtype.itemsize if dtype is not None else 0
        self.nbytes = nbytes
        self.root = root
        self.place = place_of(array) if place is None else place
        # reducescatter and allgather: elements that stay in one share (fusion.pieces); part
        # of the signature, since it decides how many elements each rank's share holds
        self.unit = unit
        if sig is None:
            sig = signature(kind, key, dtype, self.shape, root, self.place)
            if unit != 1:
                sig = (sig * 31 + unit) % SIG_LIMIT
        self.sig = sig
        self.scratch = self.completion = self.result = self.error = None
        self.view = view       # a mirror's zeros; else set where it runs (Design.attach)
        self.average = average
        self.priority = priority
        self.in_place = in_place  # the array is the user's output: a failure may raise on its read
        self.mirror = mirror      # a joined rank's stand-in for another rank's collective
        self.done = False
        self.waiter = None     # waiter(req, timeout): how to wait when nobody calls finish()
        self.codec = codec     # compression.WireCast or TwoBit that runs it, if compressed
        # the sharded optimizer's reduce-scatter or allgather of a store key: a joined rank
        # still owns a share of it (shards.JoinedShares), so it is not refused under join
        self.shard = shard

    def describe(self):
        return ('collective #%d (%s of key %r, shape %s, dtype %s)'
                % (self.seq, self.kind, self.key, self.shape, self.dtype))

    @property
    def extent(self):
        """Elements of the flat buffer it reads and writes."""
        return self.nbytes // self.dtype.itemsize

    def buffer(self):
        """The memory MPI reads and writes: the array's view, or scratch after a failure."""
        return self.scratch if self.scratch is not None else self.view

    def complete(self):
        """Poison the output of a failed collective, then complete its engine op."""
        if self.error is not None:
            poison(self.view)
        if self.completion is not None:
            self.completion.done(None if self.error is None
                                 else 'mpi_kvstore: %s failed: %s' % (self.describe(), self.error))
        self.finish()

    def finish(self):
        with _FINISHED:
            self.done = True
            _FINISHED.notify_all()

    def wait(self, timeout=None):
        """Block until the collective ran (or failed); False if ``timeout`` passed first."""
        if self.waiter is not None and not self.done:
            return self.waiter(self, timeout)
        with _FINISHED:
            return _FINISHED.wait_for(lambda: self.done, timeout)


# One condition for every request: an Event per request (a Condition and its
# locks each) cost more than the rest of a small pushpull's Python path.
_FINISHED = threading.Condition()
