"""The exit policy: every store still open at interpreter exit is closed, and a rank that
exits with an error never raised ends with status 1 (it cannot hide a failed collective).
"""
import atexit
import logging
import os
import sys
import threading
import weakref

# Imported before the hook below is registered, so that it runs before their own exit hooks
import mxnet  # noqa: F401

from ..comm.mpiabi import MPI
from ..errors import MPIKVStoreError

__all__ = ['LIVE', 'close_all']

log = logging.getLogger(__name__)

LIVE: weakref.WeakSet = weakref.WeakSet()   # the stores open now (MPIKVStore adds itself)
_exit_lock = threading.Lock()


@atexit.register
def close_all():
    """Close every open store (at exit; a second call finds none open); leave with status 1
    if one held an error never raised."""
    # Registered after mxnet's and mpi4py's own exit hooks, so it runs before them:
    # in-flight engine ops finish and threads stop before MPI finalizes.
    failed = False
    with _exit_lock:
        for store in list(LIVE):
            try:
                store.close()
            except MPIKVStoreError as err:
                log.critical('mpi_kvstore: rank %d exits with an error that was never raised: '
                             '%s', store.rank, err)
                failed = True
            except Exception:
                log.exception('mpi_kvstore: closing %r at exit failed', store)
                failed = True
    if failed:
        _exit_failed()


def _exit_failed():
    """An exit hook cannot change the exit status: finalize MPI, then leave with 1."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed stream must not hide the status
            pass
    try:
        if MPI.Is_initialized() and not MPI.Is_finalized():
            MPI.Finalize()
    finally:
        os._exit(1)
