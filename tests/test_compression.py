"""compression.py's pure parts against independent references.

MXNet's quantize_2bit (src/kvstore/gradient_compression-inl.h) is transcribed
here element by element, as its C loop runs, and the vectorised quantizer must
match it bit for bit over several steps of carried residuals, thresholds hit
exactly included. The multi-rank exchanges are in scenarios/kv_compression.py.
"""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from mpi_kvstore import compression as cp


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


floats = st.floats(-4, 4, width=32, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(floats, min_size=1, max_size=30), min_size=1, max_size=4),
       st.sampled_from([0.5, 0.25, 0.3, 1.0, 1e-3]))
def test_quantize_matches_mxnet_loop_over_steps(steps, threshold):
    size = min(len(s) for s in steps)
    mine, theirs = np.zeros(size, np.float32), np.zeros(size, np.float32)
    for values in steps:
        grad = np.array(values[:size], np.float32)
        codes = cp.quantize_2bit(grad, mine, np.float32(threshold))
        sent = mxnet_quantize_2bit(grad, theirs, threshold)
        decoded = np.where(codes == 3, np.float32(threshold),
                           np.where(codes == 2, np.float32(-threshold), np.float32(0)))
        np.testing.assert_array_equal(decoded, sent)
        np.testing.assert_array_equal(mine, theirs)


def test_quantize_at_the_threshold_sends_it():
    residual = np.zeros(3, np.float32)
    codes = cp.quantize_2bit(np.array([0.5, -0.5, 0.4999], np.float32), residual, np.float32(0.5))
    assert codes.tolist() == [3, 2, 0]
    assert residual.tolist() == [0.0, 0.0, np.float32(0.4999)]


@given(st.lists(st.sampled_from([0, 2, 3]), max_size=70))
def test_pack_unpack_round_trip(codes):
    codes = np.array(codes, np.uint8)
    packed = cp.pack_2bit(codes)
    assert packed.size == -(-codes.size // 4)       # four values a byte
    np.testing.assert_array_equal(cp.unpack_2bit(packed, codes.size), codes)


def test_pack_layout_is_mxnets():
    """MXNet writes the first value of a byte in its two highest bits: 11 = +t, 10 = -t."""
    assert cp.pack_2bit(np.array([3, 2, 0, 3], np.uint8)).tolist() == [0b11100011]
    assert cp.pack_2bit(np.array([2], np.uint8)).tolist() == [0b10000000]


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
    assert cp.from_params({'type': '2bit'}).spec == ('2bit', 0.5)      # MXNet's default
    assert cp.wire_cast('none') is None and cp.wire_cast('bf16').spec == ('bf16',)
    with pytest.raises(ValueError, match='fp16'):
        cp.wire_cast('int8')


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
        cp._quantize_pack(grad, fast, t, packed)
        codes = cp.quantize_2bit(grad, slow, t)
        np.testing.assert_array_equal(packed, cp.pack_2bit(codes))
        np.testing.assert_array_equal(fast, slow)
        every = np.stack([np.roll(packed, r) for r in range(ranks)])   # other ranks' codes
        out = np.empty(size, np.float32)
        cp._count_sum(every, size, t, out, cp._DELTAS)
        unpacked = cp.unpack_2bit(every, size)
        expected = ((unpacked == 3).sum(0) - (unpacked == 2).sum(0)).astype(np.float32) * t
        np.testing.assert_array_equal(out, expected)
