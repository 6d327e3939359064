"""The codecs' compiled host kernels (numba): 2-bit quantisation and counting as MXNet
does them, and float16 conversions bit for bit as numpy's (tests/test_compression.py).
device.py holds their CuPy twins."""
import numba
import numpy as np

# 2-bit codes as MXNet writes them: 11 for +threshold, 10 for -threshold, 00 for 0; the
# first value of a byte in its two highest bits.
_POS, _NEG = 3, 2


@numba.njit(cache=True)
def quantize_pack(grad, residual, threshold, out):
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
DELTAS = np.array([[(0, 0, -1, 1)[(b >> s) & 3] for s in (6, 4, 2, 0)] for b in range(256)],
                   np.int32)


@numba.njit(cache=True)
def count_sum(codes, count, threshold, out, deltas):
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
def encode_f16(values, scale, out):
    with np.errstate(over='ignore', invalid='ignore'):     # inf and NaN go through as such
        scaled = np.multiply(values, scale, dtype=np.float32)
    _halves_of(scaled.view(np.uint32), out)


def decode_f16(halves, scale, out):
    floats = np.empty(halves.size, np.uint32)
    _floats_of(halves, floats)
    np.multiply(floats.view(np.float32), scale, out=out, casting='unsafe')


def sum_rows_f16(rows, out):
    floats = np.empty(rows.shape, np.uint32)
    _floats_of(rows.reshape(-1), floats.reshape(-1))
    total = np.add.reduce(floats.view(np.float32), axis=0)     # rank order, float32
    _halves_of(total.view(np.uint32), out)


class _Float16:
    """float16 on the host: compiled conversions (numpy 1.23's take 5x longer)."""
    wire = np.dtype(np.float16)
    encode = staticmethod(encode_f16)
    sum_rows = staticmethod(sum_rows_f16)
    decode = staticmethod(decode_f16)


class _BFloat16:
    """bfloat16 on the host: ml_dtypes' conversions (inf and NaN go through as such)."""

    def __init__(self):
        import ml_dtypes  # only where bf16 is asked for
        self.wire = np.dtype(ml_dtypes.bfloat16)

    def encode(self, values, scale, out):
        with np.errstate(over='ignore', invalid='ignore'):
            np.multiply(values, scale, dtype=np.float32, out=out.view(self.wire),
                        casting='unsafe')

    def sum_rows(self, rows, out):
        with np.errstate(over='ignore', invalid='ignore'):
            out.view(self.wire)[...] = np.add.reduce(rows.view(self.wire), axis=0,
                                                     dtype=np.float32)

    def decode(self, bits, scale, out):
        np.multiply(bits.view(self.wire), scale, dtype=np.float32, out=out, casting='unsafe')


def host_codec(kind):
    """encode, sum_rows and decode of 16-bit floats of ``kind`` ('fp16', 'bf16') on the host."""
    return _Float16() if kind == 'fp16' else _BFloat16()
