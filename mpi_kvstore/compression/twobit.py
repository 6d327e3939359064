"""TwoBit: MXNet's 2-bit gradient compression with error feedback (see the package)."""
import numpy as np

from ..comm.fusion import Shares
from ..comm.mpiabi import MPI
from . import device as device_codecs
from .buckets import ceil_div, device_module, host_empty
from .kernels import DELTAS, count_sum, quantize_pack


class TwoBit:
    """MXNet's 2-bit gradient compression (see the module); holds the residuals.

    Below ``two_phase_min_ranks`` ranks every rank's codes are allgathered and each rank
    counts them: the result is the exact sum of the values sent, as in MXNet. From there on,
    an allgather would move N times the codes, so the exchange runs in two phases
    (DeepSpeed's compressed allreduce, torch_cgx's scatter-reduce-allgather): an all-to-all
    gives rank j chunk j of every rank's codes; rank j counts them into sums and requantises
    those with the same threshold and a residual of its own (error feedback at the chunk's
    owner, per key, whichever keys share its bucket); an allgather of
    the requantised codes, which every rank decodes, the owner its own too, so that every
    rank holds the same bits. Each value of the result is then -t, 0 or +t, and what the
    requantisation holds back comes out in later steps. Wire bytes: about twice the codes.
    """

    def __init__(self, threshold, two_phase_min_ranks=32):
        self.threshold = np.float32(threshold)
        self.two_phase_min_ranks = int(two_phase_min_ranks)
        self.spec = ('2bit', float(self.threshold), self.two_phase_min_ranks)
        self._residuals = {}          # key -> float32 residual, this rank's
        self._owned = {}              # key -> this rank's residual as its chunk's owner

    def applies_to(self, dtype):
        return dtype == np.float32

    def wire_bytes(self, nbytes, dtype):
        """Bytes that ``nbytes`` of float32 put on the wire: their 2-bit codes, a sixteenth
        (the scheduler's unit: designs/schedule.py)."""
        return -(-nbytes // 16)

    def residual(self, key):
        """This rank's residual of key (None before its first compressed exchange)."""
        return self._residuals.get(key)

    def owner_residual(self, key):
        """This rank's residual as the owner of its chunk of key (two-phase exchanges; None
        before the first): values ceil(ceil(size / 4) / N) * 4 * rank onwards of the key."""
        return self._owned.get(key)

    def exchange(self, reqs, comm):
        """Sum the values each rank sends, in place; -> {req: error} of local failures."""
        spans, total = [], 0
        for req in reqs:
            count = req.nbytes // 4
            spans.append((total, count))
            total += -(-count // 4)
        n = comm.size
        device = device_module(reqs)                # CuPy for a GPU bucket, else None
        host = host_empty(total, np.uint8, device)
        codes = host if device is None else device.empty(total, np.uint8)
        failed = self._quantize(reqs, spans, codes, device)
        if device is not None:   # only the codes come down
            codes.get(out=host)
        if n >= self.two_phase_min_ranks and n > 1:
            every, spans = self._two_phase(reqs, spans, host, comm, device)
        elif n > 1:
            every = host_empty((n, total), np.uint8, device)
            comm.allgather(host, every.reshape(-1))
        else:
            every = host.reshape(1, total)
        if device is not None:   # and every rank's go up
            every = device.asarray(every)
        for req, (offset, count) in zip(reqs, spans):
            if req not in failed:
                buf = req.buffer().reshape(-1)
                if device is None:
                    count_sum(every[:, offset:offset + -(-count // 4)], count, self.threshold,
                               buf, DELTAS)
                else:
                    device_codecs.count_sum(every, offset, count, self.threshold, buf)
        return failed

    def reduce_scatter(self, reqs, comm):
        """The sharded optimizer's reduce-scatter (host buffers): this rank's share
        (fusion.share) of each request gets the exact sum of the values every rank sends.
        Each rank quantises share r of each request with its residual there and sends the
        codes to rank r (one all-to-all of a quarter of a byte a value); rank r counts them.
        Values are quantised one by one, so the sums are those of :meth:`exchange` below
        ``two_phase_min_ranks`` ranks, bit for bit. -> {req: error} of local failures."""
        n, me = comm.size, comm.rank
        cuts = Shares(reqs, n).cuts   # in values; the codes take a quarter byte each
        widths = [[ceil_div(c[r], 4) for c, _ in cuts] for r in range(n)]
        block = max(sum(row) for row in widths)
        send = np.zeros((n, block), np.uint8)
        failed = {}
        for j, (req, (counts, displs)) in enumerate(zip(reqs, cuts)):
            try:
                view = req.buffer().reshape(-1)
                # the residual holds the request's values rank after rank: for a whole
                # request those are its own places; a share piece's parts are apart
                residual = self._residual_of(req, sum(counts), None)
                local = 0
                for r in range(n):
                    start, stop = displs[r], displs[r] + counts[r]
                    at = sum(widths[r][:j])
                    quantize_pack(view[start:stop], residual[local:local + counts[r]],
                                  self.threshold, send[r, at:at + widths[r][j]])
                    local += counts[r]
            except Exception as err:
                failed[req] = err
                for r in range(n):
                    at = sum(widths[r][:j])
                    send[r, at:at + widths[r][j]] = 0
        recv = np.empty((n, block), np.uint8)
        comm.alltoall(send.reshape(-1), recv.reshape(-1))
        at = 0
        for j, (req, (counts, displs)) in enumerate(zip(reqs, cuts)):
            if req not in failed:
                view = req.buffer().reshape(-1)
                count_sum(recv[:, at:at + widths[me][j]], counts[me], self.threshold,
                          view[displs[me]:displs[me] + counts[me]], DELTAS)
            at += widths[me][j]
        return failed

    def _residual_of(self, req, count, device):
        """This rank's residual of the request's key (zeros for a joined rank's mirror)."""
        xp = np if device is None else device
        if req.mirror:     # a joined rank's zeros: no residual of its own
            return xp.zeros(count, np.float32)
        residual = self._residuals.get(req.key)
        if (residual is None or residual.size != count
                or isinstance(residual, np.ndarray) != (device is None)):
            residual = self._residuals[req.key] = xp.zeros(count, np.float32)
        return residual

    def _quantize(self, reqs, spans, codes, device):
        """Each request's codes into ``codes`` at its offset, its residual updated; zeros for
        one that fails here. -> {req: error}"""
        failed = {}
        for req, (offset, count) in zip(reqs, spans):
            out = codes[offset:offset + -(-count // 4)]
            try:
                view = req.buffer().reshape(-1)
                residual = self._residual_of(req, count, device)
                if device is None:
                    quantize_pack(view, residual, self.threshold, out)
                else:
                    device_codecs.quantize_pack(view, residual, self.threshold, out)
            except Exception as err:
                failed[req] = err
                out[...] = 0
        return failed

    def _two_phase(self, reqs, spans, codes, comm, device):
        """Each request's codes cut into N chunks; an all-to-all gives rank j chunk j of every
        rank's codes of every request; rank j counts them and requantises the sums with its
        residual of that key (so that a key's owner and residual do not depend on which keys
        share its bucket); an allgather of the requantised chunks.
        -> (the requantised codes as one row, in host memory; each request's (offset, count)
        in it)"""
        n, rank = comm.size, comm.rank
        widths = [ceil_div(ceil_div(count, 4), n) for _, count in spans]   # code bytes a rank owns
        starts = np.concatenate([[0], np.cumsum(widths)]).astype(int)
        block = int(starts[-1])
        send = host_empty((n, block), np.uint8, device)
        for (offset, count), width, start in zip(spans, widths, starts):
            nbytes = -(-count // 4)
            padded = np.zeros(n * width, np.uint8)
            padded[:nbytes] = codes[offset:offset + nbytes]
            send[:, start:start + width] = padded.reshape(n, width)
        mine = host_empty((n, block), np.uint8, device)
        comm.alltoall(send.reshape(-1), mine.reshape(-1))   # row i: rank i's chunks for me
        every = host_empty((n, block), np.uint8, device)
        for req, width, start in zip(reqs, widths, starts):
            sums = np.empty(4 * width, np.float32)
            count_sum(mine[:, start:start + width], 4 * width, self.threshold, sums, DELTAS)
            owned = self._owned.get(req.key)
            if owned is None or owned.size != sums.size:
                owned = self._owned[req.key] = np.zeros(sums.size, np.float32)
            quantize_pack(sums, owned, self.threshold, every[rank, start:start + width])
        comm.allgather(MPI.IN_PLACE, every.reshape(-1))
        row = host_empty((1, n * block), np.uint8, device)
        placed, at = [], 0
        for (_, count), width, start in zip(spans, widths, starts):
            row[0, at:at + n * width] = every[:, start:start + width].reshape(-1)
            placed.append((at, count))
            at += n * width
        return row, placed
