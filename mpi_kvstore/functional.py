"""The functional, Horovod-style API: collectives on NDArrays and Python objects over a
default store (``mpi_kvstore.allreduce``, ``broadcast``, ...).

Every function is collective: all ranks call it, in the same order. Array
functions are asynchronous like the store (read the result to wait); object
functions return the value.
"""
from __future__ import annotations

import threading
from typing import Any

import mxnet as mx
import numpy as np

from .comm.fusion import share
from .comm.mpiabi import MPI
from .config import launcher_local_rank
from .store.kvstore import MPIKVStore, NDArray

__all__ = ['default_store', 'allreduce', 'allreduce_', 'allgather', 'reducescatter',
           'broadcast', 'broadcast_', 'broadcast_object', 'allgather_object', 'rank', 'size',
           'local_rank', 'local_size']

_default: dict = {}
_lock = threading.Lock()


def default_store(**options: Any) -> MPIKVStore:
    """The store the helpers use when given none; created on first use (collective)."""
    with _lock:
        if 'store' not in _default:
            _default['store'] = MPIKVStore('dist_mpi', **options)
        return _default['store']


def _store(store: MPIKVStore | None) -> MPIKVStore:
    return store if store is not None else default_store()


def allreduce_(tensor: NDArray, average: bool = False, name: str = 'allreduce',
               store: MPIKVStore | None = None) -> NDArray:
    """Sum (or average) ``tensor`` over ranks, in place; returns it."""
    kv = _store(store)
    # a repeated call on the very array of its name's last one: the prepared path, checked
    # in one function (Collectives.again); anything else the full one, which says what is wrong
    if (average is True or average is False) and kv.collectives.again(name, tensor, average):
        return tensor
    return kv.collectives.array('allreduce', name, tensor, average=average)


def allreduce(tensor: NDArray, average: bool = False, name: str = 'allreduce',
              store: MPIKVStore | None = None) -> NDArray:
    """Sum (or average) over ranks into a new NDArray; ``tensor`` is left as it was."""
    return _store(store).collectives.allreduce_copy(name, tensor, average)


def broadcast_(tensor: NDArray, root: int = 0, name: str = 'broadcast',
               store: MPIKVStore | None = None) -> NDArray:
    """Overwrite ``tensor`` with root's, in place; returns it."""
    return _store(store).collectives.array('bcast', name, tensor, root=root)


def broadcast(tensor: NDArray, root: int = 0, name: str = 'broadcast',
              store: MPIKVStore | None = None) -> NDArray:
    """Root's tensor, as a new NDArray on every rank."""
    return broadcast_(tensor.copy(), root, name, store)


def broadcast_object(obj: Any, root: int = 0, store: MPIKVStore | None = None) -> Any:
    """Root's picklable object on every rank."""
    return _store(store).collectives.run(lambda comm: comm.bcast(obj, root=root), 'bcast_object')


def allgather_object(obj: Any, store: MPIKVStore | None = None) -> list:
    """A list of every rank's object, in rank order."""
    return _store(store).collectives.run(lambda comm: comm.allgather(obj), 'allgather_object')


def allgather(tensor: NDArray, name: str = 'allgather',
              store: MPIKVStore | None = None) -> NDArray:
    """Concatenate every rank's tensor along axis 0, in rank order (first dimensions may
    differ). Ranks first learn each other's shapes (a small object collective); where they
    are alike, as in training, the data moves in an allgather engine op (MPI_Allgatherv),
    asynchronous like the store; otherwise as pickled arrays."""
    store = _store(store)
    shapes = allgather_object((tuple(tensor.shape), np.dtype(tensor.dtype).str), store)
    if len(set(shapes)) == 1 and tensor.ndim > 0:
        rows, unit = tensor.shape[0], int(np.prod(tensor.shape[1:], dtype=np.int64))
        out = mx.nd.zeros((rows * len(shapes),) + tensor.shape[1:], ctx=tensor.context,
                          dtype=tensor.dtype)
        out[rows * store.rank:rows * (store.rank + 1)] = tensor
        return store.collectives.array('allgather', name, out, unit=unit)
    trailing = {shape[1:] for shape, _ in shapes}
    if len(trailing) != 1 or len({dtype for _, dtype in shapes}) != 1:
        raise ValueError('allgather: ranks hold tensors of different trailing shapes or dtypes '
                         '%s; only the first dimension may differ' % sorted(set(shapes)))
    parts = allgather_object(tensor.asnumpy(), store)
    return mx.nd.array(np.concatenate(parts), ctx=tensor.context, dtype=tensor.dtype)


def reducescatter(tensor: NDArray, average: bool = False, name: str = 'reducescatter',
                  store: MPIKVStore | None = None) -> NDArray:
    """Horovod's reducescatter: the sum (or mean) over ranks of ``tensor``, cut along axis 0
    into near-equal parts in rank order (the first ``rows % size`` ranks get a row more);
    returns this rank's part, a new NDArray. One MPI_Reduce_scatter in an engine op. Every
    rank passes the same shape, with at least one row a rank."""
    store = _store(store)
    if tensor.ndim == 0 or tensor.shape[0] < store.num_workers:
        raise ValueError('reducescatter: a tensor of shape %s cannot be cut along its first '
                         'axis into %d parts: give it at least one row a rank'
                         % (tensor.shape, store.num_workers))
    unit = int(np.prod(tensor.shape[1:], dtype=np.int64))
    summed = store.collectives.array('reducescatter', name, tensor.copy(), average=average,
                                    unit=unit)
    start, stop = share(tensor.shape[0], store.num_workers, store.rank)
    return summed[start:stop].copy()


def _comm_store(store: MPIKVStore | None) -> MPIKVStore | None:
    """The store whose communicator rank() and size() describe: the one given, else the
    default store once it exists (created on a communicator of the user's choosing, it may
    not span COMM_WORLD), else None."""
    return store if store is not None else _default.get('store')


def rank(store: MPIKVStore | None = None) -> int:
    """This process's rank in the store's communicator (COMM_WORLD before any store)."""
    found = _comm_store(store)
    return found.rank if found is not None else MPI.COMM_WORLD.Get_rank()


def size(store: MPIKVStore | None = None) -> int:
    """The number of processes of the store's communicator (COMM_WORLD's before any store)."""
    found = _comm_store(store)
    return found.num_workers if found is not None else MPI.COMM_WORLD.Get_size()


def _local():
    if 'local' not in _default:
        found = launcher_local_rank()
        if found is None:  # no launcher variable: ask MPI (a collective on COMM_WORLD)
            node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
            found = (node.Get_rank(), node.Get_size())
            node.Free()
        _default['local'] = found
    return _default['local']


def local_rank() -> int:
    """This process's index among the processes of its node: pick a GPU with it."""
    return _local()[0]


def local_size() -> int:
    """The number of processes on this process's node."""
    return _local()[1]
