"""Broadcast of large host buffers (seed 004): pipelined in chunks, and through the hosts.

Three ways to send one numpy buffer from ``root`` to every rank, bitwise (the buffer
travels as its bytes, so any dtype goes, ml-dtypes' bfloat16 included):

  flat         one ``MPI_Bcast`` (what the store does today);
  pipelined    the buffer cut into chunks of ``chunk_bytes``, one ``MPI_Ibcast`` each, at
               most ``window`` in flight: the library's tree then works on several chunks
               at once; ``chain`` instead passes each chunk down the ring of ranks from the
               root (rank root+1 forwards chunk k while it receives chunk k+1);
  Hierarchical across the hosts, then inside each host (:class:`Hierarchical`): the ranks
               with the root's local rank (one per host, hierarchy.py's ``cross``
               communicator) receive over the network, then each broadcasts inside its
               host (``node``: shared memory). Where some host has fewer ranks than the
               root's local rank, the root's host broadcasts first and its lowest rank
               passes the buffer to the other hosts' lowest ranks (``cross`` of local rank
               0: the leaders). With ``chunk_bytes``, each step is a chain (or Ibcasts),
               so chunk k crosses the network while chunk k-1 spreads inside the host.

:class:`ByTable` is the entry point the store's broadcasts take (host.Comm.bcast_host):
it picks one of these by the buffer's size from the tune table's broadcast rows. On an
elastic world they take :class:`Polled` instead: one ``MPI_Ibcast`` whose wait can end when
a peer is lost (progress.set_abort_check), where a blocking one would wait for it forever.

Every rank must pass a buffer of the same number of bytes and the same root, chunk size
and window (as MPI_Bcast requires): the chunks, and so the calls, follow from those alone.
It cannot deadlock: each communicator sees its calls in chunk order on every member; a
rank starts step s of chunk k only after its step s-1 of chunk k completed, and waiting
on any request drives MPI's progress on all of them. In chains a rank receives only from
the rank before it and sends only on, so the waits form a tree from the root. Give these functions a communicator
of their own (a Dup, as host.Comm holds): ``chain`` sends point-to-point with tag
:data:`CHAIN_TAG`.
"""
import collections
import logging

import numpy as np

from .. import debug
from .hierarchy import Hierarchy
from .mpiabi import MPI
from .tuning import Choice

__all__ = ['flat', 'pipelined', 'chain', 'Hierarchical', 'ByTable', 'Polled', 'POLLED',
           'DEFAULT_CHUNK_BYTES', 'DEFAULT_WINDOW', 'CHAIN_TAG']

log = logging.getLogger(__name__)

# 1 MB chunks, 4 in flight: large enough that a chunk's latency is small beside its
# transfer, small enough that a 64 MB buffer is 64 chunks of pipeline. The tune table's
# broadcast rows override it (`python -m mpi_kvstore tune` measures the choices).
DEFAULT_CHUNK_BYTES = 1 << 20
DEFAULT_WINDOW = 4
CHAIN_TAG = 29


def _as_bytes(buf, what):
    """A flat uint8 view of numpy ``buf``, which the broadcast then fills in place."""
    if not isinstance(buf, np.ndarray):
        raise TypeError('%s: the buffer must be a numpy array, not %s'
                        % (what, type(buf).__name__))
    if buf.dtype.hasobject:
        raise TypeError('%s: a buffer of dtype %s holds Python objects, not bytes to send'
                        % (what, buf.dtype))
    if not buf.flags.c_contiguous:
        raise ValueError('%s: the buffer must be C-contiguous (shape %s, strides %s); '
                         'pass np.ascontiguousarray(buf) and copy back'
                         % (what, buf.shape, buf.strides))
    if not buf.flags.writeable:
        raise ValueError('%s: the buffer is read-only; a broadcast writes into it' % what)
    return buf.reshape(-1).view(np.uint8)


def _whole(value):
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _check(comm, root, what, chunk_bytes=None, window=None):
    size = comm.Get_size()
    if not _whole(root) or not 0 <= root < size:
        raise ValueError('%s: root=%r is not a rank of this communicator of %d ranks'
                         % (what, root, size))
    if chunk_bytes is not None and (not _whole(chunk_bytes) or chunk_bytes < 1):
        raise ValueError('%s: chunk_bytes=%r must be a positive whole number of bytes'
                         % (what, chunk_bytes))
    if window is not None and (not _whole(window) or window < 1):
        raise ValueError('%s: window=%r must be a positive whole number of requests'
                         % (what, window))
    return int(root)


def _chunks(nbytes, chunk_bytes):
    """[(start, stop)] of consecutive chunks of ``chunk_bytes`` (the last one shorter)."""
    return [(lo, min(lo + chunk_bytes, nbytes)) for lo in range(0, nbytes, chunk_bytes)]


def flat(comm, buf, root=0):
    """``buf`` of ``root`` into every rank's ``buf``, one MPI_Bcast. Returns ``buf``."""
    root = _check(comm, root, 'broadcast.flat')
    comm.Bcast(_as_bytes(buf, 'broadcast.flat'), root=root)
    return buf


def pipelined(comm, buf, root=0, chunk_bytes=DEFAULT_CHUNK_BYTES, window=DEFAULT_WINDOW):
    """Like :func:`flat`, in chunks of ``chunk_bytes``, ``window`` Ibcasts in flight."""
    root = _check(comm, root, 'broadcast.pipelined', chunk_bytes, window)
    data = _as_bytes(buf, 'broadcast.pipelined')
    _run_steps(data, [(comm, root)], int(chunk_bytes), int(window))
    return buf


def chain(comm, buf, root=0, chunk_bytes=DEFAULT_CHUNK_BYTES, window=DEFAULT_WINDOW):
    """Like :func:`flat`, each chunk passed along the ring root, root+1, ...: every rank but
    the last forwards chunk k while it receives the next ones (``window`` receives posted)."""
    root = _check(comm, root, 'broadcast.chain', chunk_bytes, window)
    data = _as_bytes(buf, 'broadcast.chain')
    _relay(data, [(comm, root)], int(chunk_bytes), int(window))
    return buf


def _links(steps):
    """(parent, children) of this rank in the chains of ``steps`` [(communicator, root)]:
    in each step's ring from its root, the rank before and the rank after this one."""
    parent, children = None, []
    for s, (comm, root) in enumerate(steps):
        size, me = comm.Get_size(), comm.Get_rank()
        place = (me - root) % size           # 0: the step's root, size-1: its chain's end
        if place > 0:
            if s:   # Hierarchical.steps makes a rank the root of every step but its first
                raise RuntimeError('broadcast: step %d of %s would deliver to this rank again'
                                   % (s, steps))
            parent = (comm, (me - 1) % size)
        if place < size - 1:
            children.append((comm, (me + 1) % size))
    return parent, children


def _relay(data, steps, chunk_bytes, window):
    """This rank's part of chained ``steps``: chunk k from the parent (``window`` receives
    posted ahead), then on to every child, while the next chunks arrive."""
    parent, children = _links(steps)
    chunks = _chunks(data.size, chunk_bytes)
    receives = collections.deque()
    sends = []

    def post(k):
        if parent is not None and k < len(chunks):
            lo, hi = chunks[k]
            receives.append(parent[0].Irecv(data[lo:hi], source=parent[1], tag=CHAIN_TAG))
    for k in range(window):
        post(k)
    for k, (lo, hi) in enumerate(chunks):
        if parent is not None:
            receives.popleft().Wait()
            post(k + window)
        sends += [comm.Isend(data[lo:hi], dest=dest, tag=CHAIN_TAG) for comm, dest in children]
    MPI.Request.Waitall(sends)


def _run_steps(data, steps, chunk_bytes, window):
    """This rank's part of a broadcast as steps [(communicator, root)], in order: chunk k
    enters step s once step s-1 finished it, each step keeping at most ``window`` Ibcasts
    in flight. One chunk (or none) takes blocking Bcasts."""
    chunks = _chunks(data.size, chunk_bytes)
    if len(chunks) <= 1:
        for comm, root in steps:
            comm.Bcast(data, root=root)
        return
    pending = [collections.deque() for _ in steps]   # per step: (chunk, request), oldest first
    started, finished = [0] * len(steps), [0] * len(steps)
    while finished[-1] < len(chunks):
        for s, (comm, root) in enumerate(steps):
            ready = len(chunks) if s == 0 else finished[s - 1]
            while started[s] < ready and len(pending[s]) < window:
                lo, hi = chunks[started[s]]
                pending[s].append(comm.Ibcast(data[lo:hi], root=root))
                started[s] += 1
        # The oldest request of each step: a step's chunks are waited for in order, so
        # finished[s] counts a prefix of chunks.
        heads = [s for s in range(len(steps)) if pending[s]]
        s = heads[MPI.Request.Waitany([pending[s][0] for s in heads])]
        pending[s].popleft()
        finished[s] += 1


class Hierarchical:
    """Broadcast through the hosts (see the module): ``node``, this rank's host's ranks
    (COMM_TYPE_SHARED), and ``cross``, the ranks with its local rank (one per host), as
    hierarchy.Hierarchy builds them; None for both: no hierarchy, every broadcast flat (or
    pipelined) on ``comm``. Collective on ``comm``: one Allgather of where each rank sits."""

    def __init__(self, comm, node=None, cross=None):
        self.comm = comm
        self.node, self.cross = node, cross
        self.active = node is not None and cross is not None
        if not self.active:
            return
        leader = np.array([comm.Get_rank()], np.int32)
        node.Bcast(leader, root=0)             # a host is named by its lowest rank's number
        mine = np.array([leader[0], node.Get_rank(), node.Get_size(), cross.Get_rank()], np.int32)
        self.places = np.empty((comm.Get_size(), 4), np.int32)   # per global rank, as mine
        comm.Allgather(mine, self.places)
        self.host, self.local = int(leader[0]), node.Get_rank()
        self.smallest_host = int(self.places[:, 2].min())

    @classmethod
    def build(cls, comm):
        """Collective on ``comm``: the hierarchy of hierarchy.py (mode 'on'), and this over
        it; where it does not apply (one host, or one rank a host), flat on ``comm``.
        Returns (broadcaster, hierarchy); the caller frees the hierarchy."""
        hierarchy = Hierarchy(comm, 'on')
        if not hierarchy.active:
            log.debug('hierarchical broadcast: %d host(s), flat', hierarchy.nodes)
            return cls(comm), hierarchy
        return cls(comm, hierarchy.node, hierarchy.cross), hierarchy

    def steps(self, root):
        """This rank's [(communicator, root)] for a broadcast from global rank ``root``."""
        if not self.active:
            return [(self.comm, root)]
        host, local, _, _ = (int(v) for v in self.places[root])
        if local < self.smallest_host:
            # Every host has a rank of the root's local rank: across, then inside.
            across = [(self.cross, int(self.places[root, 3]))] if self.local == local else []
            return across + [(self.node, local)]
        # Some host lacks it: inside the root's host, across the leaders, inside the rest.
        leaders = [(self.cross, int(self.places[host, 3]))] if self.local == 0 else []
        if self.host == host:
            return [(self.node, local)] + leaders
        return leaders + [(self.node, 0)]

    def __call__(self, buf, root=0, chunk_bytes=None, window=DEFAULT_WINDOW, how='chain'):
        """``buf`` of global rank ``root`` into every rank's ``buf``. ``chunk_bytes`` None:
        one blocking Bcast a step; else chunks of it, each step a chain (``how='chain'``,
        point-to-point, as :func:`chain`) or ``window`` Ibcasts in flight (``'ibcast'``, as
        :func:`pipelined`). Returns ``buf``."""
        root = _check(self.comm, root, 'broadcast.Hierarchical', chunk_bytes, window)
        if how not in ('chain', 'ibcast'):
            raise ValueError("broadcast.Hierarchical: how=%r must be 'chain' or 'ibcast'" % (how,))
        data = _as_bytes(buf, 'broadcast.Hierarchical')
        if chunk_bytes is None:
            _run_steps(data, self.steps(root), max(data.size, 1), int(window))
        elif how == 'chain':
            _relay(data, self.steps(root), int(chunk_bytes), int(window))
        else:
            _run_steps(data, self.steps(root), int(chunk_bytes), int(window))
        return buf


FLAT = Choice('flat', None)


def table_choice(table, op, nbytes, default):
    """The tune table's Choice for ``op`` (tuning.OPS) on ``nbytes``; ``default`` where
    there is no table or it has no rows for ``op`` (a table written before the rows)."""
    choice = None if table is None else table.choose_op(op, nbytes)
    return default if choice is None else choice


POLLED = Choice('polled', None)


class Polled:
    """Broadcasts on ``comm`` as one MPI_Ibcast, finished by ``wait(request)`` (a polled
    wait, which the abort check of an elastic world can end). Every rank of ``comm`` must
    broadcast this way: a blocking MPI_Bcast never matches an MPI_Ibcast."""

    def __init__(self, comm, wait):
        self.comm, self._wait = comm, wait

    def choose(self, nbytes):
        """Always :data:`POLLED` (not 'flat': no compiled op may call MPI_Bcast instead)."""
        return POLLED

    def __call__(self, buf, root=0):
        """``buf`` of ``root`` into every rank's ``buf``. Returns ``buf``."""
        self._wait(self.comm.Ibcast(buf, root=root))
        return buf


class ByTable:
    """Broadcasts on ``comm`` that take the tune table's choice for their size
    (tuning.Table.choose_op('broadcast', nbytes)); without a table, or without broadcast
    rows, one MPI_Bcast, as before the rows existed. The choice is a pure function of the
    agreed table and the size, and every rank's buffer has the same size, so every rank
    makes the same calls. ``hierarchy``: an object with ``active``, ``node`` and ``cross``
    (hierarchy.Hierarchy of ``comm``), or None; a 'hierarchical' row where it is not
    active (one host, one rank a host) takes pipelined Ibcasts of its chunk, or one
    MPI_Bcast without a chunk."""

    def __init__(self, comm, table=None, hierarchy=None):
        self.comm, self._table, self._hierarchy = comm, table, hierarchy
        # Built at the first hierarchical broadcast: its constructor is collective on comm,
        # and that first broadcast is the same call on every rank.
        self._through_hosts = None

    def choose(self, nbytes):
        """The Choice (algorithm, chunk_bytes) that a buffer of ``nbytes`` takes here: the
        one place that decides (the chained design asks it whether its compiled op, which
        calls MPI_Bcast, may run a broadcast)."""
        choice = table_choice(self._table, 'broadcast', nbytes, FLAT)
        if choice.algorithm == 'hierarchical' and not getattr(self._hierarchy, 'active', False):
            return Choice('pipelined', choice.chunk_bytes) if choice.chunk_bytes else FLAT
        return choice

    def __call__(self, buf, root=0):
        """``buf`` of ``root`` into every rank's ``buf``, by the table. Returns ``buf``. A
        buffer that is not numpy (device memory for a CUDA-aware MPI) takes one MPI_Bcast."""
        if self._table is None or not isinstance(buf, np.ndarray):
            self.comm.Bcast(buf, root=root)   # exactly the store's call before tables had rows
            return buf
        algorithm, chunk = self.choose(buf.nbytes)
        debug.count('algorithm', 'broadcast ' + algorithm)
        if algorithm == 'flat':
            return flat(self.comm, buf, root)
        if algorithm == 'pipelined':
            return pipelined(self.comm, buf, root, chunk)
        if algorithm == 'chain':
            return chain(self.comm, buf, root, chunk)
        if self._through_hosts is None:
            self._through_hosts = Hierarchical(self.comm, self._hierarchy.node,
                                               self._hierarchy.cross)
        return self._through_hosts(buf, root, chunk)
