"""mpi_kvstore: an MPI KVStore for Apache MXNet, embedded in MXNet's dependency engine.

    import mpi_kvstore
    kv = mpi_kvstore.create('dist_mpi', design='funneled')
    trainer = gluon.Trainer(net.collect_params(), 'sgd', {...}, kvstore=kv)

After ``import mpi_kvstore``, ``mx.kv.create('dist_mpi')`` returns the same kind
of store, configured from ``MPI_KVSTORE_*`` environment variables.
"""
from __future__ import annotations

from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

__version__ = '0.1.0'

import os as _os
import sys as _sys

if _TYPE_CHECKING:   # the store loads on first use (below); a type checker reads it now
    from .store.kvstore import MPIKVStore

# UCX's TCP keepalive off unless the user set it, here, before the user's own code can start
# MPI (mpiabi.py says why, and reads what was decided); too late once MPI has started.
_MPI = _sys.modules.get('mpi4py.MPI')
_UCX_KEEPIDLE_BY_STORE = not ('UCX_TCP_KEEPIDLE' in _os.environ
                              or (_MPI is not None and _MPI.Is_initialized()))
if _UCX_KEEPIDLE_BY_STORE:
    _os.environ['UCX_TCP_KEEPIDLE'] = 'inf'

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
    # Each public name loads its module on first use (PEP 562): the store's modules import
    # mpi4py.MPI, and that import starts MPI, which ``python -m mpi_kvstore run`` must not
    # do in the supervisor's process (its ranks start their own).
    _PUBLIC = {
        'optim.clipping': ['clip_global_norm'], 'config': ['Config', 'options_table'],
        'designs': ['DESIGNS'], 'gluon': ['DistributedTrainer', 'broadcast_parameters'],
        'store': ['MPIKVStore'],
        'errors': ['ArrayLayoutError', 'CollectiveError', 'ConfigError', 'JoinError',
                   'MPIKVStoreError', 'RankMismatchError', 'ThreadLevelError',
                   'UnknownKeyError'],
        'functional': ['allgather', 'allgather_object', 'allreduce', 'allreduce_', 'broadcast',
                       'broadcast_', 'broadcast_object', 'default_store', 'local_rank',
                       'local_size', 'rank', 'reducescatter', 'size'],
    }
    _HOME = {name: module for module, names in _PUBLIC.items() for name in names}

    def __getattr__(name):
        """A public name from its module, or a submodule (as after an eager import)."""
        import importlib  # loaded where used, as the names are
        import importlib.util
        if name in _HOME:
            value = getattr(importlib.import_module('.' + _HOME[name], __name__),
                            'NAMES' if name == 'DESIGNS' else name)
            globals()[name] = value
            return value
        if name.startswith('__') or importlib.util.find_spec('%s.%s' % (__name__, name)) is None:
            raise AttributeError('module %r has no attribute %r' % (__name__, name))
        return importlib.import_module('%s.%s' % (__name__, name))

    def __dir__():
        return sorted(set(globals()) | set(__all__))

    __all__ = ['create', 'MPIKVStore', 'DESIGNS', 'Config', 'ConfigError', 'options_table',
               'MPIKVStoreError', 'RankMismatchError', 'ThreadLevelError', 'CollectiveError',
               'UnknownKeyError', 'ArrayLayoutError', 'JoinError', 'DistributedTrainer',
               'broadcast_parameters', 'clip_global_norm', 'default_store',
               'allreduce', 'allreduce_', 'allgather', 'allgather_object', 'reducescatter',
               'broadcast',
               'broadcast_', 'broadcast_object', 'rank', 'size', 'local_rank', 'local_size']

    def create(name: str = 'dist_mpi', comm: _Any = None, **options: _Any) -> MPIKVStore:
        """Create an :class:`MPIKVStore`; options as in :mod:`mpi_kvstore.config`."""
        from .store.kvstore import MPIKVStore
        return MPIKVStore(name, comm=comm, **options)

    # mx.kv.create(name) looks the lower-cased name up here and calls what it finds with no
    # arguments (register() would key a class by its name instead); store.MPIKVStore.NAMES,
    # written here so that the store loads only when one is created.
    for _name in ('dist_mpi', 'dist_sync_mpi'):
        KVStoreBase.kv_registry[_name] = create
