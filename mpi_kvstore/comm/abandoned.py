"""What a lost world left pending, kept for the life of the process.

MPI never completes a collective whose peer is gone, yet it goes on moving what the
surviving peers send: at any later progress (the next world's Accept, Merge or collective)
data may land in the request's buffers and in MPICH's own, which the request owns. An
mpi4py ``Request`` that is garbage collected frees its handle (``MPI_Request_free``) and
drops the buffers it held, so MPI then writes into freed memory. Survivors that dropped
their requests this way died inside ``MPI_Comm_accept`` and ``MPI_Intercomm_merge`` while
re-forming ("double free or corruption", segmentation faults), with UCX and with OFI alike;
with the requests kept, the same kills re-formed cleanly.

So whoever gives up on a request because its peer is lost hands it here, with anything
else that owns memory the request addresses (a design's fusion buffers, the arrays of its
calls). The cost is the memory of the collectives in flight at each loss.
"""
import threading

__all__ = ['keep', 'count']

_kept: list = []
_lock = threading.Lock()


def keep(*objects):
    """Keep ``objects`` (requests, buffers, whatever owns them) alive until the process ends."""
    with _lock:
        _kept.extend(obj for obj in objects if obj is not None)


def count():
    """How many objects are kept."""
    with _lock:
        return len(_kept)
