"""The KVStore contract: ``MPIKVStore`` (``kvstore``), which checks each call against what
Gluon and Module hand it (``contract``) and hands it down to units that never call it back:
the key table and request building (``keys``), the exchange of keys' collectives
(``exchange``), the optimizer inside the store (``optimizer``), the named collectives
(``collectives``, with the bounded cache of their buffers, ``namecache``, and the records
of their repeated calls, ``repeats``), the job that
submits to the design and keeps what is pending (``job``), errors that surface on the
user's thread (``deferred``), and the exit policy (``shutdown``).

The top of the communication stack: it may import everything below it (designs, optim,
compression, faults, engine, comm, launch) and nothing above (functional, gluon, horovod).
``mpi_kvstore.store.MPIKVStore`` is a public path.
"""
from .kvstore import MPIKVStore

__all__ = ['MPIKVStore']
