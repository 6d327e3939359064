"""compression.py's pure parts against independent references.

MXNet's quantize_2bit (src/kvstore/gradient_compression-inl.h) is transcribed
here element by element, as its C loop runs, and the compiled quantizer must
match it bit for bit over several steps of carried residuals, thresholds hit
exactly included. A numpy quantizer, packer and unpacker here are the reference
for the compiled kernels on random data. The multi-rank exchanges are in
scenarios/kv_compression.py.
"""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpi_kvstore import compression as cp
from mpi_kvstore.compression import buckets, kernels


def mxnet_quantize_2bit(grad, residual, threshold):
    """MXNet's loop: -> the values sent (its dequantize of its codes); residual in place."""
    pos, neg = np.float32(threshold), np.float32(-threshold)
    sent = np.zeros(grad.size, np.float32)
    for i in range(grad.size):
        residual[i] = np.float32(residual[i] + grad[i])
        if residual[i] >= pos:
            sent[i] = pos
            residual[i] = np.float32(residual[i] - pos)
        elif residual[i] <= neg:
            sent[i] = neg
            residual[i] = np.float32(residual[i] - neg)
    return sent


_SHIFTS = np.array([6, 4, 2, 0], np.uint8)


def quantize_2bit(grad, residual, threshold):
    """MXNet's quantize_2bit, vectorised: residual in place; -> codes (11 = +t, 10 = -t)."""
    residual += grad
    up = residual >= threshold
    down = residual <= -threshold
    residual[up] -= threshold
    residual[down] += threshold
    codes = np.zeros(residual.size, np.uint8)
    codes[up] = 3
    codes[down] = 2
    return codes


def pack_2bit(codes):
    """Four 2-bit codes per byte, the first in the highest bits (zeros pad the end)."""
    padded = np.zeros(-(-codes.size // 4) * 4, np.uint8)
    padded[:codes.size] = codes
    return np.bitwise_or.reduce(padded.reshape(-1, 4) << _SHIFTS, axis=1).astype(np.uint8)


def unpack_2bit(packed, count):
    """The codes of packed bytes (any leading shape), ``count`` per row."""
    codes = (packed[..., None] >> _SHIFTS) & 3
    return codes.reshape(packed.shape[:-1] + (-1,))[..., :count]


def compiled_codes(grad, residual, threshold):
    """The compiled quantize+pack, unpacked: -> codes; residual in place."""
    packed = np.empty(-(-grad.size // 4), np.uint8)
    kernels.quantize_pack(grad, residual, np.float32(threshold), packed)
    return unpack_2bit(packed, grad.size)


floats = st.floats(-4, 4, width=32, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(floats, min_size=1, max_size=30), min_size=1, max_size=4),
       st.sampled_from([0.5, 0.25, 0.3, 1.0, 1e-3]))
def test_quantize_matches_mxnet_loop_over_steps(steps, threshold):
    size = min(len(s) for s in steps)
    mine, theirs = np.zeros(size, np.float32), np.zeros(size, np.float32)
    for values in steps:
        grad = np.array(values[:size], np.float32)
        codes = compiled_codes(grad, mine, threshold)
        sent = mxnet_quantize_2bit(grad, theirs, threshold)
        decoded = np.where(codes == 3, np.float32(threshold),
                           np.where(codes == 2, np.float32(-threshold), np.float32(0)))
        np.testing.assert_array_equal(decoded, sent)
        np.testing.assert_array_equal(mine, theirs)


def test_quantize_at_the_threshold_sends_it():
    residual = np.zeros(3, np.float32)
    codes = compiled_codes(np.array([0.5, -0.5, 0.4999], np.float32), residual, 0.5)
    assert codes.tolist() == [3, 2, 0]
    assert residual.tolist() == [0.0, 0.0, np.float32(0.4999)]


@given(st.lists(st.sampled_from([0, 2, 3]), max_size=70))
def test_reference_pack_unpack_round_trip(codes):
    codes = np.array(codes, np.uint8)
    packed = pack_2bit(codes)
    assert packed.size == -(-codes.size // 4)       # four values a byte
    np.testing.assert_array_equal(unpack_2bit(packed, codes.size), codes)


def test_pack_layout_is_mxnets():
    """MXNet writes the first value of a byte in its two highest bits: 11 = +t, 10 = -t."""
    out = np.empty(1, np.uint8)
    kernels.quantize_pack(np.array([0.5, -0.5, 0, 0.5], np.float32), np.zeros(4, np.float32),
                      np.float32(0.5), out)
    assert out.tolist() == [0b11100011]
    kernels.quantize_pack(np.array([-0.5], np.float32), np.zeros(1, np.float32), np.float32(0.5), out)
    assert out.tolist() == [0b10000000]
    assert pack_2bit(np.array([3, 2, 0, 3], np.uint8)).tolist() == [0b11100011]


@pytest.mark.parametrize('params, words', [
    ({'type': '1bit'}, "'1bit' is not supported"),
    ({'type': 'fp16'}, "must be '2bit' or 'none'"),
    ({'type': '2bit', 'threshold': -1}, 'positive'),
    ({'type': '2bit', 'threshold': float('inf')}, 'positive finite'),
    ({'type': '2bit', 'threshold': 1e39}, 'as a float32'),
    ({'type': '2bit', 'threshold': '0.5'}, 'positive number'),
    ({'type': '2bit', 'extra': 1}, 'unknown parameter'),
    (['2bit'], 'takes a dict'),
])
def test_bad_params_say_what_is_wrong(params, words):
    with pytest.raises(ValueError, match=None) as err:
        cp.from_params(params)
    assert words in str(err.value)


def test_params_defaults_and_none():
    assert cp.from_params({'type': 'none'}) is None
    assert cp.from_params({'type': '2bit'}).spec == ('2bit', 0.5, 32)  # MXNet's default
    assert cp.wire_cast('none') is None and cp.wire_cast('bf16').spec == ('bf16',)
    with pytest.raises(ValueError, match='fp16'):
        cp.wire_cast('int8')
    ring = cp.wire_cast('fp16-ring')
    assert ring.ring and ring.kind == 'fp16' and ring.spec == ('fp16', 'ring')
    assert not cp.wire_cast('fp16').ring
    for spec in (('fp16', 'ring'), ('bf16',), ('2bit', 0.25, 8)):
        assert cp.from_spec(spec).spec == spec      # a joined rank's mirror codes alike
    assert cp.sign(7, ('fp16', 'ring')) != cp.sign(7, ('fp16',))


def test_ring_pieces_follow_each_key():
    """Piece i of the ring holds piece i of every request, so a value's path round the ring
    depends on its key alone, not on which keys share its bucket."""
    pieces = buckets.ring_pieces([5, 2, 7], 3)
    assert pieces == [[(0, 2), (5, 1), (7, 3)], [(2, 2), (6, 1), (10, 2)], [(4, 1), (12, 2)]]
    covered = sorted(i for spans in pieces for start, width in spans
                     for i in range(start, start + width))
    assert covered == list(range(14))


def test_signature_marks_the_codec():
    assert cp.sign(12345, ('2bit', 0.5)) != cp.sign(12345, ('2bit', 0.25)) != 12345
    assert 0 <= cp.sign(12345, ('fp16',)) < (1 << 30)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(floats, min_size=1, max_size=41), min_size=1, max_size=4),
       st.sampled_from([0.5, 0.3, 1e-3]), st.integers(1, 5))
def test_compiled_kernels_match_the_reference(steps, threshold, ranks):
    """The exchange's compiled quantize+pack and count+sum equal the numpy reference."""
    t = np.float32(threshold)
    size = min(len(s) for s in steps)
    fast, slow = np.zeros(size, np.float32), np.zeros(size, np.float32)
    for values in steps:
        grad = np.array(values[:size], np.float32)
        packed = np.empty(-(-size // 4), np.uint8)
        kernels.quantize_pack(grad, fast, t, packed)
        codes = quantize_2bit(grad, slow, t)
        np.testing.assert_array_equal(packed, pack_2bit(codes))
        np.testing.assert_array_equal(fast, slow)
        every = np.stack([np.roll(packed, r) for r in range(ranks)])   # other ranks' codes
        out = np.empty(size, np.float32)
        kernels.count_sum(every, size, t, out, kernels.DELTAS)
        unpacked = unpack_2bit(every, size)
        expected = ((unpacked == 3).sum(0) - (unpacked == 2).sum(0)).astype(np.float32) * t
        np.testing.assert_array_equal(out, expected)


def test_float16_decode_is_numpys_for_every_half():
    halves = np.arange(1 << 16, dtype=np.uint16)
    out = np.empty(halves.size, np.float32)
    kernels.decode_f16(halves, np.float32(1), out)
    expected = halves.view(np.float16).astype(np.float32)
    nan = np.isnan(expected)          # times the scale, a NaN may come back quietened
    np.testing.assert_array_equal(out[~nan].view(np.uint32), expected[~nan].view(np.uint32))
    assert np.isnan(out[nan]).all()


def test_float16_encode_is_numpys_bit_for_bit():
    """Random float32 bit patterns (NaNs, infinities, subnormals included) and every value
    halfway between two float16s and its neighbours, where rounding to even decides."""
    rng = np.random.default_rng(7)
    halves = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    finite = halves[np.isfinite(halves)]
    with np.errstate(all='ignore'):
        up = np.nextafter(finite, np.float16(np.inf)).astype(np.float64)
        mid = ((finite.astype(np.float64) + up) / 2).astype(np.float32)
    values = np.concatenate([
        rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32).view(np.float32),
        finite.astype(np.float32), mid, np.nextafter(mid, np.float32(np.inf)),
        np.nextafter(mid, np.float32(-np.inf)),
        np.array([65504, 65520, 65519.996, 1e-8, -1e-8, 6e-8, 3e-8], np.float32)])
    out = np.empty(values.size, np.uint16)
    kernels.encode_f16(values, np.float32(1), out)
    with np.errstate(all='ignore'):
        expected = values.astype(np.float16).view(np.uint16)
    nan = np.isnan(values)
    np.testing.assert_array_equal(out[~nan], expected[~nan])
    assert np.isnan(out[nan].view(np.float16)).all()


def test_float16_row_sums_round_once_in_rank_order():
    rng = np.random.default_rng(3)
    rows = rng.standard_normal((3, 5000)).astype(np.float16)
    out = np.empty(5000, np.uint16)
    kernels.sum_rows_f16(rows.view(np.uint16), out)
    acc = np.zeros(5000, np.float32)
    for row in rows:
        acc += row.astype(np.float32)
    np.testing.assert_array_equal(out, acc.astype(np.float16).view(np.uint16))
