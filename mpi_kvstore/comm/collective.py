"""One collective as the designs see it: what it is, and where it is in the sequence."""
import operator
import threading
import zlib

import numpy as np

from .poison import poison

__all__ = ['Collective', 'all_done', 'finish_all', 'signature', 'factor_sig', 'place_of',
           'SIG_LIMIT', 'SHARDED', 'LAMB_NORMS', 'CLIP_NORM']

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


def factor_sig(sig, factor, scale=None):
    """``sig`` with a scale factor's mark (none for 1.0: a plain sum's signature is as it
    was). The factor's exact bits decide, as they decide the result. ``scale``: the
    caller's (prescale, postscale) where it gave them (Horovod's), marked too: ranks that
    split one product differently, (2, 1) and (1, 2), fold the same factor, yet called
    differently, which Horovod refuses ('Mismatched prescale and/or postscale factors')."""
    if factor != 1.0:
        sig = (sig * 31 + zlib.crc32(np.float64(factor).tobytes())) % SIG_LIMIT
    if scale is not None:
        sig = (sig * 31 + zlib.crc32(np.array(scale, dtype=np.float64).tobytes())) % SIG_LIMIT
    return sig


def place_of(array):
    """'gpu' for an NDArray in GPU memory, else 'cpu': known on the user's thread, before
    any engine op reads the array (unlike its buffer, which a failed read leaves unset)."""
    context = getattr(array, 'context', None)
    return 'gpu' if context is not None and context.device_type == 'gpu' else 'cpu'


def _read_only(name, doc):
    """A public name for the private slot ``_name`` that outside code can read, not write.
    The getter is operator.attrgetter, in C: about half the cost of a Python one on the
    hot path, where a small pushpull reads some thirty of these."""
    return property(operator.attrgetter('_' + name), doc=doc)


# an instance with no __init__ run (Collective.renewed sets every slot itself)
_blank = object.__new__


class Collective:
    """A collective with its place in the push sequence.

    What it is (kind, key, dtype, shape, array, root, average, unit, place, codec, shard,
    in_place, mirror) is decided before it is built, by whoever builds it (store.keys.request,
    the store's units, designs.join.mirror), given to the constructor, and never changed
    afterwards: every attribute is read-only, and only the methods below change it.

    Its place in the sequence is given once: by the design's submit (:meth:`number`), or
    to the constructor for a mirror (the active rank's ``seq``, ``priority`` and ``sig``).
    ``seq`` is assigned on the user's thread in call order, so it is the same on
    every rank; designs derive the collective order from it, never from the
    order in which the engine finds data ready.

    What happens to it is recorded through its methods as it runs, by the design that runs
    it: the memory it reads and writes (:meth:`attach`, :meth:`withdraw`,
    :meth:`use_scratch`), how its engine op completes and how to wait for it
    (:meth:`complete_with`, :meth:`wait_with`), its ``result`` (:meth:`run_custom`), its
    ``error`` (:meth:`fail`) and ``done`` (:meth:`complete`, :meth:`finish`).
    """

    __slots__ = ('_seq', '_kind', '_key', '_dtype', '_shape', '_nbytes', '_root', '_sig',
                 '_place', '_array', '_view', '_scratch', '_completion', '_fn', '_result',
                 '_error', '_average', '_done', '_priority', '_in_place', '_mirror',
                 '_waiter', '_codec', '_unit', '_shard', '_factor', '_scale')

    def __init__(self, kind, key, dtype=None, shape=(), array=None, root=0, fn=None,
                 average=False, priority=0, nbytes=None, sig=None, place=None, unit=1,
                 codec=None, shard=False, in_place=False, mirror=False, seq=-1, view=None,
                 factor=1.0, scale=None):
        """``sig``: a signature decided by the caller (a codec's mark or the active rank's
        own, for a mirror), which then already holds ``unit``, ``factor`` and ``scale``; by
        default it is computed here from what the collective is. ``seq`` and ``priority``: a
        mirror's, given by the active rank (others get theirs from :meth:`number`)."""
        assert kind in KINDS
        self._seq = seq
        self._kind, self._key, self._fn = kind, key, fn
        self._dtype, self._shape, self._array = dtype, tuple(shape), array
        if nbytes is None:
            size = 1
            for d in self._shape:
                size *= d
            nbytes = size * dtype.itemsize if dtype is not None else 0
        self._nbytes = nbytes
        self._root = root
        self._place = place_of(array) if place is None else place
        self._unit = unit
        if sig is None:
            sig = signature(kind, key, dtype, self._shape, root, self._place)
            if unit != 1:
                sig = (sig * 31 + unit) % SIG_LIMIT
            sig = factor_sig(sig, factor, scale)
        self._sig = sig
        self._factor, self._scale = factor, scale
        self._scratch = self._completion = self._result = self._error = None
        self._view = view
        self._average = average
        self._priority = priority
        self._in_place = in_place
        self._mirror = mirror
        self._done = False
        self._waiter = None
        self._codec = codec
        self._shard = shard

    kind = _read_only('kind', "one of KINDS")
    key = _read_only('key', "the store key or the collective's name")
    dtype = _read_only('dtype', 'numpy dtype of its elements (None for barrier and custom)')
    shape = _read_only('shape', 'shape of its array, a tuple')
    nbytes = _read_only('nbytes', 'bytes of its flat buffer')
    root = _read_only('root', "bcast's root rank")
    place = _read_only('place', "'cpu' or 'gpu': where its array lives (place_of)")
    array = _read_only('array', 'the NDArray it reads and writes, or None')
    fn = _read_only('fn', "a custom collective's function of the MPI communicator")
    average = _read_only('average', 'divide the sum by the rank count')
    factor = _read_only('factor', 'multiply the sum (the mean) by it, folded into the '
                        "reduction's scaling (reduce.scale); part of the signature: ranks "
                        'that scale differently would fuse differently, and Horovod calls '
                        'different factors a mismatch')
    scale = _read_only('scale', "the caller's (prescale, postscale) whose product (or part) "
                       'the factor is, or None (no factors given); part of the signature '
                       '(factor_sig)')
    unit = _read_only('unit', 'reducescatter and allgather: elements that stay in one share '
                      "(fusion.pieces); part of the signature, since it decides how many "
                      "elements each rank's share holds")
    codec = _read_only('codec', 'compression.WireCast or TwoBit that runs it, if compressed')
    shard = _read_only('shard', "the sharded optimizer's reduce-scatter or allgather of a "
                       'store key: a joined rank still owns a share of it '
                       '(shards.JoinedShares), so it is not refused under join')
    in_place = _read_only('in_place', "the array is the user's output: a failure may raise "
                          'on its read')
    mirror = _read_only('mirror', "a joined rank's stand-in for another rank's collective")
    seq = _read_only('seq', 'place in the push sequence, the same on every rank (-1: not '
                     'yet numbered)')
    priority = _read_only('priority', 'within a round, collectives run by priority')
    sig = _read_only('sig', 'rank-independent fingerprint the ranks agree on (signature), '
                     'with its marks')
    view = _read_only('view', 'flat view of the memory of its array, once attached')
    scratch = _read_only('scratch', 'memory it sends instead of its view after a failure')
    completion = _read_only('completion', "its engine op's completion (done(err) once)")
    waiter = _read_only('waiter', 'waiter(req, timeout): how to wait when nobody calls finish()')
    result = _read_only('result', "a custom collective's result")
    error = _read_only('error', 'the first error it failed with, or None')
    done = _read_only('done', 'it ran (or failed) and its engine op is complete')

    def describe(self):
        return ('collective #%d (%s of key %r, shape %s, dtype %s)'
                % (self._seq, self._kind, self._key, self._shape, self._dtype))

    @property
    def extent(self):
        """Elements of the flat buffer it reads and writes."""
        return self._nbytes // self._dtype.itemsize

    def renewed(self, array=None):
        """A new unnumbered request that is what this unnumbered one is (a prepared call's
        model, store/exchange.py), with nothing of what happened to it: the constructor's
        work without its argument binding, checks and signature (issue 43). ``array``: one
        of the same shape, dtype and place in its array's stead (an out-of-place call's new
        copy, store/collectives.py)."""
        return self.again(-1, self._priority, self._sig, None, array)

    def numbered_sig(self, priority):
        """The signature :meth:`number` gives this unnumbered request at ``priority``."""
        return (self._sig * 31 + priority) % SIG_LIMIT

    def again(self, seq, priority, sig, waiter, array=None):
        """:meth:`renewed`, then :meth:`number` (``sig``: :meth:`numbered_sig` of
        ``priority``, which the caller keeps) and :meth:`wait_with`, in one function: a
        chained design's prepared call repeated (designs/chained.py, Chained.again).
        :meth:`renewed` is this with the model's own seq (-1), priority and signature."""
        # one assignment a slot: a tuple built and unpacked per line cost a tenth more
        new = _blank(Collective)
        new._kind = self._kind
        new._key = self._key
        new._fn = self._fn
        new._dtype = self._dtype
        new._shape = self._shape
        new._nbytes = self._nbytes
        new._root = self._root
        new._array = self._array if array is None else array
        new._place = self._place
        new._unit = self._unit
        new._sig = sig
        new._average = self._average
        new._codec = self._codec
        new._shard = self._shard
        new._in_place = self._in_place
        new._mirror = self._mirror
        new._factor = self._factor
        new._scale = self._scale
        new._seq = seq
        new._priority = priority
        new._done = False
        new._scratch = new._completion = new._result = new._error = None
        new._waiter = waiter
        new._view = self._view
        return new

    def again_in_place(self, seq, sig, array=None):
        """:meth:`again` on this request itself, where it is done and its op reaped (the
        chained design's repeated call takes the op and its request again): numbered
        ``seq`` (its priority and waiter as they were), not done, ``array`` (a moving
        call's) in its array's stead. False, nothing changed, where it is not done, its
        numbered signature is not ``sig`` or anything but a clean run happened to it (an
        error, a view, scratch, a completion, a result): the caller renews one
        (:meth:`again`)."""
        if (not self._done or self._sig != sig or self._error is not None
                or self._view is not None or self._scratch is not None
                or self._completion is not None or self._result is not None):
            return False
        self._seq = seq
        if array is not None:
            self._array = array
        self._done = False
        return True

    # -- set once, on the user's thread --------------------------------------
    def number(self, seq, priority):
        """Its place in the sequence (Design.submit, in call order). The priority joins the
        signature: every rank must pass the same."""
        if self._seq >= 0:
            raise RuntimeError('%s is already numbered' % self.describe())
        self._seq = seq
        self._priority = priority
        self._sig = (self._sig * 31 + priority) % SIG_LIMIT

    # -- where it runs --------------------------------------------------------
    def attach(self, view):
        """The flat memory it reads and writes, read where that is allowed (inside its
        engine op, or by the design that runs it)."""
        self._view = view

    def complete_with(self, completion):
        """What :meth:`complete` tells: its engine op's completion (``done(err)``)."""
        self._completion = completion

    def wait_with(self, waiter):
        """How :meth:`wait` waits while nobody calls finish(): ``waiter(req, timeout)``."""
        self._waiter = waiter

    def run_custom(self, mpi):
        """A custom collective: call its function on the MPI communicator, keep the result."""
        self._result = self._fn(mpi)

    def fail(self, error):
        """Record why it failed (the design reports it)."""
        self._error = error

    def withdraw(self):
        """This rank cannot take part as asked: without memory read it sends zeros, and its
        signature changes, so that before the agreement every rank sees a mismatch."""
        if self._view is None and self._array is not None:
            self._scratch = np.zeros(self.extent, dtype=self._dtype)
        self._sig = (self._sig + SIG_LIMIT // 2) % SIG_LIMIT

    def use_scratch(self, scratch):
        """Send ``scratch`` instead (the reducer moves a device bucket's zeros to the device)."""
        self._scratch = scratch

    def buffer(self):
        """The memory MPI reads and writes: the array's view, or scratch after a failure."""
        return self._scratch if self._scratch is not None else self._view

    def complete(self):
        """Poison the output of a failed collective, then complete its engine op."""
        if self._error is not None:
            poison(self._view)
        if self._completion is not None:
            self._completion.done(None if self._error is None
                                  else 'mpi_kvstore: %s failed: %s'
                                  % (self.describe(), self._error))
        self.finish()

    def finish(self):
        with _FINISHED:
            self._done = True
            _FINISHED.notify_all()

    def wait(self, timeout=None):
        """Block until the collective ran (or failed); False if ``timeout`` passed first."""
        if self._waiter is not None and not self._done:
            return self._waiter(self, timeout)
        with _FINISHED:
            return _FINISHED.wait_for(lambda: self._done, timeout)


_done_of = operator.attrgetter('_done')


def all_done(reqs):
    """Whether every one of ``reqs`` is done: a C loop over a burst's ~100 (Job's pending,
    designs/chained.py), where the ``done`` property costs a second call each."""
    return all(map(_done_of, reqs))


def finish_all(reqs):
    """:meth:`Collective.finish` of each of ``reqs``, their waiters woken once."""
    with _FINISHED:
        for req in reqs:
            req._done = True
        _FINISHED.notify_all()


# One condition for every request: an Event per request (a Condition and its
# locks each) cost more than the rest of a small pushpull's Python path.
_FINISHED = threading.Condition()
