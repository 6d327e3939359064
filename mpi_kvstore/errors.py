"""Every exception mpi_kvstore raises itself.

All derive from :class:`MPIKVStoreError`. Those that stand for a standard Python
error also derive from it (``ConfigError`` is a ``ValueError``, ``UnknownKeyError``
a ``KeyError``), so code written against MXNet's own stores catches them as before.
"""

__all__ = ['MPIKVStoreError', 'RankMismatchError', 'ThreadLevelError', 'CollectiveError',
           'ConfigError', 'UnknownKeyError', 'ArrayLayoutError', 'JoinError']


class MPIKVStoreError(RuntimeError):
    """Base class of the errors mpi_kvstore raises itself."""


class RankMismatchError(MPIKVStoreError):
    """Ranks issued different collectives (key, shape, dtype or kind) at the same position."""


class ThreadLevelError(MPIKVStoreError):
    """MPI was initialised with a thread level too low for the chosen design."""


class CollectiveError(MPIKVStoreError):
    """A collective pushed earlier failed inside the engine; raised on the user's thread."""


class ConfigError(MPIKVStoreError, ValueError):
    """A configuration value is invalid; the message names the option and variable."""


class UnknownKeyError(MPIKVStoreError, KeyError):
    """A key was read (pull) before any init, push or broadcast gave it a value."""

    def __str__(self):
        # KeyError's own str() quotes the whole message.
        return str(self.args[0]) if self.args else ''


class ArrayLayoutError(MPIKVStoreError):
    """The array's bytes are not in row-major order (an MKLDNN layout)."""


class JoinError(MPIKVStoreError):
    """A collective cannot be mirrored by a rank that called join()."""
