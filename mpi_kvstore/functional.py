"""The functional, Horovod-style API: collectives on NDArrays and Python objects over a
default store (``mpi_kvstore.allreduce``, ``broadcast``, ...).

Every function is collective: all ranks call it, in the same order. Array
functions are asynchronous like the store (read the result to wait); object
functions return the value.
"""
import threading

import mxnet as mx
import numpy as np

from .config import launcher_local_rank
from .mpiabi import MPI
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


def allreduce_(tensor, average=False, name='allreduce', store=None):
    """Sum (or average) ``tensor`` over ranks, in place; returns it."""
    return _store(store).array_collective('allreduce', name, tensor, average=average)


def allreduce(tensor, average=False, name='allreduce', store=None):
    """Sum (or average) over ranks into a new NDArray."""
    return allreduce_(tensor.copy(), average, name, store)


def broadcast_(tensor, root=0, name='broadcast', store=None):
    """Overwrite ``tensor`` with root's, in place; returns it."""
    return _store(store).array_collective('bcast', name, tensor, root=root)


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


def _comm_store(store):
    """The store whose communicator rank() and size() describe: the one given, else the
    default store once it exists (created on a communicator of the user's choosing, it may
    not span COMM_WORLD), else None."""
    return store if store is not None else _default.get('store')


def rank(store=None):
    """This process's rank in the store's communicator (COMM_WORLD before any store)."""
    found = _comm_store(store)
    return found.rank if found is not None else MPI.COMM_WORLD.Get_rank()


def size(store=None):
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


def local_rank():
    """This process's index among the processes of its node: pick a GPU with it."""
    return _local()[0]


def local_size():
    return _local()[1]
