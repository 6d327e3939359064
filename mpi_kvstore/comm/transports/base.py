"""What a transport for device (GPU) buffers is: the whole contract a new one implements.

A transport moves the data of one collective on one device. It does not agree with other
ranks on what runs (agreement.py and the designs do), fuse, average or compress
(reduce.py, compression/): it is handed one flat CuPy buffer of agreed size and does the
collective in place. Every rank makes the same calls in the same order on one thread per
communicator, so a transport may be collective in its constructor.

Work is ordered on the transport's ``stream`` on its ``device``: the caller queues its own
work there too (fusion, copies back, averaging, reduce.py), and calls :meth:`finish`
before it tells MXNet that the buffer is ready. A transport that lets MPI read device
memory synchronises its stream first: the caller's work before it is only queued.

Compare CuPy's ``cupyx.distributed._comm._Backend``; a new transport is one file in this
package that subclasses :class:`Transport` and is decorated with :func:`register`.
"""
import abc
import contextlib

__all__ = ['Transport', 'REGISTRY', 'register']

REGISTRY = {}   # name -> Transport subclass, in registration order


def register(cls):
    """Class decorator: make a transport available by its ``name``."""
    REGISTRY[cls.name] = cls
    return cls


class Transport(abc.ABC):
    """One communicator's collectives on one device's buffers. A subclass that leaves one
    of the five collectives out cannot be made (abc), rather than failing at its first call."""

    name = ''
    #: it may run beside another transport's collectives on other threads (NCCL may not:
    #: its kernels need one host launch order across every communicator of a device)
    concurrent_safe = True

    def __init__(self, comm, device):
        """``comm``: the host communicator (comm.Comm); ``device``: a CUDA device id.
        Runs on every rank at the same point of the collective sequence."""
        import cupy  # GPU only
        self.comm = comm
        self.device = device
        with cupy.cuda.Device(device):
            # Blocking: ordered after work on the legacy default stream (a producer that
            # used it); MXNet's own streams are synchronised before its ops complete.
            self.stream = cupy.cuda.Stream()

    @classmethod
    def usable(cls, comm):
        """(True, '') or (False, why) on this rank: whether it can run here. Called on every
        rank; the ranks then agree (transports.choose)."""
        return True, ''

    @contextlib.contextmanager
    def scope(self):
        """This transport's device and stream, current for CuPy inside the block."""
        import cupy  # optional dependency, loaded where used
        with cupy.cuda.Device(self.device), self.stream:
            yield self

    @abc.abstractmethod
    def allreduce(self, buf, algorithm='mpi'):
        """Sum of ``buf`` (flat, on ``device``) over the ranks, in place. ``algorithm`` is
        the tune table's choice for host MPI algorithms; transports that have one ignore it."""

    @abc.abstractmethod
    def bcast(self, buf, root):
        """``root``'s ``buf`` into every rank's, in place."""

    @abc.abstractmethod
    def reduce_scatter(self, send, recv, counts):
        """Sum of ``send`` (flat, on ``device``) over the ranks, piece r (``counts[r]``
        elements, the pieces consecutive in rank order) into rank r's ``recv`` (on
        ``device``). ``counts`` is agreed; pieces may differ in size and be empty."""

    @abc.abstractmethod
    def allgather(self, buf, counts, displs):
        """Every rank's piece of ``buf`` (``counts[r]`` elements at ``displs[r]``) into every
        rank's ``buf``, in place; this rank's piece is already there."""

    @abc.abstractmethod
    def alltoall(self, send, recv):
        """Piece j of ``send`` to rank j, piece i of ``recv`` from rank i: both flat on
        ``device``, cut into one piece a rank, all of one size (a compressed reduce-scatter's
        16-bit floats, compression/wire.py). Bytes only, no arithmetic."""

    def follow(self, other):
        """Order this transport's next work after everything queued on ``other``'s stream
        (control passes from one transport to another: tune's table mixes them by size).
        An event, so the host does not wait."""
        self.stream.wait_event(other.stream.record())

    def finish(self):
        """Block until every queued operation on ``stream`` is done."""
        self.stream.synchronize()

    def free(self):   # optional: a transport that holds nothing keeps this one
        """Release what the transport holds (communicators, buffers)."""
        return None
