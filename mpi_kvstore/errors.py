"""Exceptions of mpi_kvstore."""

__all__ = ['MPIKVStoreError', 'RankMismatchError', 'ThreadLevelError', 'CollectiveError']


class MPIKVStoreError(RuntimeError):
    """Base class of the errors mpi_kvstore raises itself."""


class RankMismatchError(MPIKVStoreError):
    """Ranks issued different collectives (key, shape, dtype or kind) at the same position."""


class ThreadLevelError(MPIKVStoreError):
    """MPI was initialised with a thread level too low for the chosen design."""


class CollectiveError(MPIKVStoreError):
    """A collective pushed earlier failed inside the engine; raised on the user's thread."""
