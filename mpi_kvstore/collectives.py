"""Horovod-style collectives on NDArrays and Python objects, over a default store.

Every function is collective: all ranks call it, in the same order. Array
functions are asynchronous like the store (read the result to wait); object
functions return the value.
"""
import threading

import mxnet as mx
import numpy as np

from .comm import MPI
from .config import launcher_local_rank
from .collective import Collective
from .store import MPIKVStore

__all__ = ['default_store', 'allreduce', 'allreduce_', 'allgather', 'broadcast', 'broadcast_',
           'broadcast_object', 'allgather_object', 'rank', 'size', 'local_rank', 'local_size']

_default = {}
_lock = threading.Lock()


def default_store(**options):
    """The store the helpers use when given none; created on first use (collective)."""
    with _lock:
        if 'store' not in _default:
            _default['store'] = MPIKVStore('dist_mpi', **options)
        return _default['store']


def _store(store):
    return store if store is not None else default_store()


def _staging(store, name, tensor):
    """A buffer the store owns, reused per (name, shape, dtype, context)."""
    buffers = store.__dict__.setdefault('_helper_buffers', {})
    key = (name, tensor.shape, np.dtype(tensor.dtype), str(tensor.context))
    buf = buffers.get(key)
    if buf is None:
        buf = buffers[key] = mx.nd.zeros(tensor.shape, ctx=tensor.context, dtype=tensor.dtype)
    return buf


def _array_request(store, kind, name, tensor, root=0, average=False):
    """Run one collective on ``tensor`` in place.

    The data travels through a staging buffer written and read by MXNet's own
    copy operator: user arrays (weights after an inference forward) may sit in
    an MKLDNN layout whose bytes are not row-major, which only MXNet can read.
    """
    store._begin()
    buf = _staging(store, name, tensor)
    tensor.copyto(buf)
    req = Collective(kind, name, np.dtype(tensor.dtype), tensor.shape, array=buf, root=root,
                     average=average)
    store._submit([req], 0)
    buf.copyto(tensor)


def allreduce_(tensor, average=False, name='allreduce', store=None):
    """Sum (or average) ``tensor`` over ranks, in place; returns it."""
    _array_request(_store(store), 'allreduce', name, tensor, average=average)
    return tensor


def allreduce(tensor, average=False, name='allreduce', store=None):
    """Sum (or average) over ranks into a new NDArray."""
    return allreduce_(tensor.copy(), average, name, store)


def broadcast_(tensor, root=0, name='broadcast', store=None):
    """Overwrite ``tensor`` with root's, in place; returns it."""
    store = _store(store)
    if not 0 <= root < store.num_workers:
        raise ValueError('root %d is not a rank of a %d-process job' % (root, store.num_workers))
    _array_request(store, 'bcast', name, tensor, root=root)
    return tensor


def broadcast(tensor, root=0, name='broadcast', store=None):
    """Root's tensor, as a new NDArray on every rank."""
    return broadcast_(tensor.copy(), root, name, store)


def broadcast_object(obj, root=0, store=None):
    """Root's picklable object on every rank."""
    return _store(store).run_collective(lambda comm: comm.bcast(obj, root=root), 'bcast_object')


def allgather_object(obj, store=None):
    """A list of every rank's object, in rank order."""
    return _store(store).run_collective(lambda comm: comm.allgather(obj), 'allgather_object')


def allgather(tensor, store=None):
    """Concatenate every rank's tensor along axis 0 (first dimensions may differ)."""
    parts = allgather_object(tensor.asnumpy(), store)
    trailing = {p.shape[1:] for p in parts}
    if len(trailing) != 1:
        raise ValueError('allgather: ranks hold tensors with different trailing shapes %s'
                         % sorted(trailing))
    return mx.nd.array(np.concatenate(parts), ctx=tensor.context, dtype=tensor.dtype)


def rank():
    return MPI.COMM_WORLD.Get_rank()


def size():
    return MPI.COMM_WORLD.Get_size()


def _local():
    if 'local' not in _default:
        found = launcher_local_rank()
        if found is None:  # no launcher variable: ask MPI (a collective on COMM_WORLD)
            node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
            found = (node.Get_rank(), node.Get_size())
            node.Free()
        _default['local'] = found
    return _default['local']


def local_rank():
    """This process's index among the processes of its node: pick a GPU with it."""
    return _local()[0]


def local_size():
    return _local()[1]
