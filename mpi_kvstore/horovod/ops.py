"""Horovod's collectives on NDArrays: reductions, gathers, broadcasts, alltoall, objects."""
from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import mxnet as mx
import numpy as np

from .. import debug, functional
from ..comm.mpiabi import MPI
from ..engine.arrays import copy_of
from ._state import _require_init, _state
from .basics import (
    _MPI_OPS,
    _OP_NAMES,
    Adasum,
    Average,
    NDArray,
    Sum,
)
from .process_sets import ProcessSet, global_process_set

_UNNAMED = 'hvd.allreduce'   # the name of every allreduce(_) called without one


# -- argument checks --------------------------------------------------------------------------
def _op_of(op, average, what):
    if op is not None and average is not None:
        raise ValueError('%s: the op parameter supersedes average; give only one of them'
                         % what)
    if op is None:
        if average is None:
            return Average
        warnings.warn('Parameter `average` has been replaced with `op`', DeprecationWarning,
                      stacklevel=3)
        return Average if average else Sum
    if isinstance(op, bool) or op not in _OP_NAMES:
        raise ValueError('%s: unknown op %r; use one of hvd.Average, hvd.Sum, hvd.Min, hvd.Max, '
                         'hvd.Product' % (what, op))
    if op == Adasum:
        raise NotImplementedError(
            '%s: hvd.Adasum is not implemented by mpi_kvstore; use op=hvd.Average (the '
            'default, what DistributedTrainer and DistributedOptimizer do) or hvd.Sum'
            % what)
    return op


def _set_store(process_set, what, compression=None):
    """This process's store of ``process_set``; ValueError outside the set."""
    _require_init()
    if not isinstance(process_set, ProcessSet):
        raise ValueError('%s: process_set must be a ProcessSet, not %r' % (what, process_set))
    if process_set.process_set_id is None:
        raise ValueError('%s: %s is not registered: pass it to hvd.init(process_sets=[...]) '
                         'or hvd.add_process_set()' % (what, process_set))
    if process_set._store is None:
        raise ValueError('%s: rank %d is not in %s; only its ranks may call it'
                         % (what, _state['rank'], process_set))
    return process_set._store


def _set_root(process_set, root_rank, what):
    """The root's rank inside the set (root_rank is a rank of init's communicator)."""
    if isinstance(root_rank, bool) or not isinstance(root_rank, (int, np.integer)):
        raise ValueError('%s: root_rank must be an int, not %r' % (what, root_rank))
    if root_rank not in process_set.ranks:
        raise ValueError('%s: root_rank %d is not a rank of %s (ranks %s)'
                         % (what, root_rank, 'the job' if process_set is global_process_set
                            else 'the process set', process_set.ranks))
    return process_set.ranks.index(int(root_rank))


def _copy(tensor):
    """A new array of ``tensor``'s values. A legacy NDArray goes through MXNet's identity op
    in one C call (engine.arrays.copy_of): one engine op where NDArray.copy makes two (an
    allocation, then a copy); its output is row-major (and dense or sparse) as copy's is,
    also from an input in an MKLDNN layout. Any other array type copies itself."""
    if tensor.__class__ is mx.nd.NDArray:
        return copy_of(tensor)
    return tensor.copy()


def _scale(tensor, factor):
    """tensor *= factor, in place, as an engine op, or three (astype, the multiply, astype
    back: integer tensors scaled in float64, float16 in float32): debug counter ``hvd``:
    'scale_op', once a call, where a factor could not be folded into the reduction (_fold)."""
    if factor == 1.0:
        return tensor
    debug.count('hvd', 'scale_op')
    dtype = np.dtype(tensor.dtype)
    if dtype == np.float16:
        # in float32, as Horovod scales float16 (MXNet's float16 op rounds the factor to
        # float16 first: 0.1 then differs by up to an ulp)
        tensor[:] = (tensor.astype('float32') * factor).astype(dtype)
    elif dtype.kind == 'f':
        tensor *= factor
    else:
        tensor[:] = (tensor.astype('float64') * factor).astype(tensor.dtype)
    return tensor


# -- reductions -------------------------------------------------------------------------------
def _mpi_reduce(kv, tensor, op, pre=1.0, post=1.0):
    """Min, Max, Product: MPI_Allreduce of a numpy copy in collective order (synchronous),
    the copy scaled by ``pre`` before and the result by ``post`` after (_scaled: in numpy,
    as _scale's engine ops would, so the tensor is written once, by the result)."""
    dtype = np.dtype(tensor.dtype)
    wire = np.float32 if dtype == np.float16 else dtype   # MPI has no half type
    data = _scaled(np.ascontiguousarray(tensor.asnumpy(), dtype=wire), pre, dtype)
    mpi_op = getattr(MPI, _MPI_OPS[op])

    def reduce(comm):
        out = np.empty_like(data)
        comm.Allreduce(data, out, op=mpi_op)
        return out

    result = kv.collectives.run(reduce, 'hvd.allreduce.%s' % _OP_NAMES[op].lower())
    result = _scaled(result, post, dtype)
    tensor[:] = mx.nd.array(result.astype(dtype), ctx=tensor.context, dtype=dtype)
    return tensor


def _scaled(data, factor, dtype):
    """``data`` (the wire's copy of a ``dtype`` tensor) times ``factor`` as _scale scales
    the tensor: a float in its own precision (float16 in float32, rounded to float16), an
    integer in float64, truncated."""
    if factor == 1.0:
        return data
    if dtype.kind != 'f':
        return (data.astype(np.float64) * factor).astype(data.dtype)
    if dtype == data.dtype:
        return data * dtype.type(factor)
    # float16 on a float32 wire: the value the tensor would hold, scaled, then rounded
    data = data.astype(dtype).astype(data.dtype) * data.dtype.type(factor)
    return data.astype(dtype).astype(data.dtype)


# the scaling of a plain call (Collectives' key for it: its records are found again by
# identity)
_PLAIN = (1.0, 1.0)
_OWN_PRECISION = (np.dtype(np.float32), np.dtype(np.float64))
# what an Average's records are kept and found under (Collectives.again's ``mean``): not the
# store's True, whose integer mean floor-divides (functional.allreduce_(average=True)) where
# Horovod's truncates, so that neither API's repeat takes a record of the other's on one
# name and store ([-3] and [0] averaged: -2 by the store, -1 by Horovod)
_AVERAGE = 'hvd.Average'


def _scale_of(pre, post):
    """The scaling a call's records are kept and found under: _PLAIN (found by identity)
    or the factors as given."""
    return _PLAIN if pre == 1.0 and post == 1.0 else (pre, post)


def _fold(dtype, mean, pre, post, size):
    """How a Sum or Average with scale factors runs on a tensor of ``dtype``: (prescale
    as an engine op before, the reduction's average and factor, postscale as an engine op
    after); 1.0: no op. float32 and float64 fold both factors into the reduction's one
    multiply after the sum (by pre * post, divided by the size for an Average): the result
    differs from Horovod's post * sum(pre * x) only by rounding. Others keep the prescale
    as an op: a float16 one guards the sum against overflow, an integer one truncates each
    element before the sum. An integer Average and postscale fold as the one multiply in
    float64, truncated, that Horovod (and this module before) applied after the sum.
    One rank (whose reduction does nothing) keeps the factors as ops."""
    if size == 1:
        return pre, mean, 1.0, post
    if dtype in _OWN_PRECISION:
        return 1.0, mean, pre * post, 1.0
    if dtype.kind == 'f':
        return pre, mean, post, 1.0
    if dtype.kind in 'iu':
        return pre, False, post / size if mean else post, 1.0
    return pre, False, 1.0, post / size if mean else post


def _allreduce_inplace(tensors, op, names, prescale_factor, postscale_factor, process_set,
                       what, again=True, group=None, sources=None):
    """op over the set of each tensor, in place (collectives.allreduce). A Sum or
    Average and its scale factors are the reduction's own (_fold: each tensor's request
    carries them, one engine op a call); Min/Max/Product are collectives of their own, on
    a numpy copy, which takes the factors (_mpi_reduce: no engine op of their own). A call
    on the very arrays of its names' last calls takes the store's prepared path (their
    dtypes known, their requests and engine call prepared); ``again=False``: the tensors
    are fresh copies, which never come again, of ``sources`` where given
    (collectives.allreduce remembers them for its again_copy)."""
    kv = _set_store(process_set, what)
    if op in _MPI_OPS:
        for tensor in tensors:
            _mpi_reduce(kv, tensor, op, prescale_factor, postscale_factor)
        return tensors
    mean = op == Average
    # the set's store spans exactly its ranks
    folds = [_fold(dtype, mean, prescale_factor, postscale_factor, kv.num_workers)
             for dtype in kv.collectives.dtypes(names, tensors)]
    if any(fold[0] != 1.0 for fold in folds):
        # what the store would reject the call for, raised before a prescale op changes
        # a tensor: a rejected call leaves its tensors as they were
        kv.collectives.check(names, tensors)
    plain = True   # no op of its own: its records may be found again (Collectives.again)
    for tensor, (pre, _, _, post) in zip(tensors, folds):
        if pre != 1.0:
            _scale(tensor, pre)
        plain = plain and pre == 1.0 and post == 1.0
    scale = _scale_of(prescale_factor, postscale_factor)
    # the factors as given join each request's signature: ranks that split one product
    # differently, or prescale an integer differently, fail as Horovod's do
    kv.collectives.allreduce(names, tensors, average=[f[1] for f in folds], again=again,
                             group=group, sources=sources, factors=[f[2] for f in folds],
                             repeat_as=(mean and _AVERAGE, scale) if plain else (None, None),
                             scale=None if scale is _PLAIN else scale)
    for tensor, fold in zip(tensors, folds):
        if fold[3] != 1.0:
            _scale(tensor, fold[3])
    return tensors


def allreduce_(tensor: NDArray, average: bool | None = None, name: str | None = None,
               priority: int = 0, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set, op: int | None = None) -> NDArray:
    """Horovod's in-place allreduce: ``postscale * op(prescale * tensor)`` over the set's
    processes; op defaults to Average. Returns ``tensor``. ``priority`` is accepted: these
    collectives run in call order."""
    if (op is None or (op.__class__ is int and (op == Sum or op == Average))) \
            and average is None:
        # a repeated call: the store's prepared path, checked in one function
        kv = getattr(process_set, '_store', None)
        scale = _scale_of(prescale_factor, postscale_factor)
        mean = op != Sum and _AVERAGE
        if kv is not None and (kv.collectives.again(name, tensor, mean, scale) if name
                               else kv.collectives.again_unnamed(tensor, mean, scale)):
            return tensor
    op = _op_of(op, average, 'allreduce_')
    _allreduce_inplace([tensor], op, [name or _UNNAMED], prescale_factor,
                       postscale_factor, process_set, 'allreduce_')
    if not name:   # the record its next call finds by the tensor (one name for all)
        _set_store(process_set, 'allreduce_').collectives.remember_unnamed(_UNNAMED, tensor)
    return tensor


def allreduce(tensor: NDArray, average: bool | None = None, name: str | None = None,
              priority: int = 0, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set, op: int | None = None) -> NDArray:
    """As :func:`allreduce_`, into a new NDArray; ``tensor`` is left as it was."""
    if (op is None or (op.__class__ is int and (op == Sum or op == Average))) \
            and average is None:
        # a repeated call on the very same input: its copy reduced as the last one was, in
        # one function (Collectives.again_copy)
        kv = getattr(process_set, '_store', None)
        if kv is not None:
            found = kv.collectives.again_copy(name or _UNNAMED, tensor, op != Sum and _AVERAGE,
                                              _scale_of(prescale_factor, postscale_factor))
            if found is not None:
                return found
    op = _op_of(op, average, 'allreduce')
    _set_store(process_set, 'allreduce')
    return _allreduce_inplace([_copy(tensor)], op, [name or _UNNAMED], prescale_factor,
                              postscale_factor, process_set, 'allreduce', again=False,
                              sources=[tensor])[0]


def grouped_allreduce_(tensors: list[NDArray], average: bool | None = None,
                       name: str | None = None, priority: int = 0, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set,
                       op: int | None = None) -> list[NDArray]:
    """allreduce_ of each tensor of the list, in place; returns the list."""
    if (op is None or (op.__class__ is int and (op == Sum or op == Average))) \
            and average is None:
        # a repeated call: the store's prepared path for the whole list, in one function
        kv = getattr(process_set, '_store', None)
        if kv is not None and kv.collectives.again_group(
                name or 'hvd.grouped_allreduce', tensors, op != Sum and _AVERAGE,
                _scale_of(prescale_factor, postscale_factor)):
            return tensors
    op = _op_of(op, average, 'grouped_allreduce_')
    _grouped(list(tensors), op, name, prescale_factor, postscale_factor, process_set,
             'grouped_allreduce_')
    return tensors


def _grouped(tensors, op, name, prescale_factor, postscale_factor, process_set, what,
             again=True):
    base = name or 'hvd.grouped_allreduce'
    return _allreduce_inplace(tensors, op, ['%s.%d' % (base, i) for i in range(len(tensors))],
                              prescale_factor, postscale_factor, process_set, what, again,
                              group=base)


def grouped_allreduce(tensors: Sequence[NDArray], average: bool | None = None,
                      name: str | None = None, priority: int = 0, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set,
                      op: int | None = None) -> list[NDArray]:
    """grouped_allreduce_ into new NDArrays; the inputs are left as they were."""
    op = _op_of(op, average, 'grouped_allreduce')
    if tensors:
        _set_store(process_set, 'grouped_allreduce')
    return _grouped([_copy(t) for t in tensors], op, name, prescale_factor, postscale_factor,
                    process_set, 'grouped_allreduce', again=False)


def reducescatter(tensor: NDArray, op: int = Average, name: str | None = None,
                  priority: int = 0, process_set: ProcessSet = global_process_set,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> NDArray:
    """The Average (default) or Sum over the set, cut along axis 0 in rank order (the first
    ``rows % size`` ranks get a row more): this rank's part, a new NDArray."""
    op = _op_of(op, None, 'reducescatter')
    if op not in (Average, Sum):
        raise ValueError('reducescatter: op must be hvd.Average or hvd.Sum, not hvd.%s'
                         % _OP_NAMES[op])
    kv = _set_store(process_set, 'reducescatter')
    if tensor.ndim == 0:
        raise ValueError('reducescatter does not support scalar inputs')
    source = _scale(tensor.copy(), prescale_factor) if prescale_factor != 1.0 else tensor
    part = functional.reducescatter(source, average=False, name=name or 'hvd.reducescatter',
                                    store=kv)
    # the set's store spans exactly its ranks
    factor = postscale_factor / kv.num_workers if op == Average else postscale_factor
    return _scale(part, factor)


def grouped_reducescatter(tensors: Sequence[NDArray], op: int = Average,
                          name: str | None = None, priority: int = 0,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[NDArray]:
    """:func:`reducescatter` of each tensor of the list: this rank's parts, new NDArrays."""
    base = name or 'hvd.grouped_reducescatter'
    return [reducescatter(t, op, '%s.%d' % (base, i), priority, process_set, prescale_factor,
                          postscale_factor) for i, t in enumerate(tensors)]


# -- gathers and broadcasts -------------------------------------------------------------------
def allgather(tensor: NDArray, name: str | None = None, priority: int = 0,
              process_set: ProcessSet = global_process_set) -> NDArray:
    """Every set member's tensor concatenated along axis 0 in rank order (first dimensions
    may differ), a new NDArray."""
    kv = _set_store(process_set, 'allgather')
    return functional.allgather(tensor, name=name or 'hvd.allgather', store=kv)


def grouped_allgather(tensors: Sequence[NDArray], name: str | None = None, priority: int = 0,
                      process_set: ProcessSet = global_process_set) -> list[NDArray]:
    """:func:`allgather` of each tensor of the list: new NDArrays, in the list's order."""
    base = name or 'hvd.grouped_allgather'
    return [allgather(t, '%s.%d' % (base, i), priority, process_set)
            for i, t in enumerate(tensors)]


def broadcast_(tensor: NDArray, root_rank: int, name: str | None = None, priority: int = 0,
               process_set: ProcessSet = global_process_set) -> NDArray:
    """Overwrite ``tensor`` with ``root_rank``'s (a rank of init's communicator); returns it."""
    kv = _set_store(process_set, 'broadcast_')
    root = _set_root(process_set, root_rank, 'broadcast_')
    return kv.collectives.array('bcast', name or 'hvd.broadcast', tensor, root=root)


def broadcast(tensor: NDArray, root_rank: int, name: str | None = None, priority: int = 0,
              process_set: ProcessSet = global_process_set) -> NDArray:
    """``root_rank``'s tensor as a new NDArray on every member; ``tensor`` is left as it was."""
    kv = _set_store(process_set, 'broadcast')
    root = _set_root(process_set, root_rank, 'broadcast')
    return kv.collectives.array('bcast', name or 'hvd.broadcast', tensor.copy(), root=root)


def alltoall(tensor: NDArray, splits: NDArray | Sequence[int] | None = None,
             name: str | None = None, priority: int = 0,
             process_set: ProcessSet = global_process_set
             ) -> NDArray | tuple[NDArray, NDArray]:
    """Send ``splits[i]`` rows of ``tensor`` (in order, along axis 0) to the set's i-th rank
    and return the rows received, concatenated in rank order (the splits may add up to fewer
    rows than the tensor has, as in Horovod). Without ``splits`` the rows
    are cut into equal parts (their number must divide by the set's size) and the result
    alone is returned; with it, also the rows received from each rank (an int32 NDArray).
    Synchronous: MPI_Alltoallv of a numpy copy in collective order."""
    kv = _set_store(process_set, 'alltoall')
    count = kv.num_workers   # the set's store spans exactly its ranks
    if tensor.ndim == 0:
        raise ValueError('alltoall does not support scalar inputs')
    rows = tensor.shape[0]
    if splits is None:
        if rows % count:
            raise ValueError('alltoall: %d rows cannot be cut into %d equal parts; pass splits'
                             % (rows, count))
        sends = [rows // count] * count
    else:
        sends = [int(s) for s in (splits.asnumpy() if isinstance(splits, mx.nd.NDArray)
                                  else np.asarray(splits)).ravel()]
        if len(sends) != count or min(sends) < 0 or sum(sends) > rows:
            raise ValueError('alltoall: splits %s must hold %d counts >= 0 that add up to at '
                             'most the %d rows of the tensor' % (sends, count, rows))
    data = np.ascontiguousarray(tensor.asnumpy()[:sum(sends)])   # as Horovod, rows past
    # the splits' sum stay here
    row_bytes = data.itemsize * int(np.prod(data.shape[1:], dtype=np.int64))

    def exchange(comm):
        received = comm.alltoall(sends)
        out = np.empty((sum(received),) + data.shape[1:], dtype=data.dtype)
        send_counts = [s * row_bytes for s in sends]
        recv_counts = [r * row_bytes for r in received]
        comm.Alltoallv([data.view(np.uint8).ravel(), (send_counts, None), MPI.BYTE],
                       [out.view(np.uint8).ravel(), (recv_counts, None), MPI.BYTE])
        return out, received

    out, received = kv.collectives.run(exchange, name or 'hvd.alltoall')
    result = mx.nd.array(out, ctx=tensor.context, dtype=tensor.dtype)
    if splits is None:
        return result
    return result, mx.nd.array(received, ctx=mx.cpu(), dtype='int32')


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """``root_rank``'s picklable object, returned on every member."""
    kv = _set_store(process_set, 'broadcast_object')
    root = _set_root(process_set, root_rank, 'broadcast_object')
    return functional.broadcast_object(obj, root=root, store=kv)


def allgather_object(obj: Any, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """A list of every member's picklable object, in rank order."""
    kv = _set_store(process_set, 'allgather_object')
    return functional.allgather_object(obj, store=kv)

