"""The codecs' kernels on CuPy arrays: gradients are encoded on the GPU, so only the
compressed bytes are copied to the host for MPI, and decoded there after.

Each kernel computes what its host counterpart in compression/ computes, bit for bit
(tests/scenarios/gpu_compression.py checks it on a GPU): IEEE float32 arithmetic in the same
order, rounding to nearest even into float16 and bfloat16. So a 2-bit residual on a GPU
is the residual numpy gives, and a rank's sums do not depend on where its arrays live.
Compiled by CuPy on first use (NVRTC), cached per device by CuPy.
"""
import functools

__all__ = ['encode16', 'decode16', 'sum_rows16', 'quantize_pack', 'count_sum']


@functools.cache
def _kernels():
    import cupy  # optional dependency, loaded where used
    to_bf16 = cupy.ElementwiseKernel(
        'T x, float32 scale', 'uint16 out',
        '''float v = (float)x * scale;
           unsigned int b = __float_as_uint(v);
           if ((b & 0x7fffffffu) > 0x7f800000u) { out = (b >> 16) | 0x0040u; }
           else { out = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16; }''', 'mpi_kvstore_to_bf16')
    from_bf16 = cupy.ElementwiseKernel(
        'uint16 bits, float32 scale', 'T out',
        'out = (T)(__uint_as_float(((unsigned int)bits) << 16) * scale);',
        'mpi_kvstore_from_bf16')
    quantize = cupy.ElementwiseKernel(
        'raw float32 grad, float32 thr, int64 n', 'uint8 out, raw float32 residual',
        '''unsigned int byte = 0;
           for (int k = 0; k < 4; k++) {
               long long j = 4 * (long long)i + k;
               if (j < n) {
                   float r = residual[j] + grad[j];
                   bool up = r >= thr;
                   bool down = r <= -thr;
                   residual[j] = r - (up ? thr : (down ? -thr : 0.0f));
                   byte |= (up ? 3u : (down ? 2u : 0u)) << (6 - 2 * k);
               }
           }
           out = (unsigned char)byte;''', 'mpi_kvstore_quantize_2bit')
    count = cupy.ElementwiseKernel(
        'raw uint8 codes, int64 ranks, int64 stride, int64 offset, float32 thr', 'float32 out',
        '''int up = 0;
           for (long long r = 0; r < ranks; r++) {
               unsigned int code = (codes[r * stride + offset + i / 4] >> (6 - 2 * (i % 4))) & 3u;
               up += code == 3u ? 1 : (code == 2u ? -1 : 0);
           }
           out = (float)up * thr;''', 'mpi_kvstore_count_2bit')
    return {'fp16': (_to_half, _from_half), 'bf16': (to_bf16, from_bf16),
            '2bit': (quantize, count)}


def _to_half(values, scale, out):
    """float32 product, then CuPy's float16 cast (round to nearest even, overflow to inf)."""
    import cupy  # optional dependency, loaded where used
    out.view(cupy.float16)[...] = cupy.multiply(values, scale, dtype=cupy.float32)


def _from_half(bits, scale, out):
    import cupy  # optional dependency, loaded where used
    out[...] = cupy.multiply(bits.view(cupy.float16), scale, dtype=cupy.float32)


def encode16(values, scale, kind, out):
    """out (uint16, CuPy) = the 16-bit float (kind 'fp16' or 'bf16') of
    float32(values) * scale, as compression.WireCast._encode computes it."""
    _kernels()[kind][0](values, scale, out)


def decode16(bits, scale, kind, out):
    """out (float32 or float64, CuPy) = float32(the 16-bit floats) * scale."""
    _kernels()[kind][1](bits, scale, out)


def sum_rows16(rows, kind, out):
    """out (uint16) = the 16-bit float of the float32 sum of ``rows`` (ranks, n; 16-bit
    floats' bits), added row by row in rank order as numpy's add.reduce over axis 0 adds."""
    import cupy  # optional dependency, loaded where used
    total = cupy.empty(rows.shape[1], cupy.float32)
    one = cupy.float32(1)
    decode16(rows[0], one, kind, total)
    if rows.shape[0] > 1:
        row = cupy.empty_like(total)
        for r in range(1, rows.shape[0]):
            decode16(rows[r], one, kind, row)
            total += row
    encode16(total, one, kind, out)


def quantize_pack(grad, residual, threshold, out):
    """compression.kernels.quantize_pack on the GPU: residual += grad, four codes a byte."""
    _kernels()['2bit'][0](grad, threshold, grad.size, out, residual)


def count_sum(codes, offset, count, threshold, out):
    """compression.kernels.count_sum on the GPU: ``codes`` (ranks, bytes), C-contiguous on the
    device, this request's bytes from ``offset``; out[:count] = threshold * (ups - downs)."""
    _kernels()['2bit'][1](codes.reshape(-1), codes.shape[0], codes.shape[1], offset,
                          threshold, out[:count])
