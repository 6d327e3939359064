"""The records of repeated named collectives (store/collectives.py): a name's last in-place
allreduce (:class:`Again`), its last out-of-place one (:class:`Copy`), the unnamed calls'
records found by their tensor (:class:`Unnamed`), and the checks of a list of tensors that
decide which path it takes. Moved out of collectives.py, whose calls read them."""
import collections
import weakref

import mxnet as mx

from ..comm.collective import Collective
from ..engine.arrays import Blank, dense_meta, storage_of
from ..engine.records import CopyNow, Prepared

__all__ = ['Again', 'Copy', 'Unnamed', 'HIT', 'HIT_COPY', 'HIT_UNNAMED', 'distinct_dense',
           'check_arrays', 'copier']

# the debug counters of a repeated call, made once and counted in one (debug.count_all):
# a lone in-place allreduce (again, and the full path's _repeat), an out-of-place one
HIT = (('fastpath', 'hit'), ('named', 'hit'))   # its signature, too, is the one made before
HIT_COPY = (('again', 'copy'),) + HIT
HIT_UNNAMED = (('again', 'unnamed'),) + HIT   # an unnamed in-place one (again_unnamed)
# the unnamed calls' records (again_unnamed) hold their arrays: at most these bytes of them
# (and name_cache_capacity entries), least recently used out
_UNNAMED_BYTES = 64 << 20


class Again:
    """A name's last in-place allreduce: its array (and the array's handle object, which a
    new handle of the same array would not be), and what a call on the same array again
    reuses: its requests as models (unnumbered: made before the design numbered them),
    which each call renews (Collective.renewed), and the engine's prepared call; the debug
    counters of a call (``hits``). Of a group (a list of tensors and of their requests):
    the tuple of the tensors and of their handles, a model each, and the counters 'again'
    once, then 'fastpath' and 'named' for each tensor. ``average`` and ``scale``: the
    caller's arguments under which a call finds it again (Collectives.allreduce's
    ``repeat_as``; its requests hold what they mean: average and factor)."""

    __slots__ = ('tensor', 'handle', 'average', 'scale', 'dtype', 'models', 'hits', 'prepared')

    def __init__(self, tensor, req, design, repeat_as):
        self.average, self.scale = repeat_as
        if isinstance(req, list):
            self.tensor = tuple(tensor)
            self.handle = tuple(t.handle for t in tensor)
            self.dtype = None
            self.models = [r.renewed() for r in req]
            self.hits = (('again', 'group'),) + HIT * len(req)
            self.prepared = Prepared(self.tensor, design)
            return
        self.tensor, self.handle = tensor, tensor.handle
        self.dtype = req.dtype
        self.models, self.hits = [req.renewed()], HIT
        self.prepared = Prepared([tensor], design)


class Copy:
    """A name's last out-of-place allreduce: the handle object of the array it copied, held
    weakly (an NDArray takes no weak reference; its handle dies with it), so that the
    cache keeps no caller's input alive; the caller's average and scale (as _Again's); the
    copy's request as a model without the copy, the design it went to, and the engine's
    prepared call, which each repeat moves to its new copy (Prepared.move_to)."""

    __slots__ = ('source', 'average', 'scale', 'models', 'design', 'prepared', 'blank')

    def __init__(self, tensor, req, design, repeat_as):
        self.source = weakref.ref(tensor.handle)
        # a dense host array's repeats copy it at their push (records.CopyNow), each into a
        # new array made by ``blank``; any other's by MXNet's copy op (copy_of)
        # (up to _COPY_AT_PUSH bytes: a larger one, which fuses with nothing, keeps MXNet's
        # asynchronous copy rather than hold the caller, and the GIL, for its memcpy)
        self.blank = (Blank(tensor) if tensor.__class__ is mx.nd.NDArray and req.place == 'cpu'
                      and req.dtype is not None and 0 < req.nbytes <= _COPY_AT_PUSH
                      and tensor.stype == 'default' else None)
        (self.average, self.scale), self.design = repeat_as, design
        self.models = [Collective(req.kind, req.key, req.dtype, req.shape, None, req.root,
                                  None, req.average, 0, req.nbytes, req.sig, req.place, 1,
                                  req.codec, False, req.in_place, factor=req.factor,
                                  scale=req.scale)]
        # the engine's prepared call, moved to each call's copy (Prepared.move_to); it
        # holds the last copy (the caller's result) until the next call moves it, so it is
        # made at the first repeat (Collectives.again_copy): a name called once keeps no
        # result alive
        self.prepared = None


_copier = []   # [the records.CopyNow of again_copy], made on first use
_COPY_AT_PUSH = 1 << 20   # bytes: the largest input an out-of-place repeat copies at its push


def copier():
    """The records.CopyNow of Collectives.again_copy, made on first use."""
    if not _copier:
        _copier.append(CopyNow())
    return _copier[0]


def distinct_dense(tensors):
    """Whether every tensor is a dense NDArray and no two share storage (ids known): what
    lets a list go as one engine op, which may write each engine variable only once."""
    try:
        if any(dense_meta(tensor) is None for tensor in tensors):
            return False
        found = [storage_of(tensor) for tensor in tensors]
    except (AttributeError, TypeError):   # not an NDArray: the call's loop says which
        return False
    return None not in found and len(set(found)) == len(found)


def check_arrays(names, tensors):
    """Raise TypeError naming the first of ``tensors`` that is no NDArray (asked once
    something failed on one: a good call pays nothing for it)."""
    for i, (name, tensor) in enumerate(zip(names, tensors)):
        if not isinstance(tensor, mx.nd.NDArray):
            raise TypeError('allreduce: tensor %d of %d (name %r) is a %s, not an MXNet '
                            'NDArray' % (i, len(tensors), name, type(tensor).__name__))


class Unnamed:
    """The unnamed calls' records (Collectives.again_unnamed): an unnamed call's tensor (its
    id: the record holds it) -> its last in-place allreduce (:class:`Again`), which the
    unnamed calls' one name cannot key when tensors alternate (hvd.allreduce_(x) without a
    name); bounded by ``max`` entries and _UNNAMED_BYTES of arrays (``nbytes`` held now),
    least recently used out."""

    __slots__ = ('entries', 'nbytes', 'max')

    def __init__(self, capacity):
        self.entries = collections.OrderedDict()
        self.nbytes, self.max = 0, capacity

    def remember(self, tensor, known):
        """Keep ``known`` (the record of ``tensor``'s last call) by ``tensor``."""
        entries, nbytes = self.entries, known.models[0].nbytes
        old = entries.pop(id(tensor), None)
        if old is not None:
            self.nbytes -= old.models[0].nbytes
        if nbytes > _UNNAMED_BYTES:
            return
        entries[id(tensor)] = known
        self.nbytes += nbytes
        while len(entries) > self.max or self.nbytes > _UNNAMED_BYTES:
            self.nbytes -= entries.popitem(last=False)[1].models[0].nbytes
