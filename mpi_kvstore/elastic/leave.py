"""How a worker whose world lost a peer leaves the process: without MPI_Finalize.

A survivor keeps the communicators of the world it lost (they are abandoned, not freed: a
collective with the dead peer may still be pending on them). At exit, MPI_Finalize tears
down the transport's endpoints to that peer; across hosts (UCX over TCP) that teardown
crashed a survivor that had finished its training (a segmentation fault after its last
step, reported by the launcher as a lost worker). Nothing of a finished worker needs MPI
any more, so once its world has lost a peer the worker closes its stores as every exit
does (store.shutdown), flushes its streams and logs, and ends the process with os._exit:
0, or 1 when an exception reached the top of the program.

What it cannot see: ``sys.exit(n)`` with n other than 0 leaves with 0 on such a worker
(an exit hook is not told the status); an uncaught exception still leaves with 1.
"""
import atexit
import logging
import os
import sys

from ..store import shutdown

__all__ = ['without_finalize', 'armed']

_state = {'armed': False, 'failed': False}


def armed():
    """Whether this process will leave without MPI_Finalize."""
    return _state['armed']


def without_finalize():
    """From now on the process leaves without MPI_Finalize (idempotent)."""
    if _state['armed']:
        return
    _state['armed'] = True
    previous = sys.excepthook

    def hook(kind, value, traceback):
        _state['failed'] = True
        previous(kind, value, traceback)
    sys.excepthook = hook
    # Registered after mpi4py's and the store's own exit hooks, so it runs before them
    atexit.register(_leave)


def _leave():
    shutdown.close_all()     # leaves with 1 itself if a store held an error never raised
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:   # a closed stream must not change the status
            pass
    os._exit(1 if _state['failed'] else 0)
