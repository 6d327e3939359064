"""Gradient compression: codecs that run a bucket's exchange in fewer bytes.

Horovod's compression.py wraps a compress and a decompress around the
allreduce. Compressed values cannot be summed by MPI (it has no float16 or
bfloat16 SUM, and 2-bit codes do not add up), so here a codec runs the whole
exchange of a bucket instead, and the designs call it in place of the
allreduce (Design._allreduce). Two kinds:

- :class:`WireCast` (store option ``compression``: 'fp16' or 'bf16'): float32
  and float64 gradients travel as 16-bit floats. Each rank prescales by 1/N
  (against float16 overflow), an all-to-all hands chunk j of every rank to rank
  j, which sums them in float32 in rank order, and an allgather brings the
  16-bit sums back. Every rank decodes the same bits, so results are bitwise
  identical everywhere, in the original dtype. Wire bytes: those of a ring
  allreduce at half the width.
- :class:`TwoBit` (``kv.set_gradient_compression({'type': '2bit',
  'threshold': t})``), with MXNet's semantics (src/kvstore/
  gradient_compression-inl.h): per key, ``residual += grad``; a value
  ``>= t`` sends ``+t`` and keeps ``residual - t``, a value ``<= -t`` sends
  ``-t`` and keeps ``residual + t``, any other sends 0. Four values per byte
  (16 per float32, as MXNet packs them). The result of a pushpull is the sum
  over ranks of the values sent. Codes cannot be summed, so every rank
  allgathers every rank's codes and counts: ``t * (#(+t) - #(-t))``. An
  allgather moves N times the codes, which beats a float32 allreduce while
  N < 32; from ``two_phase_min_ranks`` (32) ranks on, a two-phase exchange
  requantises the sums at each chunk's owner (TwoBit).

On GPU arrays the codecs encode and decode with CuPy kernels (device_codecs.py), bit for
bit as here, and only the compressed bytes cross to the host for MPI.

A codec's name and parameters (``spec``) are part of every request's
signature, so ranks that compress differently get a RankMismatchError, not a
hang. A rank whose own encoding fails still takes part, with zeros, and fails
that request (ranks stay paired).
"""
import math
import zlib

import numba
import numpy as np

from . import device_codecs
from .collective import SIG_LIMIT
from .comm import MPI, pieces

__all__ = ['WireCast', 'TwoBit', 'wire_cast', 'from_params', 'from_spec', 'sign']

WIRE_TYPES = ('none', 'fp16', 'bf16', 'fp16-ring', 'bf16-ring')
FLOAT16_MAX = float(np.finfo(np.float16).max)


def sign(sig, spec):
    """A request's signature, marked with the codec that runs it."""
    return zlib.crc32(('%d|%r' % (sig, spec)).encode()) % SIG_LIMIT


class WireCast:
    """float32/float64 buckets exchanged as float16 or bfloat16 (see the module).

    ``ring``: the compression-assisted ring of seed 003 instead of compressing once: a ring
    reduce-scatter in which every hop's partial sum travels as 16-bit floats (decoded,
    added to the receiver's own float32 values, encoded again for the next hop), then a
    ring allgather of the owners' 16-bit sums. Same bytes as compress-once (2 (N-1)/N of the
    16-bit data a rank), point-to-point only, but N-1 roundings of partial sums instead of
    one: the error bound grows with N (docs/compression.md).
    """

    def __init__(self, kind, ring=False):
        if kind not in ('fp16', 'bf16'):
            raise ValueError("compression must be one of %s, not %r" % (WIRE_TYPES, kind))
        self.kind = kind
        self.ring = bool(ring)
        self.spec = (kind, 'ring') if ring else (kind,)
        if kind == 'fp16':
            self.wire = np.dtype(np.float16)
        else:
            import ml_dtypes  # noqa: WPS433 (only where bf16 is asked for)
            self.wire = np.dtype(ml_dtypes.bfloat16)

    def applies_to(self, dtype):
        return dtype in (np.float32, np.float64)

    def exchange(self, reqs, comm):
        """Sum the requests' buffers over ranks in place; -> {req: error} of local failures."""
        n = comm.size
        if n == 1:
            return {}
        if self.ring:
            return self._exchange_ring(reqs, comm)
        device = _device_module(reqs)                # CuPy for a GPU bucket, else None
        if comm.uniform_hierarchy and device is None:
            return self._exchange_hierarchical(reqs, comm)
        failed, sizes = {}, [r.nbytes // r.dtype.itemsize for r in reqs]
        count = sum(sizes)
        if device is None and count >= 2 * PIPELINE_VALUES:
            return self._exchange_pipelined(reqs, sizes, comm)
        chunk = -(-count // n)
        send = _host_empty(n * chunk, np.uint16, device)   # the 16-bit floats' bits
        encoded = send if device is None else device.zeros(n * chunk, np.uint16)
        encoded[count:] = 0
        scale, offset = np.float32(1.0 / n), 0
        for req, size in zip(reqs, sizes):
            try:   # prescaled and cast in one pass
                self._encode(req.buffer().reshape(-1), scale, encoded[offset:offset + size])
            except Exception as err:    # noqa: B902 (zeros go out, and it fails)
                failed[req] = err
                encoded[offset:offset + size] = 0
            offset += size
        if device is not None:   # only the 16-bit bits come down
            encoded.get(out=send)
        recv = _host_empty((n, chunk), np.uint16, device)
        comm.alltoall(send, recv.reshape(-1))
        gathered = _host_empty(n * chunk, np.uint16, device)
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

    def _exchange_pipelined(self, reqs, sizes, comm):
        """Compress-once in pieces of PIPELINE_VALUES, overlapped: while piece p's all-to-all
        is on the wire, piece p+1 is encoded; while p+1's is, p is summed and its allgather
        starts; the pieces' collectives start in one order on every rank. Each value is still
        the sum of the ranks' 16-bit values in rank order, so the bits are compress-once's."""
        n, rank = comm.size, comm.rank
        count = sum(sizes)
        failed, views, offset = {}, [], 0
        for req, size in zip(reqs, sizes):
            try:
                views.append((offset, req.buffer().reshape(-1)))
            except Exception as err:    # noqa: B902 (zeros go out, and it fails)
                failed[req] = err
                views.append((offset, None))
            offset += size
        scale = np.float32(1.0 / n)
        bounds = list(range(0, count, PIPELINE_VALUES)) + [count]
        pieces = []   # per piece: start, stop, chunk, recv, gathered, request

        def encode(start, stop):
            chunk = -(-(stop - start) // n)
            send = np.zeros(n * chunk, np.uint16)
            for (at, view), req, size in zip(views, reqs, sizes):
                lo, hi = max(start, at), min(stop, at + size)
                if lo >= hi or view is None:
                    continue
                try:
                    self._encode(view[lo - at:hi - at], scale, send[lo - start:hi - start])
                except Exception as err:    # noqa: B902 (zeros go out, and it fails)
                    failed.setdefault(req, err)
                    send[lo - start:hi - start] = 0
            recv = np.empty((n, chunk), np.uint16)
            pieces.append([start, stop, chunk, recv, None, comm.start_alltoall(send, recv)])

        def reduce(piece):
            start, stop, chunk, recv, _, request = piece
            comm.wait(request)
            gathered = np.empty(n * chunk, np.uint16)
            self._sum_rows(recv, gathered[rank * chunk:(rank + 1) * chunk])
            piece[4], piece[5] = gathered, comm.start_allgather(gathered)

        for p in range(len(bounds) - 1):
            encode(bounds[p], bounds[p + 1])
            if p >= 1:
                reduce(pieces[p - 1])
        reduce(pieces[-1])
        bits = np.empty(count, np.uint16)
        for start, stop, _, _, gathered, request in pieces:
            comm.wait(request)
            bits[start:stop] = gathered[:stop - start]
        return self._deliver(reqs, sizes, bits, n, failed)

    def _exchange_hierarchical(self, reqs, comm):
        """Through the hosts (the Comm's hierarchy, every host with L ranks): a float32
        reduce-scatter inside each host (shared memory, exact), the compress-once exchange of
        each host-summed piece among the ranks of its local rank (one a host: the only bytes
        that cross the network, 16 bits each), and an allgather of the 16-bit sums inside each
        host. Every rank decodes the same bits. Elementwise the result is the flat one's with
        hosts in place of ranks: each host's sum / N rounded to 16 bits, summed in float32 in
        host order, rounded again, times N."""
        n, node, cross = comm.size, comm.node, comm.cross
        sizes = [r.nbytes // r.dtype.itemsize for r in reqs]
        count = sum(sizes)
        flat, failed = _float32_values(reqs, sizes, np.float32(1))
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
        acc, failed = _float32_values(reqs, sizes, np.float32(1.0 / n))
        piece = _ring_pieces(sizes, n)    # piece i: piece i of every request, in order
        counts = [sum(w for _, w in spans) for spans in piece]
        out = np.empty(max(counts), np.uint16)
        into = np.empty(max(counts), np.uint16)
        got = np.empty(max(counts), np.float32)
        right, left = (rank + 1) % n, (rank - 1) % n
        one = np.float32(1)
        for step in range(n - 1):                   # reduce-scatter, 16 bits a hop
            send, recv = (rank - step) % n, (rank - step - 1) % n
            for start, width, at in _packed(piece[send]):
                self._encode(acc[start:start + width], one, out[at:at + width])
            comm.sendrecv(out[:counts[send]], right, into[:counts[recv]], left)
            self._decode(into[:counts[recv]], one, got[:counts[recv]])
            for start, width, at in _packed(piece[recv]):
                acc[start:start + width] += got[at:at + width]
        own = (rank + 1) % n                        # the piece whose sum this rank holds
        pieces = {own: np.empty(counts[own], np.uint16)}
        for start, width, at in _packed(piece[own]):
            self._encode(acc[start:start + width], one, pieces[own][at:at + width])
        for step in range(n - 1):                   # allgather of the owners' bits
            send, recv = (own - step) % n, (own - step - 1) % n
            pieces[recv] = np.empty(counts[recv], np.uint16)
            comm.sendrecv(pieces[send], right, pieces[recv], left)
        bits = np.empty(count, np.uint16)
        for i, spans in enumerate(piece):
            for start, width, at in _packed(spans):
                bits[start:start + width] = pieces[i][at:at + width]
        return self._deliver(reqs, sizes, bits, n, failed)

    def _deliver(self, reqs, sizes, bits, n, failed):
        """Decode the summed 16-bit ``bits`` (the bucket's, alike on every rank) times N into
        each request that did not fail here; an fp16 sum that overflowed fails every request
        on every rank (they all hold these bits, so they all decide alike).
        -> {req: error}. Host bits for a GPU request (the ring) are decoded, then copied up."""
        if self.kind == 'fp16' and bool(((bits & 0x7c00) == 0x7c00).any()):
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

    # float16: compiled conversions (numpy 1.23's take 5x longer); bfloat16: ml_dtypes'.
    def _encode(self, values, scale, out):
        """out (uint16) = the 16-bit float of float32(values) * scale."""
        if not isinstance(values, np.ndarray):
            device_codecs.encode16(values, scale, self.kind, out)
        elif self.kind == 'fp16':
            _encode_f16(values, scale, out)
        else:
            with np.errstate(over='ignore', invalid='ignore'):
                np.multiply(values, scale, dtype=np.float32, out=out.view(self.wire),
                            casting='unsafe')

    def _sum_rows(self, rows, out):
        """out (uint16) = the 16-bit float of the float32 sum of the rows, in rank order."""
        if not isinstance(rows, np.ndarray):
            device_codecs.sum_rows16(rows, self.kind, out)
        elif self.kind == 'fp16':
            _sum_rows_f16(rows, out)
        else:
            with np.errstate(over='ignore', invalid='ignore'):
                out.view(self.wire)[...] = np.add.reduce(rows.view(self.wire), axis=0,
                                                         dtype=np.float32)

    def _decode(self, bits, scale, out):
        """out (float32 or float64) = float32(the 16-bit floats) * scale."""
        if not isinstance(out, np.ndarray):
            device_codecs.decode16(bits, scale, self.kind, out)
        elif self.kind == 'fp16':
            _decode_f16(bits, scale, out)
        else:
            np.multiply(bits.view(self.wire), scale, dtype=np.float32, out=out, casting='unsafe')


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
        device = _device_module(reqs)                # CuPy for a GPU bucket, else None
        host = _host_empty(total, np.uint8, device)
        codes = host if device is None else device.empty(total, np.uint8)
        failed = self._quantize(reqs, spans, codes, device)
        if device is not None:   # only the codes come down
            codes.get(out=host)
        if n >= self.two_phase_min_ranks and n > 1:
            every, spans = self._two_phase(reqs, spans, host, comm, device)
        elif n > 1:
            every = _host_empty((n, total), np.uint8, device)
            comm.allgather(host, every.reshape(-1))
        else:
            every = host.reshape(1, total)
        if device is not None:   # and every rank's go up
            every = device.asarray(every)
        for req, (offset, count) in zip(reqs, spans):
            if req not in failed:
                buf = req.buffer().reshape(-1)
                if device is None:
                    _count_sum(every[:, offset:offset + -(-count // 4)], count, self.threshold,
                               buf, _DELTAS)
                else:
                    device_codecs.count_sum(every, offset, count, self.threshold, buf)
        return failed

    def _quantize(self, reqs, spans, codes, device):
        """Each request's codes into ``codes`` at its offset, its residual updated; zeros for
        one that fails here. -> {req: error}"""
        failed = {}
        xp = np if device is None else device
        for req, (offset, count) in zip(reqs, spans):
            out = codes[offset:offset + -(-count // 4)]
            try:
                view = req.buffer().reshape(-1)
                if req.mirror:     # a joined rank's zeros: no residual of its own
                    residual = xp.zeros(count, np.float32)
                else:
                    residual = self._residuals.get(req.key)
                    if (residual is None or residual.size != count
                            or isinstance(residual, np.ndarray) != (device is None)):
                        residual = self._residuals[req.key] = xp.zeros(count, np.float32)
                if device is None:
                    _quantize_pack(view, residual, self.threshold, out)
                else:
                    device_codecs.quantize_pack(view, residual, self.threshold, out)
            except Exception as err:    # noqa: B902 (zeros go out, and it fails)
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
        widths = [-(-(-(-count // 4)) // n) for _, count in spans]   # code bytes a rank owns
        starts = np.concatenate([[0], np.cumsum(widths)]).astype(int)
        block = int(starts[-1])
        send = _host_empty((n, block), np.uint8, device)
        for (offset, count), width, start in zip(spans, widths, starts):
            nbytes = -(-count // 4)
            padded = np.zeros(n * width, np.uint8)
            padded[:nbytes] = codes[offset:offset + nbytes]
            send[:, start:start + width] = padded.reshape(n, width)
        mine = _host_empty((n, block), np.uint8, device)
        comm.alltoall(send.reshape(-1), mine.reshape(-1))   # row i: rank i's chunks for me
        every = _host_empty((n, block), np.uint8, device)
        for req, width, start in zip(reqs, widths, starts):
            sums = np.empty(4 * width, np.float32)
            _count_sum(mine[:, start:start + width], 4 * width, self.threshold, sums, _DELTAS)
            owned = self._owned.get(req.key)
            if owned is None or owned.size != sums.size:
                owned = self._owned[req.key] = np.zeros(sums.size, np.float32)
            _quantize_pack(sums, owned, self.threshold, every[rank, start:start + width])
        comm.allgather(MPI.IN_PLACE, every.reshape(-1))
        row = _host_empty((1, n * block), np.uint8, device)
        placed, at = [], 0
        for (_, count), width, start in zip(spans, widths, starts):
            row[0, at:at + n * width] = every[:, start:start + width].reshape(-1)
            placed.append((at, count))
            at += n * width
        return row, placed


# Values a piece of the pipelined compress-once (1M values: 2 MB of 16-bit floats).
PIPELINE_VALUES = 1 << 20


def _fp16_overflow(n):
    return OverflowError(
        'fp16 compression: the sum over ranks of this bucket is not finite in float16 '
        '(each rank sends its values / %d; the largest float16 is %g): the gradients are '
        'too large or not finite; use compression=bf16 (float32 range) or none'
        % (n, FLOAT16_MAX))


def _float32_values(reqs, sizes, scale):
    """(the bucket's values times ``scale`` in one float32 host array, {req: error}): a
    request that cannot be read gives zeros there and fails; GPU buffers are copied down."""
    flat, failed, offset = np.zeros(sum(sizes), np.float32), {}, 0
    for req, size in zip(reqs, sizes):
        try:
            values = req.buffer().reshape(-1)
            if not isinstance(values, np.ndarray):
                values = values.get()
            np.multiply(values, scale, dtype=np.float32, out=flat[offset:offset + size])
        except Exception as err:    # noqa: B902 (zeros go out, and it fails)
            failed[req] = err
            flat[offset:offset + size] = 0
        offset += size
    return flat, failed


def _packed(spans):
    """(start, width, at) of each span, ``at`` its place in the piece packed contiguous."""
    at = 0
    for start, width in spans:
        yield start, width, at
        at += width


def _ring_pieces(sizes, n):
    """Each of the ``n`` ring pieces as (start, width) spans of the bucket: piece i holds piece
    i of every request (each cut into n, larger pieces first), so that where a value starts
    its way round the ring depends on its key alone, not on which keys share its bucket."""
    spans, offset = [[] for _ in range(n)], 0
    for size in sizes:
        for i, (width, start) in enumerate(zip(*pieces(size, n))):
            if width:
                spans[i].append((offset + start, width))
        offset += size
    return spans


def _device_module(reqs):
    """CuPy where the bucket's buffers are on a GPU (a bucket is on one side: its place is
    agreed, and reduce.py gives a failed GPU request device zeros), else None."""
    for req in reqs:
        buf = req.buffer()
        if buf is not None:
            if isinstance(buf, np.ndarray):
                return None
            return __import__(type(buf).__module__.split('.')[0])
    return None


def _host_empty(shape, dtype, device):
    """Host memory for MPI: pinned where it is copied to and from a GPU."""
    if device is None:
        return np.empty(shape, dtype)
    import cupyx  # noqa: WPS433
    return cupyx.empty_pinned(shape, dtype)


# 2-bit codes as MXNet writes them: 11 for +threshold, 10 for -threshold, 00 for 0; the
# first value of a byte in its two highest bits.
_POS, _NEG = 3, 2


@numba.njit(cache=True)
def _quantize_pack(grad, residual, threshold, out):
    """MXNet's quantize_2bit, packed four values a byte as MXNet packs them, in one pass
    (the exchange's hot loop; selects instead of branches, which random signs would
    mispredict)."""
    neg, zero = -threshold, np.float32(0)
    n = grad.size
    for j in range(-(-n // 4)):
        byte = 0
        for k in range(4):
            i = 4 * j + k
            if i < n:
                r = residual[i] + grad[i]
                up = r >= threshold
                down = r <= neg
                residual[i] = r - (threshold if up else (neg if down else zero))
                byte |= (_POS if up else (_NEG if down else 0)) << (6 - 2 * k)
        out[j] = byte


# byte -> its four values as -1, 0 or +1 (code 10 -> -1, 11 -> +1)
_DELTAS = np.array([[(0, 0, -1, 1)[(b >> s) & 3] for s in (6, 4, 2, 0)] for b in range(256)],
                   np.int32)


@numba.njit(cache=True)
def _count_sum(codes, count, threshold, out, deltas):
    """out[i] = threshold * (ranks that sent +threshold - ranks that sent -threshold)."""
    nbytes = codes.shape[1]
    ups = np.zeros(4 * nbytes, np.int32)
    for r in range(codes.shape[0]):
        row = codes[r]
        for j in range(nbytes):
            d = deltas[row[j]]
            ups[4 * j] += d[0]
            ups[4 * j + 1] += d[1]
            ups[4 * j + 2] += d[2]
            ups[4 * j + 3] += d[3]
    for i in range(count):
        out[i] = np.float32(ups[i]) * threshold


# -- float16 <-> float32, bit for bit as numpy converts (tests/test_compression.py) --------
@numba.njit(cache=True)
def _f32_bits_to_f16(f):
    """numpy's npy_floatbits_to_halfbits: round to nearest even, overflow to inf."""
    h_sgn = (f >> 16) & 0x8000
    f_exp = f & 0x7f800000
    if f_exp >= 0x47800000:                      # overflow, inf or NaN
        if f_exp == 0x7f800000:
            f_sig = f & 0x007fffff
            if f_sig != 0:                       # NaN: keep a payload, never inf's
                ret = 0x7c00 + (f_sig >> 13)
                return h_sgn + (ret + 1 if ret == 0x7c00 else ret)
        return h_sgn + 0x7c00
    if f_exp <= 0x38000000:                      # a float16 subnormal, or zero
        if f_exp < 0x33000000:
            return h_sgn
        f_sig = (0x00800000 + (f & 0x007fffff)) >> (113 - (f_exp >> 23))
        if (f_sig & 0x00003fff) != 0x00001000 or (f & 0x000007ff) != 0:
            f_sig += 0x00001000
        return h_sgn + (f_sig >> 13)
    f_sig = f & 0x007fffff
    if (f_sig & 0x00003fff) != 0x00001000:       # round half to even
        f_sig += 0x00001000
    return h_sgn + (f_sig >> 13) + ((f_exp - 0x38000000) >> 13)   # a carry may make inf


@numba.njit(cache=True)
def _f16_to_f32_bits(h):
    """numpy's npy_halfbits_to_floatbits (exact)."""
    f_sgn = (h & 0x8000) << 16
    h_exp, h_sig = h & 0x7c00, h & 0x03ff
    if h_exp == 0:
        if h_sig == 0:
            return f_sgn
        h_sig <<= 1
        shift = 0
        while (h_sig & 0x0400) == 0:
            h_sig <<= 1
            shift += 1
        return f_sgn + ((127 - 15 - shift) << 23) + ((h_sig & 0x03ff) << 13)
    if h_exp == 0x7c00:
        return f_sgn + 0x7f800000 + (h_sig << 13)
    return f_sgn + (((h & 0x7fff) + 0x1c000) << 13)


@numba.njit(cache=True)
def _halves_of(bits, out):
    """out (uint16) = float16 bits of the float32 bits (uint32)."""
    for i in range(bits.size):
        out[i] = _f32_bits_to_f16(np.uint32(bits[i]))


@numba.njit(cache=True)
def _floats_of(halves, out):
    """out (uint32) = float32 bits of the float16 bits (uint16)."""
    for i in range(halves.size):
        out[i] = _f16_to_f32_bits(np.uint32(halves[i]))


# Bits in the compiled loops, arithmetic in numpy: a loop that did both ran 3x slower.
def _encode_f16(values, scale, out):
    with np.errstate(over='ignore', invalid='ignore'):     # inf and NaN go through as such
        scaled = np.multiply(values, scale, dtype=np.float32)
    _halves_of(scaled.view(np.uint32), out)


def _decode_f16(halves, scale, out):
    floats = np.empty(halves.size, np.uint32)
    _floats_of(halves, floats)
    np.multiply(floats.view(np.float32), scale, out=out, casting='unsafe')


def _sum_rows_f16(rows, out):
    floats = np.empty(rows.shape, np.uint32)
    _floats_of(rows.reshape(-1), floats.reshape(-1))
    total = np.add.reduce(floats.view(np.float32), axis=0)     # rank order, float32
    _halves_of(total.view(np.uint32), out)


def wire_cast(kind):
    """The store option ``compression`` -> a WireCast, or None for 'none'."""
    if kind not in WIRE_TYPES:
        raise ValueError("compression must be one of %s, not %r" % (WIRE_TYPES, kind))
    if kind == 'none':
        return None
    name, _, ring = kind.partition('-')
    return WireCast(name, ring=bool(ring))


def from_params(params, two_phase_min_ranks=32):
    """``set_gradient_compression``'s dict -> a TwoBit, or None for {'type': 'none'}.

    Raises a ValueError that says what is wrong, before anything changes.
    """
    if not isinstance(params, dict):
        raise ValueError('set_gradient_compression takes a dict like {"type": "2bit", '
                         '"threshold": 0.5}, not %r' % (params,))
    kind = params.get('type')
    unknown = sorted(set(params) - {'type', 'threshold'})
    if unknown:
        raise ValueError('set_gradient_compression: unknown parameter(s) %s in %r (known: '
                         'type, threshold)' % (unknown, params))
    if kind == 'none':
        return None
    if kind != '2bit':
        raise ValueError("set_gradient_compression: type must be '2bit' or 'none', not %r "
                         "(MXNet's '1bit' is not supported)" % (kind,))
    threshold = params.get('threshold', 0.5)     # MXNet's default
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float, np.floating)):
        raise ValueError('set_gradient_compression: threshold must be a positive number, not %r'
                         % (threshold,))
    threshold = float(threshold)
    if not math.isfinite(threshold) or not threshold > 0 or not np.isfinite(np.float32(threshold)):
        raise ValueError('set_gradient_compression: threshold must be a positive finite number '
                         '(as a float32), not %r' % (params.get('threshold'),))
    return TwoBit(threshold, two_phase_min_ranks)


def from_spec(spec):
    """A codec from a request's spec (a joined rank's mirror of another rank's request)."""
    if spec is None:
        return None
    if spec[0] == '2bit':
        return TwoBit(*spec[1:])
    return WireCast(spec[0], ring=spec[1:] == ('ring',))
