"""``import mpi_kvstore.horovod as hvd``: Horovod's MXNet API (``horovod.mxnet``) on the store.

A Horovod MXNet script runs with its import line changed to this one. The names, keywords
and numbers are Horovod's: reductions average by default, ``DistributedTrainer`` and
``DistributedOptimizer`` average the gradients over the processes (so ``trainer.step(local
batch size)`` trains the model one process would train on the whole batch), ranks are ranks
of the communicator given to :func:`init`, process sets are sub-communicators.

Underneath everything is an :class:`~mpi_kvstore.store.MPIKVStore`, which keeps MXNet's sum
semantics: averaging is done here, as Horovod itself does it on a CPU (a sum, and the
optimizer's ``rescale_grad`` divided by the number of processes).

Engine ops (asynchronous, ordered with the rest of the computation by MXNet's engine):
allreduce and grouped_allreduce with Average or Sum, broadcast, allgather of alike shapes,
reducescatter, and the trainers' gradient exchange. Synchronous (they wait for their input,
run one MPI call on numpy copies in collective order, and return a finished array): Min,
Max and Product, alltoall, the object functions. docs/coming-from-horovod.md maps every name.

A top layer: it may import ``store``, ``functional`` and everything below them, and
MXNet; nothing imports it but the user.
"""

from . import elastic as elastic  # hvd.elastic: run, State, ObjectState, MXNetState, exceptions
from .basics import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    init,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
    store,
)
from .compression import (
    Compression,
)
from .environment import (
    environment_options as environment_options,  # ours, not Horovod's: kept out of __all__
)
from .ops import (
    allgather,
    allgather_object,
    allreduce,
    allreduce_,
    alltoall,
    broadcast,
    broadcast_,
    broadcast_object,
    grouped_allgather,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_reducescatter,
    reducescatter,
)
from .process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)
from .training import (
    DistributedOptimizer,
    DistributedTrainer,
    broadcast_parameters,
)

__all__ = [
    'init', 'shutdown', 'is_initialized', 'rank', 'size', 'local_rank', 'local_size',
    'cross_rank', 'cross_size', 'mpi_threads_supported', 'mpi_enabled', 'mpi_built',
    'gloo_enabled', 'gloo_built', 'nccl_built', 'ddl_built', 'ccl_built', 'cuda_built',
    'rocm_built', 'Average', 'Sum', 'Adasum', 'Min', 'Max', 'Product',
    'allreduce', 'allreduce_', 'grouped_allreduce', 'grouped_allreduce_', 'allgather',
    'grouped_allgather', 'broadcast', 'broadcast_', 'alltoall', 'reducescatter',
    'grouped_reducescatter', 'broadcast_object', 'allgather_object', 'Compression',
    'broadcast_parameters', 'DistributedTrainer', 'DistributedOptimizer', 'ProcessSet',
    'global_process_set', 'add_process_set', 'remove_process_set', 'start_timeline',
    'stop_timeline', 'store',
]

