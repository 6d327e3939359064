"""WireCast: float32/float64 buckets exchanged as float16 or bfloat16 (see the package)."""
import numpy as np

from ..comm.fusion import Shares, pieces
from ..comm.mpiabi import MPI
from . import device as device_codecs
from .buckets import alltoall, device_module, float32_values, host_empty, packed, ring_pieces
from .kernels import host_codec

FLOAT16_MAX = float(np.finfo(np.float16).max)


class WireCast:
    """float32/float64 buckets exchanged as float16 or bfloat16 (see the module).

    ``ring``: the compression-assisted ring (docs/compression.md) instead of compressing once: a ring
    reduce-scatter in which every hop's partial sum travels as 16-bit floats (decoded,
    added to the receiver's own float32 values, encoded again for the next hop), then a
    ring allgather of the owners' 16-bit sums. Same bytes as compress-once (2 (N-1)/N of the
    16-bit data a rank), point-to-point only, but N-1 roundings of partial sums instead of
    one: the error bound grows with N (docs/compression.md).
    """

    # Values a piece of the pipelined compress-once (256K: 512 KB of 16-bit floats): pieces
    # this small let one piece's encoding and decoding overlap another's transfer, while
    # smaller ones gain nothing more against their per-message cost (docs/compression.md).
    pipeline_values = 1 << 18
    # reduce_scatter runs on device buffers too (comm.reduce.shares_route asks).
    device_shares = True

    def __init__(self, kind, ring=False):
        if kind not in ('fp16', 'bf16'):
            raise ValueError("a wire cast is fp16 or bf16, not %r" % (kind,))
        self.kind = kind
        self.ring = bool(ring)
        self.spec = (kind, 'ring') if ring else (kind,)
        self._host = host_codec(kind)
        self.wire = self._host.wire

    def applies_to(self, dtype):
        return dtype in (np.float32, np.float64)

    def wire_bytes(self, nbytes, dtype):
        """Bytes that ``nbytes`` of ``dtype`` put on the wire: 16 bits a value. The scheduler
        cuts pieces and counts its credit in these (designs/schedule.py)."""
        return nbytes * 2 // np.dtype(dtype).itemsize

    def exchange(self, reqs, comm):
        """Sum the requests' buffers over ranks in place; -> {req: error} of local failures."""
        n = comm.size
        if n == 1:
            return {}
        if self.ring:
            return self._exchange_ring(reqs, comm)
        device = device_module(reqs)                # CuPy for a GPU bucket, else None
        if comm.uniform_hierarchy and device is None:
            return self._exchange_hierarchical(reqs, comm)
        failed, sizes = {}, [r.nbytes // r.dtype.itemsize for r in reqs]
        count = sum(sizes)
        if device is None and count >= 2 * self.pipeline_values:
            return self._exchange_pipelined(reqs, sizes, comm)
        chunk = -(-count // n)
        send = host_empty(n * chunk, np.uint16, device)   # the 16-bit floats' bits
        encoded = send if device is None else device.zeros(n * chunk, np.uint16)
        encoded[count:] = 0
        scale, offset = np.float32(1.0 / n), 0
        for req, size in zip(reqs, sizes):
            try:   # prescaled and cast in one pass
                self._encode(req.buffer().reshape(-1), scale, encoded[offset:offset + size])
            except Exception as err:
                failed[req] = err
                encoded[offset:offset + size] = 0
            offset += size
        if device is not None:   # only the 16-bit bits come down
            encoded.get(out=send)
        recv = host_empty((n, chunk), np.uint16, device)
        comm.alltoall(send, recv.reshape(-1))
        gathered = host_empty(n * chunk, np.uint16, device)
        mine = gathered[comm.rank * chunk:(comm.rank + 1) * chunk]
        if device is None:
            self._sum_rows(recv, mine)
        else:      # summed on the GPU too: the host only moves bytes
            summed = device.empty(chunk, np.uint16)
            self._sum_rows(device.asarray(recv), summed)
            summed.get(out=mine)
        comm.allgather(MPI.IN_PLACE, gathered)
        gathered = gathered[:count] if device is None else device.asarray(gathered[:count])
        return self._deliver(reqs, sizes, gathered, n, failed)

    def reduce_scatter(self, reqs, comm):
        """Compress-once's first half, for the sharded optimizer: this rank's share
        (fusion.share) of each request ends up holding the sum over ranks. Each rank
        sends share r of every request, / N as 16-bit floats, to rank r (one all-to-all),
        which sums them in float32 in rank order, rounds to 16 bits and decodes times N:
        the bits of compress-once's allreduce. The ring variant runs it too. Half the
        bytes of an uncompressed reduce-scatter. An fp16 sum that overflows on any rank
        fails every request on every rank (one small MAX-allreduce says so).

        Device buffers (seed 003 on a GPU) take the same steps there: CuPy's kernels cast,
        sum and decode (device.py, bit for bit the host kernels), the device transport
        moves the 16-bit pieces (buckets.alltoall), and only the overflow flag comes to the
        host. Not NCCL's or MPI's own reduce-scatter of the 16-bit buffer: NCCL adds 16-bit
        floats in 16 bits, each partial sum rounded, in its ring's or tree's order, and MPI
        has no 16-bit float type (a sum of the bits as integers means nothing); the host
        path rounds once, after a float32 sum in rank order. The all-to-all moves what a
        ring reduce-scatter moves: (N-1)/N of the 16-bit buffer a rank.
        -> {req: error} of failures."""
        n, rank = comm.size, comm.rank
        xp = device_module(reqs) or np
        failed, views = {}, []
        for req in reqs:
            try:
                views.append(req.buffer().reshape(-1))
            except Exception as err:
                failed[req] = err
                views.append(None)
        layout = Shares(reqs, n)
        chunk = max(layout.counts)
        send = xp.zeros((n, chunk), np.uint16)
        scale = np.float32(1.0 / n)
        for r in range(n):
            for j, start, stop, at in layout.spans(r):
                if views[j] is not None and stop > start:
                    try:
                        self._encode(views[j][start:stop], scale, send[r, at:at + stop - start])
                    except Exception as err:
                        failed.setdefault(reqs[j], err)
                        send[r, at:at + stop - start] = 0
        recv = xp.empty((n, chunk), np.uint16)
        alltoall(comm, send.reshape(-1), recv.reshape(-1), sum(r.nbytes for r in reqs))
        mine = xp.empty(chunk, np.uint16)
        self._sum_rows(recv, mine)
        mine = mine[:layout.counts[rank]]
        if self.kind == 'fp16':
            # A buffer, not a Python object: mpi4py's object allreduce holds the GIL while
            # it waits (another thread ran 200x slower beside it), which starved the other
            # lanes of the concurrent design on this rank, one of which the others waited for.
            overflowed = np.array([_not_finite16(mine)], np.int32)
            comm.mpi.Allreduce(MPI.IN_PLACE, overflowed, op=MPI.MAX)
            if overflowed[0]:
                return {**dict.fromkeys(reqs, _fp16_overflow(n)), **failed}
        for j, start, stop, at in layout.spans(rank):
            if reqs[j] not in failed:
                self._decode(mine[at:at + stop - start], np.float32(n), views[j][start:stop])
        return failed

    def _exchange_pipelined(self, reqs, sizes, comm):
        """Compress-once in pieces of ``pipeline_values``, three deep: while piece p is
        encoded and its all-to-all starts, piece p-1 is summed and its allgather starts, and
        piece p-2's allgather is waited for and decoded into the requests. The pieces'
        collectives start in one order on every rank. Each value is still the sum of the
        ranks' 16-bit values in rank order, so the bits are compress-once's.

        An fp16 sum that overflows fails every request on every rank, as in exchange: every
        rank holds the same gathered bits of each piece, so all decide alike, and none
        decodes a piece from the first that overflowed on (the pieces decoded before it hold
        their sums)."""
        n, rank = comm.size, comm.rank
        count = sum(sizes)
        failed, views, offset = {}, [], 0
        for req, size in zip(reqs, sizes):
            try:
                views.append((offset, req.buffer().reshape(-1)))
            except Exception as err:
                failed[req] = err
                views.append((offset, None))
            offset += size
        scale = np.float32(1.0 / n)
        bounds = list(range(0, count, self.pipeline_values)) + [count]
        pieces = []   # per piece: start, stop, chunk, recv, gathered, request
        overflowed = []

        def spans(start, stop):
            """(request, view, lo, hi): the part [lo, hi) of the bucket in [start, stop)
            that each request holds, with the request's own view."""
            for (at, view), req, size in zip(views, reqs, sizes):
                lo, hi = max(start, at), min(stop, at + size)
                if lo < hi and view is not None:
                    yield req, view[lo - at:hi - at], lo, hi

        def encode(start, stop):
            chunk = -(-(stop - start) // n)
            send = np.zeros(n * chunk, np.uint16)
            for req, part, lo, hi in spans(start, stop):
                try:
                    self._encode(part, scale, send[lo - start:hi - start])
                except Exception as err:
                    failed.setdefault(req, err)
                    send[lo - start:hi - start] = 0
            recv = np.empty((n, chunk), np.uint16)
            pieces.append([start, stop, chunk, recv, None, comm.start_alltoall(send, recv)])

        def reduce(piece):
            _, _, chunk, recv, _, request = piece
            comm.wait(request)
            gathered = np.empty(n * chunk, np.uint16)
            self._sum_rows(recv, gathered[rank * chunk:(rank + 1) * chunk])
            piece[4], piece[5] = gathered, comm.start_allgather(gathered)

        def deliver(piece):
            start, stop, _, _, gathered, request = piece
            comm.wait(request)
            bits = gathered[:stop - start]
            if overflowed or (self.kind == 'fp16' and _not_finite16(bits)):
                overflowed.append(True)
                return
            for req, part, lo, hi in spans(start, stop):
                if req not in failed:
                    self._decode(bits[lo - start:hi - start], np.float32(n), part)

        for p in range(len(bounds) - 1):
            encode(bounds[p], bounds[p + 1])
            if p >= 1:
                reduce(pieces[p - 1])
            if p >= 2:
                deliver(pieces[p - 2])
        reduce(pieces[-1])
        for piece in pieces[max(0, len(pieces) - 2):]:
            deliver(piece)
        if overflowed:
            return {**dict.fromkeys(reqs, _fp16_overflow(n)), **failed}
        return failed

    def _exchange_hierarchical(self, reqs, comm):
        """Through the hosts (the Comm's hierarchy, every host with L ranks): a float32
        reduce-scatter inside each host (shared memory, exact), the compress-once exchange of
        each host-summed piece among the ranks of its local rank (one a host: the only bytes
        that cross the network, 16 bits each), and an allgather of the 16-bit sums inside each
        host. Every rank decodes the same bits. Elementwise the result is the flat one's with
        hosts in place of ranks: each host's sum / N rounded to 16 bits, summed in float32 in
        host order, rounded again, times N."""
        n, node, cross = comm.size, comm.hierarchy.node, comm.hierarchy.cross
        sizes = [r.nbytes // r.dtype.itemsize for r in reqs]
        count = sum(sizes)
        flat, failed = float32_values(reqs, sizes, np.float32(1))
        counts, displs = pieces(count, node.Get_size())
        piece = np.empty(counts[node.Get_rank()], np.float32)
        node.Reduce_scatter(flat, piece, counts, op=MPI.SUM)     # this host's sum, my piece
        hosts = cross.Get_size()
        chunk = -(-piece.size // hosts)
        send = np.zeros(hosts * chunk, np.uint16)
        self._encode(piece, np.float32(1.0 / n), send[:piece.size])
        recv = np.empty((hosts, chunk), np.uint16)
        cross.Alltoall(send, recv.reshape(-1))
        mine = np.empty(chunk, np.uint16)
        self._sum_rows(recv, mine)
        summed = np.empty(hosts * chunk, np.uint16)
        cross.Allgather(mine, summed)
        bits = np.empty(count, np.uint16)
        node.Allgatherv(summed[:piece.size], (bits, (counts, displs)))
        return self._deliver(reqs, sizes, bits, n, failed)

    def _exchange_ring(self, reqs, comm):
        """The compression-assisted ring (see the class). Host memory: GPU buffers are
        copied down once and back once."""
        n, rank = comm.size, comm.rank
        sizes = [r.nbytes // r.dtype.itemsize for r in reqs]
        count = sum(sizes)
        # this rank's values / N, then partial sums
        acc, failed = float32_values(reqs, sizes, np.float32(1.0 / n))
        piece = ring_pieces(sizes, n)    # piece i: piece i of every request, in order
        counts = [sum(w for _, w in spans) for spans in piece]
        out = np.empty(max(counts), np.uint16)
        into = np.empty(max(counts), np.uint16)
        got = np.empty(max(counts), np.float32)
        right, left = (rank + 1) % n, (rank - 1) % n
        one = np.float32(1)
        for step in range(n - 1):                   # reduce-scatter, 16 bits a hop
            send, recv = (rank - step) % n, (rank - step - 1) % n
            for start, width, at in packed(piece[send]):
                self._encode(acc[start:start + width], one, out[at:at + width])
            comm.sendrecv(out[:counts[send]], right, into[:counts[recv]], left)
            self._decode(into[:counts[recv]], one, got[:counts[recv]])
            for start, width, at in packed(piece[recv]):
                acc[start:start + width] += got[at:at + width]
        own = (rank + 1) % n                        # the piece whose sum this rank holds
        pieces = {own: np.empty(counts[own], np.uint16)}
        for start, width, at in packed(piece[own]):
            self._encode(acc[start:start + width], one, pieces[own][at:at + width])
        for step in range(n - 1):                   # allgather of the owners' bits
            send, recv = (own - step) % n, (own - step - 1) % n
            pieces[recv] = np.empty(counts[recv], np.uint16)
            comm.sendrecv(pieces[send], right, pieces[recv], left)
        bits = np.empty(count, np.uint16)
        for i, spans in enumerate(piece):
            for start, width, at in packed(spans):
                bits[start:start + width] = pieces[i][at:at + width]
        return self._deliver(reqs, sizes, bits, n, failed)

    def _deliver(self, reqs, sizes, bits, n, failed):
        """Decode the summed 16-bit ``bits`` (the bucket's, alike on every rank) times N into
        each request that did not fail here; an fp16 sum that overflowed fails every request
        on every rank (they all hold these bits, so they all decide alike).
        -> {req: error}. Host bits for a GPU request (the ring) are decoded, then copied up."""
        if self.kind == 'fp16' and _not_finite16(bits):
            return {**dict.fromkeys(reqs, _fp16_overflow(n)), **failed}
        offset = 0
        for req, size in zip(reqs, sizes):
            if req not in failed:
                buf = req.buffer().reshape(-1)
                part = bits[offset:offset + size]
                if isinstance(part, np.ndarray) and not isinstance(buf, np.ndarray):
                    host = np.empty(size, buf.dtype)
                    self._decode(part, np.float32(n), host)
                    buf.set(host)
                else:
                    self._decode(part, np.float32(n), buf)
            offset += size
        return failed

    # A device buffer takes the CuPy kernels; a host one this kind's host codec (kernels.py).
    def _encode(self, values, scale, out):
        """out (uint16) = the 16-bit float of float32(values) * scale."""
        if isinstance(values, np.ndarray):
            self._host.encode(values, scale, out)
        else:
            device_codecs.encode16(values, scale, self.kind, out)

    def _sum_rows(self, rows, out):
        """out (uint16) = the 16-bit float of the float32 sum of the rows, in rank order."""
        if isinstance(rows, np.ndarray):
            self._host.sum_rows(rows, out)
        else:
            device_codecs.sum_rows16(rows, self.kind, out)

    def _decode(self, bits, scale, out):
        """out (float32 or float64) = float32(the 16-bit floats) * scale."""
        if isinstance(out, np.ndarray):
            self._host.decode(bits, scale, out)
        else:
            device_codecs.decode16(bits, scale, self.kind, out)


def _not_finite16(bits):
    """Whether any float16 in ``bits`` (uint16, numpy or CuPy) is inf or NaN: its exponent
    all ones."""
    return bool(((bits & 0x7c00) == 0x7c00).any())


def _fp16_overflow(n):
    return OverflowError(
        'fp16 compression: the sum over ranks of this bucket is not finite in float16 '
        '(each rank sends its values / %d; the largest float16 is %g): the gradients are '
        'too large or not finite; use compression=bf16 (float32 range) or none'
        % (n, FLOAT16_MAX))
