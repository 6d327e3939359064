"""Gradient compression (compression/) against numpy simulations of every rank.

Each rank's gradients are a function of (rank, step, key), so every rank can compute
what every other rank sends, and the expected result, with numpy alone:
- 2-bit (kv.set_gradient_compression): MXNet's quantizer written out again here
  (residual += grad; >= t sends +t, <= -t sends -t), the residuals carried across
  steps, the result the float32 sum over ranks of the values sent;
- fp16 / bf16 (store option compression): x / N rounded to 16 bits, summed in float32
  in rank order, rounded to 16 bits again, times N;
and, for both, results bitwise identical on every rank, float64 keys untouched by 2-bit,
errors on every rank (not hangs) for a rank that compresses differently and for an
fp16 overflow, and a store that goes on working after them.
"""
import ml_dtypes
import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import mpi_kvstore
from mpi_kvstore import compression

from common import RANK, SIZE, design_arg, done, expect_raises, same_on_all_ranks

DESIGN = design_arg()
# For the test: the values 2-bit's sums took, by threshold; and by wire cast, the largest
# error against the exact sum in roundings of the 16-bit format (error / (unit * sum of
# |values|), with a floor of 1e-6 below)
TWO_BIT_VALUES, WIRE_ROUNDINGS = {}, {}
SHAPES = {'a': (37,), 'b': (5, 7), 'big': (3000,)}


def grad(rank, step, key, dtype=np.float32, scale=1.0):
    rng = np.random.default_rng([rank, step, sum(map(ord, key))])
    return (rng.standard_normal(SHAPES[key]) * scale).astype(dtype)


def quantize(g, residual, t):
    """MXNet's quantize_2bit, element by element semantics, vectorised anew."""
    residual += g
    sent = np.where(residual >= t, t, np.where(residual <= -t, -t, np.float32(0)))
    residual -= sent
    return sent.astype(np.float32)


def check_two_bit(kv, t):
    t = np.float32(t)
    kv.set_gradient_compression({'type': '2bit', 'threshold': float(t)})
    keys = ['a', 'b', 'big']
    residual = {(r, k): np.zeros(SHAPES[k], np.float32) for r in range(SIZE) for k in keys}
    for step in range(4):
        arrays = [mx.nd.array(grad(RANK, step, k, scale=0.6)) for k in keys]
        f64 = mx.nd.array(grad(RANK, step, 'a', np.float64), dtype=np.float64)
        if step % 2:
            kv.pushpull(keys, arrays)                       # one call: one fused bucket
        else:
            for k, arr in zip(keys, arrays):
                kv.pushpull(k, arr)
        kv.pushpull('f64', f64)
        for k, arr in zip(keys, arrays):
            expected = np.zeros(SHAPES[k], np.float32)
            for r in range(SIZE):
                expected += quantize(grad(r, step, k, scale=0.6), residual[(r, k)], t)
            got = arr.asnumpy()
            same_on_all_ranks(got, '2bit %s step %d' % (k, step))
            np.testing.assert_allclose(got, expected, rtol=1e-6, atol=0,
                                       err_msg='rank %d: 2bit t=%g key %s step %d'
                                               % (RANK, t, k, step))
            np.testing.assert_array_equal(kv._exchange.codec.residual(k), residual[(RANK, k)].ravel())
            TWO_BIT_VALUES.setdefault(str(t), set()).update(got.ravel().tolist())
        exact = sum(grad(r, step, 'a', np.float64) for r in range(SIZE))
        np.testing.assert_allclose(f64.asnumpy(), exact, rtol=1e-12,
                                   err_msg='float64 keys are not 2-bit compressed')
    kv.set_gradient_compression({'type': 'none'})
    plain = mx.nd.array(grad(RANK, 9, 'a'))
    kv.pushpull('a', plain)
    np.testing.assert_allclose(plain.asnumpy(), sum(grad(r, 9, 'a') for r in range(SIZE)),
                               rtol=1e-5, err_msg="after {'type': 'none'}: exact sums")


def check_bad_params(kv):
    for params, words in (({'type': '1bit'}, "'1bit' is not supported"),
                          ({'type': '2bit', 'threshold': 0}, 'positive'),
                          ({'type': '2bit', 'threshold': float('nan')}, 'positive'),
                          ({'type': '2bit', 'threshold': True}, 'positive number'),
                          ({'type': '2bit', 'thresold': 0.5}, 'unknown parameter'),
                          ('2bit', 'takes a dict')):
        expect_raises(ValueError, kv.set_gradient_compression, params, contains=words)
    assert kv._exchange.codec is None, 'a rejected set_gradient_compression changed the store'


def check_mismatch(kv):
    """Rank 0 compresses, the others do not: every rank raises; rank 0's residual is untouched."""
    if SIZE == 1:
        return
    if RANK == 0:
        kv.set_gradient_compression({'type': '2bit', 'threshold': 0.5})
    value = mx.nd.array(grad(RANK, 0, 'b'))

    def call():
        kv.pushpull('mm', value)
        kv.wait()
        value.asnumpy()
    expect_raises((mpi_kvstore.RankMismatchError, mx.base.MXNetError), call,
                  contains='ranks disagree')
    kv.wait() if DESIGN != 'chained' else None
    if RANK == 0:
        assert kv._exchange.codec.residual('mm') is None, 'a rejected call left a residual'
        kv.set_gradient_compression({'type': 'none'})
    again = mx.nd.array(grad(RANK, 1, 'b'))
    kv.pushpull('mm', again)
    np.testing.assert_allclose(again.asnumpy(), sum(grad(r, 1, 'b') for r in range(SIZE)),
                               rtol=1e-5, err_msg='store usable after a compression mismatch')


def simulate_cast(parts, wire):
    n = len(parts)
    acc = np.zeros(parts[0].shape, np.float32)
    for x in parts:
        acc += (x * np.float32(1.0 / n)).astype(wire).astype(np.float32)
    return acc.astype(wire).astype(np.float32) * np.float32(n)


def simulate_ring(parts, wire):
    """The compression-assisted ring: piece c starts at rank c as its values / N, and at each
    next rank is rounded to 16 bits, decoded and added to that rank's own values / N in
    float32; the last rank's sum is rounded once more, and comes back times N."""
    n, count = len(parts), parts[0].size
    counts = [count // n + (i < count % n) for i in range(n)]
    starts = [sum(counts[:i]) for i in range(n)]
    scale = np.float32(1.0 / n)
    out = np.empty(count, np.float32)
    for c in range(n):
        piece = slice(starts[c], starts[c] + counts[c])
        acc = parts[c].ravel()[piece] * scale
        for hop in range(1, n):
            acc = parts[(c + hop) % n].ravel()[piece] * scale + \
                acc.astype(wire).astype(np.float32)
        out[piece] = acc.astype(wire).astype(np.float32) * np.float32(n)
    return out.reshape(parts[0].shape)


# Unit roundoff of the 16-bit formats: a rounding moves a value by at most this share of it.
UNIT = {np.float16: 2.0 ** -11, ml_dtypes.bfloat16: 2.0 ** -8}


def check_wire_cast(kind):
    wire = np.float16 if kind.startswith('fp16') else ml_dtypes.bfloat16
    ring = kind.endswith('-ring')
    kv = mpi_kvstore.create('dist_mpi', design=DESIGN, compression=kind)
    for step in range(2):
        keys = ['a', 'b', 'big']
        arrays = [mx.nd.array(grad(RANK, step, k, scale=3.0)) for k in keys]
        kv.pushpull(keys, arrays)
        f64 = mx.nd.array(grad(RANK, step, 'a', np.float64, 3.0), dtype=np.float64)
        kv.pushpull('f64', f64)
        for k, arr in zip(keys + ['f64'], arrays + [f64]):
            dtype = np.float64 if k == 'f64' else np.float32
            shape_key = 'a' if k == 'f64' else k
            got = arr.asnumpy()
            assert got.dtype == dtype, (k, got.dtype)
            same_on_all_ranks(got, '%s %s step %d' % (kind, k, step))
            parts = [grad(r, step, shape_key, dtype, 3.0).astype(np.float32) for r in range(SIZE)]
            simulate = simulate_ring if ring else simulate_cast
            expected = simulate(parts, wire) if SIZE > 1 else parts[0]
            np.testing.assert_array_equal(got.astype(np.float32), expected,
                                          err_msg='rank %d: %s key %s step %d' % (RANK, kind, k, step))
            exact = sum(p.astype(np.float64) for p in parts)
            np.testing.assert_allclose(got, exact, rtol=0, atol=0.05 * SIZE * 3.0,
                                       err_msg='%s too far from the exact sum' % kind)
            # Compress-once rounds each value once and each sum once; the ring rounds each
            # of the N-1 partial sums on its way and the sum: N roundings of up to |sum|.
            magnitude = sum(np.abs(p.astype(np.float64)) for p in parts)
            bound = (SIZE if ring else 2) * UNIT[wire] * magnitude * 1.01 + 1e-6
            error = np.abs(got.astype(np.float64) - exact)
            WIRE_ROUNDINGS[kind] = max(WIRE_ROUNDINGS.get(kind, 0.0), float(
                (error / (UNIT[wire] * magnitude + 1e-6)).max()))
            assert (error <= bound).all(), ('rank %d: %s error %g over its bound %g'
                                            % (RANK, kind, error.max(), bound.ravel()[
                                                np.argmax(error - bound)]))
    if kind.startswith('fp16') and SIZE > 1:
        overflow_fails_then_sums(kv, mx.nd.ones((10,)) * 1e5)
    kv.close()


def overflow_fails_then_sums(kv, huge):
    """A pushpull of ``huge``, whose fp16 sum overflows, fails on every rank; a pushpull of
    ones of its size after it sums right."""
    expect_raises((mpi_kvstore.MPIKVStoreError, mx.base.MXNetError),
                  lambda: (kv.pushpull('huge', huge), kv.wait(), huge.asnumpy()),
                  contains='fp16 compression')
    mx.nd.waitall() if DESIGN == 'chained' else None
    after = mx.nd.ones(huge.shape)
    kv.pushpull('after', after)
    np.testing.assert_array_equal(after.asnumpy(), np.full(huge.shape, SIZE, np.float32))


def check_pipelined_overflow():
    """An fp16 sum that overflows only in the last of a pipelined bucket's pieces (the
    earlier ones are decoded by then) still fails the call on every rank, and the store
    goes on working."""
    if SIZE == 1:
        return
    kv = mpi_kvstore.create('dist_mpi', design=DESIGN, compression='fp16')
    late = mx.nd.ones((3000,))
    late[2900:] = 1e5
    overflow_fails_then_sums(kv, late)
    kv.close()


def check_trainer(kv):
    """gluon.Trainer passes compression_params to the store; the ranks stay identical."""
    net = gluon.nn.Dense(3, in_units=4)
    net.initialize(mx.init.Constant(0.1))
    trainer = gluon.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.5}, kvstore=kv,
                            compression_params={'type': '2bit', 'threshold': 0.05},
                            update_on_kvstore=False)
    for step in range(3):
        x = mx.nd.array(np.random.default_rng([RANK, step]).standard_normal((2, 4)))
        with autograd.record():
            loss = (net(x) ** 2).sum()
        loss.backward()
        trainer.step(2 * SIZE)
    assert kv._exchange.codec is not None and kv._exchange.codec.spec == ('2bit', float(np.float32(0.05)), 32)
    for name, p in net.collect_params().items():
        same_on_all_ranks(p.data().asnumpy(), name + ' after 2bit training')
    assert any(kv._exchange.codec.residual(k) is not None for k in range(2)), 'no residual kept'
    kv.set_gradient_compression({'type': 'none'})


def main():
    kv = mpi_kvstore.create('dist_mpi', design=DESIGN)
    check_bad_params(kv)
    check_two_bit(kv, 0.5)       # +-0.5: every sum exact in float32
    check_two_bit(kv, 0.3)
    check_mismatch(kv)
    check_trainer(kv)
    kv.wait()
    kv.close()
    for kind in ('fp16', 'bf16', 'fp16-ring', 'bf16-ring'):
        check_wire_cast(kind)
    # Buckets of over 2 pieces go through the pipelined compress-once: pieces small enough
    # here that the 3000-value key and the fused call are cut into several.
    real, compression.WireCast.pipeline_values = compression.WireCast.pipeline_values, 700
    try:
        for kind in ('fp16', 'bf16'):
            check_wire_cast(kind)
        check_pipelined_overflow()
    finally:
        compression.WireCast.pipeline_values = real
    done('kv_compression[%s]' % DESIGN, wire_roundings=WIRE_ROUNDINGS,
         two_bit_values={t: sorted(values) for t, values in TWO_BIT_VALUES.items()})


main()
