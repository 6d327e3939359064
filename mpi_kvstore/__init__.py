"""mpi_kvstore: an MPI KVStore for Apache MXNet, embedded in MXNet's dependency engine.

    import mpi_kvstore
    kv = mpi_kvstore.create('dist_mpi', design='funneled')
    trainer = gluon.Trainer(net.collect_params(), 'sgd', {...}, kvstore=kv)

After ``import mpi_kvstore``, ``mx.kv.create('dist_mpi')`` returns the same kind
of store, configured from ``MPI_KVSTORE_*`` environment variables.
"""
__version__ = '0.1.0'

try:
    from mxnet.kvstore import KVStoreBase
except ImportError as _err:
    # Without MXNet the MXNet-free parts still import: comm, reduce and transports/, which
    # run on CuPy arrays alone (the GPU tests run where MXNet cannot be installed).
    _MXNET_MISSING = ImportError(
        "mpi_kvstore needs MXNet 1.9.1: pip install 'mpi_kvstore[cpu]' for the CPU wheel, or an "
        'mxnet-cu11x==1.9.1 wheel for GPUs (docs/gpu.md); (%s)' % (_err,))

    def __getattr__(name):
        """Submodules import as usual (those that need MXNet raise for themselves); the
        store's names say why they are missing."""
        import importlib  # optional dependency, loaded where used
        import importlib.util  # optional dependency, loaded where used
        if name.startswith('__'):
            raise AttributeError(name)
        if importlib.util.find_spec('%s.%s' % (__name__, name)) is not None:
            return importlib.import_module('%s.%s' % (__name__, name))
        raise _MXNET_MISSING
else:
    from .clipping import clip_global_norm
    from .config import Config, options_table
    from .designs import NAMES as DESIGNS
    from .errors import (
        ArrayLayoutError,
        CollectiveError,
        ConfigError,
        JoinError,
        MPIKVStoreError,
        RankMismatchError,
        ThreadLevelError,
        UnknownKeyError,
    )
    from .functional import (
        allgather,
        allgather_object,
        allreduce,
        allreduce_,
        broadcast,
        broadcast_,
        broadcast_object,
        default_store,
        local_rank,
        local_size,
        rank,
        reducescatter,
        size,
    )
    from .gluon import DistributedTrainer, broadcast_parameters
    from .store import MPIKVStore

    __all__ = ['create', 'MPIKVStore', 'DESIGNS', 'Config', 'ConfigError', 'options_table',
               'MPIKVStoreError', 'RankMismatchError', 'ThreadLevelError', 'CollectiveError',
               'UnknownKeyError', 'ArrayLayoutError', 'JoinError', 'DistributedTrainer',
               'broadcast_parameters', 'clip_global_norm', 'default_store',
               'allreduce', 'allreduce_', 'allgather', 'allgather_object', 'reducescatter',
               'broadcast',
               'broadcast_', 'broadcast_object', 'rank', 'size', 'local_rank', 'local_size']

    # mx.kv.create(name) looks the lower-cased name up here and calls the class
    # with no arguments; register() would key it by the class name instead.
    for _name in MPIKVStore.NAMES:
        KVStoreBase.kv_registry[_name] = MPIKVStore

    def create(name='dist_mpi', comm=None, **options):
        """Create an :class:`MPIKVStore`; options as in :mod:`mpi_kvstore.config`."""
        return MPIKVStore(name, comm=comm, **options)
