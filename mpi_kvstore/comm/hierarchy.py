"""Allreduce through the hosts: sub-communicators per host and across hosts.

Where every host runs the same number L of ranks: a reduce-scatter inside each host
(shared memory) leaves each local rank 1/L of its host's sum, the ranks with the same
local rank (one per host) allreduce that piece across the network, and an allgather
inside each host puts the pieces together. Otherwise: a reduce to each host's lowest
rank, an allreduce among those leaders, a broadcast inside each host.

The sharded optimizer's reduce-scatter and allgather, where every host runs L ranks, go
through the hosts too (:class:`Grid`): a reduce-scatter inside each host leaves local rank
l the host's sum of the shares of every host's rank l, and a reduce-scatter among the
ranks of local rank l (one per host) gives each its own share; the allgather runs the same
steps backwards. Across the network each rank then moves the bytes of its own local
rank's shares only.

Every rank takes the same decision. The sub-communicators come from collective calls
on the owning Comm's duplicate, in one order on every rank. The ranks first check that
they were all given the same mode (consensus.check), and raise ConfigError
together if not (a rank building sub-communicators that another does not would hang
both). Whether the hierarchy applies, and in which shape, is read from a table that one
Allgather gives every rank alike, never from what a rank sees locally; whether one call
uses it depends only on the buffer's size, which the ranks agreed on.

It cannot deadlock: the three steps run on communicators of this hierarchy alone, called
by the one thread that runs its Comm's collectives, in the same order on every rank.
Each step waits only for ranks that finished the step before it. An MPI error in one
step does not skip the others (:class:`PairedCalls`): the rank makes every later call of
the sequence, on garbage that the caller poisons, so it stays paired with the others.
"""
import numpy as np

from . import consensus
from .fusion import BufferPool, pieces
from .mpiabi import MPI

__all__ = ['Hierarchy', 'Grid', 'PairedCalls', 'AUTO_MIN_BYTES']

# hierarchical='auto': None keeps every allreduce flat and builds nothing; a number would
# take the hierarchy from that many bytes on. Flat, because MPICH's own Allreduce was as
# fast on the test bed (docs/hierarchical.md has the measurements).
AUTO_MIN_BYTES = None


class PairedCalls:
    """Makes every call of a sequence of collectives, even after one failed (the other ranks
    are in the later ones), and raises the first error at the end."""

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


class Hierarchy:
    """Collective: the host structure of communicator ``mpi`` for ``mode`` ('auto', 'on',
    'off'). ``active`` says whether allreduce goes through the hosts."""

    def __init__(self, mpi, mode):
        self.node = None              # the ranks on this host (COMM_TYPE_SHARED)
        self.cross = None             # the ranks with this local rank, one per host
        self.nodes = 1                # hosts the communicator spans (when it was asked)
        self.active = False           # allreduce goes through node and cross
        self.uniform = False          # every host runs as many ranks: reduce-scatter shape
        self.grid = None              # with uniform: reduce-scatter and allgather (Grid)
        self.min_bytes = 0            # smallest buffer that takes the hierarchy
        if mpi.Get_size() > 1:
            self._build(mpi, mode)

    def _build(self, mpi, mode):
        # A store has compared its options already (topology.agree); a Comm built on its
        # own (the GPU tests, doctor) is checked by the same mechanism.
        consensus.check(mpi, [consensus.Setting('hierarchical', mode, repr(mode), '')],
                        'a communicator')
        min_bytes = AUTO_MIN_BYTES if mode == 'auto' else 0
        if mode == 'off' or min_bytes is None:
            return
        rank = mpi.Get_rank()
        self.node = mpi.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        local_rank = self.node.Get_rank()
        mine = np.array([local_rank == 0, self.node.Get_size()], dtype=np.int32)
        table = np.empty((mpi.Get_size(), 2), dtype=np.int32)
        mpi.Allgather(mine, table)
        self.nodes = int(table[:, 0].sum())
        if self.nodes < 2 or table[:, 1].max() < 2:   # one host, or one rank a host: flat
            self.node.Free()
            self.node = None
            return
        self.cross = mpi.Split(local_rank, key=rank)
        self.uniform = bool((table[:, 1] == table[0, 1]).all())
        self.min_bytes = min_bytes
        self.active = True
        if self.uniform:
            self.grid = Grid.of(mpi, self.node, self.cross)

    def takes(self, nbytes):
        """Whether an allreduce of ``nbytes`` goes through the hosts by default."""
        return self.active and nbytes >= self.min_bytes

    def allreduce(self, data, scratch):
        """Sum in place through the hosts (``scratch``: a fusion.BufferPool for the piece)."""
        if self.uniform:
            self._scattered(data, scratch)
        else:
            self._via_leaders(data)

    def _scattered(self, data, scratch):
        """Reduce-scatter in the host, allreduce of each piece among the ranks of its local
        rank, allgather in the host (``data``: flat numpy, or CuPy for a CUDA-aware MPI)."""
        node, cross = self.node, self.cross
        counts, displs = pieces(data.size, node.Get_size())
        piece = scratch.get(data, counts[node.Get_rank()])
        run = PairedCalls()
        run(node.Reduce_scatter, data, piece, counts, op=MPI.SUM)
        run(cross.Allreduce, MPI.IN_PLACE, piece, op=MPI.SUM)
        run(node.Allgatherv, piece, (data, (counts, displs)))
        run.raise_first()

    def _via_leaders(self, data):
        """Reduce to each host's lowest rank, allreduce among those leaders, broadcast."""
        node, leaders = self.node, self.cross   # local rank 0's cross: the leaders
        run = PairedCalls()
        if node.Get_rank() == 0:
            run(node.Reduce, MPI.IN_PLACE, data, op=MPI.SUM, root=0)
            run(leaders.Allreduce, MPI.IN_PLACE, data, op=MPI.SUM)
        else:
            run(node.Reduce, data, None, op=MPI.SUM, root=0)
        run(node.Bcast, data, root=0)
        run.raise_first()

    def takes_shares(self, nbytes):
        """Whether a reduce-scatter or allgather of ``nbytes`` goes through the hosts."""
        return self.grid is not None and self.takes(nbytes)

    def free(self):
        self.grid = None
        for sub in (self.cross, self.node):
            if sub is not None and sub != MPI.COMM_NULL:
                sub.Free()
        self.cross = self.node = None
        self.active = False


class Grid:
    """Reduce-scatter and allgather of shares cut by global rank, through the hosts, where
    every host runs as many ranks. ``node``: this host's ranks; ``cross``: the ranks with
    this local rank, one per host; ``places[g]`` = (local rank, cross rank) of global rank
    g, the same table on every rank. Blocking calls in one order on every rank, each step
    made even after one failed (PairedCalls)."""

    def __init__(self, node, cross, places):
        self.node, self.cross = node, cross
        self.local, self.host = node.Get_rank(), cross.Get_rank()
        # ranks[l][h]: the global rank of local rank l on host h (cross rank h)
        self.ranks = [[0] * cross.Get_size() for _ in range(node.Get_size())]
        for g, (local, host) in enumerate(places):
            self.ranks[local][host] = g
        # the packed order: local rank 0's block (every host's rank of local rank 0), ...
        self._packed = [g for row in self.ranks for g in row]
        self._pools = (BufferPool(), BufferPool())

    @classmethod
    def of(cls, mpi, node, cross):
        """Collective on ``mpi``: the grid of its node and cross communicators."""
        mine = np.array([node.Get_rank(), cross.Get_rank()], dtype=np.int32)
        places = np.empty((mpi.Get_size(), 2), dtype=np.int32)
        mpi.Allgather(mine, places)
        return cls(node, cross, [tuple(int(v) for v in row) for row in places])

    def _layout(self, counts):
        """(per local rank: its block's count; per host: this local rank's share counts)"""
        blocks = [sum(counts[g] for g in row) for row in self.ranks]
        return blocks, [counts[g] for g in self.ranks[self.local]]

    def reduce_scatter(self, send, recv, counts):
        """Sum over all ranks of ``send`` (global rank g's share: ``counts[g]`` elements, in
        rank order) into ``recv``, this rank's share."""
        displs = _starts(counts)
        blocks, mine = self._layout(counts)
        packed = self._pools[0].get(send, sum(counts))
        at = 0
        for g in self._packed:
            packed[at:at + counts[g]] = send[displs[g]:displs[g] + counts[g]]
            at += counts[g]
        partial = self._pools[1].get(send, blocks[self.local])
        run = PairedCalls()
        run(self.node.Reduce_scatter, packed, partial, blocks, op=MPI.SUM)
        run(self.cross.Reduce_scatter, partial, recv, mine, op=MPI.SUM)
        run.raise_first()

    def allgather(self, buf, counts, displs):
        """Every rank's share of ``buf`` (``counts[g]`` elements at ``displs[g]``) into every
        rank's ``buf``; this rank's share is already in place."""
        blocks, mine = self._layout(counts)
        me = self.ranks[self.local][self.host]
        offsets = _starts(mine)
        partial = self._pools[1].get(buf, blocks[self.local])
        start = offsets[self.host]
        partial[start:start + counts[me]] = buf[displs[me]:displs[me] + counts[me]]
        starts = _starts(blocks)
        packed = self._pools[0].get(buf, sum(counts))
        run = PairedCalls()
        run(self.cross.Allgatherv, MPI.IN_PLACE, (partial, (mine, offsets)))
        packed[starts[self.local]:starts[self.local] + blocks[self.local]] = partial
        run(self.node.Allgatherv, MPI.IN_PLACE, (packed, (blocks, starts)))
        run.raise_first()
        at = 0
        for g in self._packed:
            buf[displs[g]:displs[g] + counts[g]] = packed[at:at + counts[g]]
            at += counts[g]


def _starts(counts):
    """Where each of ``counts`` consecutive runs starts."""
    return [int(v) for v in np.concatenate([[0], np.cumsum(counts)[:-1]])]
