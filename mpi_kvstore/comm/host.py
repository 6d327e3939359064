"""The host communicator: MPI collectives on host buffers.

A :class:`Comm` owns one duplicate of the user's communicator, so library traffic never
mixes with the user's own messages. Host buffers go to MPI as they are, by the algorithm
the tune table gives their size (tuning.Table), through the hosts where the hierarchy
applies (hierarchy.py), polled with sleeps under progress (progress.py). Device (CuPy)
buffers go to the device transport that the ranks agreed on (routing.py).

On an elastic world (:meth:`Comm.abortable`) the calls that block in MPI (the broadcast, the
barrier) take polled nonblocking forms instead, whose waits the world's abort check can end
when a peer is lost; :class:`PolledComm` does the same for a function of the communicator
(the Python-object collectives).
"""
import logging

import numpy as np
from mpi4py.MPI import pickle

from .. import debug
from . import abandoned
from .broadcast import ByTable, Polled, table_choice
from .fusion import BufferPool, pieces
from .hierarchy import Hierarchy, PairedCalls
from .mpiabi import MPI, handle
from .progress import AGREEMENT_POLL_US, PROGRESS_TESTS, prepare, wait_polling
from .routing import DeviceRouter
from .tuning import Choice

__all__ = ['Comm', 'MPI', 'PolledComm']

log = logging.getLogger(__name__)

_SENDRECV_TAG = 17   # point-to-point on this Comm's own duplicate: no other tag is used
_HIERARCHICAL, _FLAT = Choice('hierarchical', None), Choice('mpi', None)   # shares' defaults


def _duplicate(comm):
    """A duplicate of ``comm`` (MPI_Comm_idup, polled: an elastic world's abort check ends
    the wait when a peer is lost while the world re-forms)."""
    if comm.Get_size() == 1:
        return comm.Dup()
    dup, request = comm.Idup()
    try:
        wait_polling(request, AGREEMENT_POLL_US)
    except BaseException:
        abandoned.keep(dup)   # MPI may still complete it
        raise
    return dup


def _is_device(buf):
    return not isinstance(buf, np.ndarray)


class Comm:
    """Collectives on one duplicated communicator.

    ``hierarchical`` ('auto', 'on', 'off') lets :meth:`allreduce` follow the hosts where
    the ranks span several hosts and some host runs more than one of them (hierarchy.py);
    ``bcast``, the agreement's ``check_min`` and ``start_min``, and Python collectives on
    ``mpi`` stay flat. ``progress``: (progress_sleep_us, progress_min_bytes) of the
    options; ``table``: a tuning.Table or None; ``gpu_transport`` and ``concurrent``: how
    device buffers travel (routing.DeviceRouter). Every choice depends only on agreed
    things (the options, which the hierarchy checks; the size; the table), so every rank
    makes the same calls.
    """

    def __init__(self, comm, hierarchical='auto', progress=(0.0, 0), cuda_aware_setting='auto',
                 table=None, gpu_transport='auto', concurrent=False):
        self._progress_us, self._progress_min = progress
        self.cuda_aware_setting = cuda_aware_setting
        self._table = table
        self.mpi = _duplicate(comm)
        self.rank = self.mpi.Get_rank()
        self.size = self.mpi.Get_size()
        self.handle = handle(self.mpi)   # for native ops
        prepare()    # the compiled wait, here rather than inside a first collective
        self._scratch = BufferPool()     # the piece buffer of reduce-scatter
        self.router = DeviceRouter(self, gpu_transport,
                                   table.device if table is not None else None, concurrent,
                                   table.device_ops if table is not None else None)
        if table is not None and table.needs_hierarchy and hierarchical == 'auto':
            hierarchical = 'on'   # the table sends some sizes through the hosts
        try:
            self.hierarchy = Hierarchy(self.mpi, hierarchical)
        except BaseException:
            self.mpi.Free()
            raise
        self._broadcast = ByTable(self.mpi, table, self.hierarchy)   # the table's broadcast rows
        self._barrier = self.mpi.Barrier

    def abortable(self):
        """Make the broadcast and the barrier polled nonblocking calls (MPI_Ibcast,
        MPI_Ibarrier under progress.wait_polling), whose wait an elastic world's abort check
        ends when a peer is lost; the other calls are polled already where
        progress_min_bytes is 0 and nothing is hierarchical or tabled (store.kvstore's
        elastic options). Every rank calls it, right after construction: a blocking call
        never matches a nonblocking one. Returns this communicator."""
        self._broadcast = Polled(self.mpi, self._wait_abortable)
        self._barrier = lambda: self._wait_abortable(self.mpi.Ibarrier())
        return self

    def _wait_abortable(self, request):
        wait_polling(request, self._progress_us or AGREEMENT_POLL_US, PROGRESS_TESTS)

    # The hierarchy's state, as the compression and the tests read it.
    @property
    def hierarchical(self):
        return self.hierarchy.active

    @property
    def uniform_hierarchy(self):
        """The hierarchy is built and every host runs as many ranks (node and cross)."""
        return self.hierarchy.active and self.hierarchy.uniform

    # -- device buffers --------------------------------------------------------
    def device_transport(self, device, nbytes=None, op='allreduce'):
        """The transport for a device buffer of ``nbytes`` in collective ``op`` ('allreduce'
        or a key of tuning.OPS: the table's rows for it; collective on first use)."""
        return self.router.transport(device, nbytes, op)

    # -- collectives -----------------------------------------------------------
    def _algorithm(self, nbytes):
        if self._table is not None:
            return self._table.choose(nbytes)
        return 'hierarchical' if self.hierarchy.takes(nbytes) else 'mpi'

    def allreduce(self, buf):
        """Sum over ranks in place: a device buffer through its transport, a host buffer by
        the tune table where there is one, else through the hosts from the hierarchy's
        smallest size on, else MPI_Allreduce."""
        self.allreduce_with(buf, self._algorithm(buf.nbytes))

    def allreduce_with(self, buf, algorithm):
        """Allreduce in place with the named algorithm (tuning.LOSSLESS)."""
        self._route(buf, lambda transport, data: transport.allreduce(data, algorithm),
                    lambda data: self.allreduce_host(data, algorithm))

    def _route(self, buf, on_device, on_host, op='allreduce'):
        """``on_device(transport, data)`` for a device buffer, through the transport of its
        size in ``op``; ``on_host(buf)`` for a host one; nothing at one rank."""
        if self.size == 1:
            return
        if _is_device(buf):
            self.router.run(buf, on_device, op=op)
        else:
            on_host(buf)

    def allreduce_host(self, data, algorithm):
        """Allreduce in place with the named algorithm: 'mpi' (MPI_Allreduce, polled under
        progress), 'rsag' (reduce-scatter then allgather) or 'hierarchical' (through the
        hosts; 'mpi' where it does not apply). ``data``: host memory, or device memory for a
        CUDA-aware MPI (transports/cuda_mpi)."""
        if self.size == 1:
            return
        debug.count('algorithm', algorithm)
        if algorithm == 'hierarchical' and self.hierarchy.active:
            self.hierarchy.allreduce(data, self._scratch)
        elif algorithm == 'rsag':
            self._allreduce_rsag(data)
        elif self._progress_us and data.nbytes >= self._progress_min:
            self.wait(self.mpi.Iallreduce(MPI.IN_PLACE, data, op=MPI.SUM))
        else:
            self.mpi.Allreduce(MPI.IN_PLACE, data, op=MPI.SUM)

    def _allreduce_rsag(self, data):
        """Reduce-scatter, then allgather, on the flat communicator (in place in data)."""
        counts, displs = pieces(data.size, self.size)
        piece = self._scratch.get(data, counts[self.rank])
        run = PairedCalls()
        run(self.mpi.Reduce_scatter, data, piece, counts, op=MPI.SUM)
        run(self.mpi.Allgatherv, piece, (data, (counts, displs)))
        run.raise_first()

    def bcast(self, buf, root):
        self._route(buf, lambda transport, data: transport.bcast(data, root),
                    lambda data: self.bcast_host(data, root), 'broadcast')

    def bcast_host(self, data, root):
        self._broadcast(data, root)

    def broadcast_choice(self, nbytes):
        """The Choice a host broadcast of ``nbytes`` takes (broadcast.ByTable.choose)."""
        return self._broadcast.choose(nbytes)

    def _shares_through_hosts(self, op, nbytes):
        """A reduce-scatter or allgather (``op``) of ``nbytes`` through the hosts: the tune
        table's row where it has one for ``op``, else the hierarchy's default."""
        default = _HIERARCHICAL if self.hierarchy.takes_shares(nbytes) else _FLAT
        choice = table_choice(self._table, op, nbytes, default)
        return choice.algorithm == 'hierarchical' and self.hierarchy.grid is not None

    def barrier(self):
        self._barrier()

    def allgather(self, send, recv):
        """Every rank's ``send`` (host buffers, one size everywhere) into ``recv``, in rank
        order."""
        self._polled(self.mpi.Iallgather, self.mpi.Allgather, send, recv)

    def alltoall(self, send, recv, nbytes=None):
        """Chunk j of ``send`` to rank j; chunk i of ``recv`` from rank i. Device buffers go
        through the transport the table's alltoall rows give ``nbytes`` (an agreed size;
        default ``send.nbytes``), queued on its stream: the caller finishes that transport,
        as reduce.py's scope does for a bucket."""
        if _is_device(send):
            if self.size == 1:
                recv[...] = send
            else:
                self.router.run(send, lambda transport, data, into: transport.alltoall(data, into),
                                recv, op='alltoall', nbytes=nbytes)
            return
        self._polled(self.mpi.Ialltoall, self.mpi.Alltoall, send, recv)

    def _polled(self, start, blocking, *args):
        """``start(*args)`` waited for with sleeps under progress, else ``blocking(*args)``."""
        if self._progress_us:
            self.wait(start(*args))
        else:
            blocking(*args)

    def reduce_scatter(self, send, recv, counts):
        """Sum of ``send`` over the ranks, piece r (``counts[r]`` elements, in rank order)
        into rank r's ``recv``: device buffers (both on one device) through their
        transport; host buffers through the hosts where the hierarchy takes them
        (hierarchy.Grid), else MPI_Reduce_scatter."""
        if _is_device(send):
            if self.size == 1:
                recv[...] = send[:recv.size]
            else:
                self.router.run(send, lambda transport, data, into:
                                transport.reduce_scatter(data, into, counts), recv,
                                op='reducescatter')
            return
        if self._shares_through_hosts('reducescatter', send.nbytes):
            debug.count('algorithm', 'hierarchical reducescatter')
            self.hierarchy.grid.reduce_scatter(send, recv, counts)
            return
        self.reduce_scatter_flat(send, recv, counts)

    def reduce_scatter_flat(self, send, recv, counts):
        """MPI_Reduce_scatter on this communicator: host memory, or device memory for a
        CUDA-aware MPI (transports/cuda_mpi)."""
        self._polled(self.mpi.Ireduce_scatter, self.mpi.Reduce_scatter, send, recv, counts,
                     MPI.SUM)

    def allgather_in_place(self, buf, counts, displs):
        """Every rank's piece of ``buf`` (``counts[r]`` elements at ``displs[r]``) into every
        rank's ``buf``; this rank's piece is already in place. A device buffer goes through
        its transport; a host one through the hosts where the hierarchy takes it
        (hierarchy.Grid), else MPI_Allgatherv."""
        if _is_device(buf):
            if self.size > 1:
                self.router.run(buf, lambda transport, data:
                                transport.allgather(data, counts, displs), op='allgather')
            return
        if self._shares_through_hosts('allgather', buf.itemsize * sum(counts)):
            debug.count('algorithm', 'hierarchical allgather')
            self.hierarchy.grid.allgather(buf, counts, displs)
            return
        self.allgather_flat(buf, counts, displs)

    def allgather_flat(self, buf, counts, displs):
        """MPI_Allgatherv in place on this communicator: host memory, or device memory for a
        CUDA-aware MPI (transports/cuda_mpi)."""
        self._polled(self.mpi.Iallgatherv, self.mpi.Allgatherv, MPI.IN_PLACE,
                     (buf, (counts, displs)))

    def start_alltoall(self, send, recv):
        """Non-blocking alltoall of host buffers; finish it with :meth:`wait`."""
        return self.mpi.Ialltoall(send, recv)

    def start_allgather(self, buf):
        """Non-blocking in-place allgather of a host buffer; finish it with :meth:`wait`."""
        return self.mpi.Iallgather(MPI.IN_PLACE, buf)

    def wait(self, request):
        """Wait for a request: polled with sleeps under progress, else blocking."""
        if self._progress_us:
            wait_polling(request, self._progress_us, PROGRESS_TESTS)
        else:
            request.Wait()

    def sendrecv(self, send, dest, recv, source):
        """Send ``send`` to rank ``dest`` while receiving ``recv`` from ``source`` (host
        buffers)."""
        if self._progress_us:
            incoming = self.mpi.Irecv(recv, source=source, tag=_SENDRECV_TAG)
            outgoing = self.mpi.Isend(send, dest=dest, tag=_SENDRECV_TAG)
            self.wait(incoming)
            self.wait(outgoing)
        else:
            self.mpi.Sendrecv(send, dest, _SENDRECV_TAG, recv, source, _SENDRECV_TAG)

    def set_progress(self, sleep_us):
        """progress_sleep_us from the next call on (autotune). Every rank must change it at
        the same call of this communicator: a blocking call never matches a non-blocking one."""
        self._progress_us = sleep_us

    def start_min(self, msg):
        """Non-blocking elementwise MIN of an int32 message, in place."""
        return self.mpi.Iallreduce(MPI.IN_PLACE, msg, op=MPI.MIN)

    def check_min(self, msg):
        """Blocking elementwise MIN of an int32 message, in place. Polled under progress, as
        chained's compiled op polls its agreement: an MPI_Allreduce on one rank never
        matches an MPI_Iallreduce on another."""
        if self.size > 1 and self._progress_us:
            wait_polling(self.mpi.Iallreduce(MPI.IN_PLACE, msg, op=MPI.MIN), AGREEMENT_POLL_US)
        else:
            self.mpi.Allreduce(MPI.IN_PLACE, msg, op=MPI.MIN)

    def free(self):
        try:
            if not MPI.Is_finalized():
                self.hierarchy.free()
                self._scratch.clear()
                self.router.free()
                self.mpi.Free()
        except MPI.Exception:
            log.debug('communicator free failed', exc_info=True)


class PolledComm:
    """An mpi4py communicator whose collectives are polled nonblocking calls waited for by
    progress.wait_polling (every ``poll_us`` at most), so that an elastic world's abort check
    can end them: what store.collectives hands a function of the communicator on such a
    world (broadcast_object, allgather_object, the optimizer's gathers). The Python-object
    ``bcast``, ``allgather`` and ``alltoall`` send the pickles' lengths, then their bytes;
    the buffer collectives (``Bcast``, ``Allreduce``, ``Allgather``, ``Allgatherv``,
    ``Alltoall``, ``Alltoallv``, ``Reduce_scatter``, ``Barrier``) take their ``I`` forms;
    the rest is the communicator's own."""

    _BUFFER_CALLS = ('Bcast', 'Allreduce', 'Allgather', 'Allgatherv', 'Alltoall', 'Alltoallv',
                     'Reduce_scatter', 'Barrier')

    def __init__(self, mpi, poll_us):
        self.mpi, self._poll_us = mpi, max(1.0, float(poll_us or AGREEMENT_POLL_US))

    def __getattr__(self, name):
        if name in PolledComm._BUFFER_CALLS:
            start = getattr(self.mpi, 'I' + name[0].lower() + name[1:])
            return lambda *args, **kwargs: self._wait(start(*args, **kwargs))
        return getattr(self.mpi, name)

    def _wait(self, request):
        wait_polling(request, self._poll_us, PROGRESS_TESTS)

    def barrier(self):
        self.Barrier()

    def bcast(self, obj, root=0):
        """``root``'s picklable object on every rank."""
        data = pickle.dumps(obj) if self.mpi.Get_rank() == root else b''
        length = np.array([len(data)], np.int64)
        self.Bcast(length, root=root)
        buf = np.frombuffer(data, np.uint8).copy() if data else np.empty(int(length[0]), np.uint8)
        self.Bcast(buf, root=root)
        return obj if self.mpi.Get_rank() == root else pickle.loads(buf.tobytes())

    def allgather(self, obj):
        """Every rank's picklable object, in rank order."""
        data = np.frombuffer(pickle.dumps(obj), np.uint8)
        lengths = np.empty(self.mpi.Get_size(), np.int64)
        self.Allgather(np.array([data.size], np.int64), lengths)
        out = np.empty(int(lengths.sum()), np.uint8)
        self.Allgatherv(data, (out, (lengths.tolist(), _starts(lengths))))
        return [pickle.loads(out[lo:lo + n].tobytes())
                for lo, n in zip(_starts(lengths), lengths)]

    def alltoall(self, objs):
        """Object j of ``objs`` to rank j; the list of what each rank sent here."""
        size = self.mpi.Get_size()
        if len(objs) != size:
            raise ValueError('alltoall: %d objects for %d ranks' % (len(objs), size))
        pieces = [np.frombuffer(pickle.dumps(obj), np.uint8) for obj in objs]
        sent = np.array([p.size for p in pieces], np.int64)
        got = np.empty(size, np.int64)
        self.Alltoall(sent, got)
        out = np.empty(int(got.sum()), np.uint8)
        self.Alltoallv((np.concatenate(pieces), (sent.tolist(), _starts(sent))),
                       (out, (got.tolist(), _starts(got))))
        return [pickle.loads(out[lo:lo + n].tobytes()) for lo, n in zip(_starts(got), got)]


def _starts(lengths):
    return [0] + np.cumsum(lengths)[:-1].tolist()
