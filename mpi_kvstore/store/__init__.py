"""The KVStore contract: ``MPIKVStore`` (``kvstore``), what Gluon and Module hand it
(``contract``), the key table and request building (``keys``), errors that surface on the
user's thread (``deferred``) and the bounded cache of named collectives (``namecache``).

The top of the communication stack: it may import everything below it (designs, optim,
compression, faults, engine, comm, launch) and nothing above (functional, gluon, horovod).
``mpi_kvstore.store.MPIKVStore`` is a public path.
"""
from .kvstore import MPIKVStore

__all__ = ['MPIKVStore']
