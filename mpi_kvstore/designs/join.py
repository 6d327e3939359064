"""What a rank that called ``join()`` needs to take part in the others' collectives.

A joined rank has no requests of its own. When the agreement shows that some
rank joined, every rank learns which ranks joined (an allgather), and the
lowest active rank sends what the agreed collectives are (a bcast of
:func:`describe` tuples). A joined rank runs a :func:`mirror` of each: an
allreduce on zeros of the agreed size (its result is dropped), a broadcast into
scratch memory. Both sides refuse the same collectives (:func:`refusal`), so
ranks stay paired.
"""
import numpy as np

from .. import compression
from ..comm.collective import CLIP_NORM, LAMB_NORMS, Collective

__all__ = ['describe', 'mirror', 'refusal']


def describe(req):
    """Everything a joined rank needs to run the same collective and plan the same buckets."""
    dtype = req.dtype.str if req.dtype is not None else ''
    return (req.seq, req.kind, req.key, dtype, req.shape, req.nbytes, req.root, req.average,
            req.priority, req.sig, req.codec.spec if req.codec is not None else None, req.place,
            req.unit, req.shard, req.factor)


def mirror(meta, shares=None):
    """A joined rank's stand-in for an active rank's request. ``shares``
    (shards.JoinedShares, with shard_optimizer) takes the mirrors of the sharded
    optimizer's collectives: this rank still updates and sends its share of the weights."""
    (seq, kind, key, dtype, shape, nbytes, root, average, priority, sig, codec, place, unit,
     shard, factor) = meta
    dtype = np.dtype(dtype) if dtype else None
    # planned as the others plan it: their signature (which holds the unit), seq and codec
    req = Collective(kind, key, dtype, shape, root=root, average=average, priority=priority,
                     nbytes=nbytes, sig=sig, place=place, unit=unit,
                     codec=compression.from_spec(codec), shard=shard, mirror=True, seq=seq,
                     factor=factor,
                     view=None if dtype is None else np.zeros(nbytes // dtype.itemsize,
                                                              dtype=dtype))
    if shard and shares is not None:
        shares.take(req)
    return req


# Small allreduces over every rank's shares, by the first element of their keys (store/optimizer.py):
# what needs them, and what to do instead under join.
_NEEDS_EVERY_SHARE = {
    (LAMB_NORMS,): ("the sharded LAMB update needs the whole weight's norms",
                    'or another optimizer'),
    (CLIP_NORM,): ('clip_global_norm needs the norm over every share of the gradient',
                   'or without clipping'),
}


def refusal(req, joined):
    """Why no joined rank can take part in ``req`` (None when it can).

    ``joined[r]`` is true when rank r has joined.
    """
    ranks = [r for r, j in enumerate(joined) if j]
    if req.kind == 'custom':
        return ('rank(s) %s called join(), and %s runs a Python function that a joined rank '
                'cannot mirror (broadcast_object, allgather_object, collectives.run): call it '
                'before join()' % (ranks, req.describe()))
    if req.kind == 'allgather' and not req.shard:
        # a joined rank has no tensor of its own to give
        return ('rank(s) %s called join(), and %s gathers a tensor from every rank: call it '
                'before join()' % (ranks, req.describe()))
    needs = isinstance(req.key, tuple) and _NEEDS_EVERY_SHARE.get(req.key[:1])
    if needs:
        # the joined rank's shares are not summed in (shards.JoinedShares)
        return ('rank(s) %s called join(), and %s, a share of which is the joined rank\'s: '
                'join with shard_optimizer=0, %s' % ((ranks,) + needs))
    if req.kind == 'bcast' and joined[req.root]:
        return ('%s broadcasts from rank %d, which called join() and has no value to send'
                % (req.describe(), req.root))
    return None
