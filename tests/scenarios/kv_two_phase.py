"""Two-phase 2-bit compression (compression.TwoBit from two_phase_min_ranks ranks on),
against a numpy simulation of every rank and of every chunk owner.

usage: kv_two_phase.py DESIGN

The store is made with two_phase_min_ranks=2, so the scheme meant for 32 ranks and more
runs here. Each rank's gradients are a function of (rank, step, key); the simulation
quantizes every rank's with its residual (MXNet's semantics), counts the values sent into
sums, and requantises the sums with the owner's residual: what the store must return,
bitwise, on every rank. Calls alternate between one fused call and one call a key, which
must not matter (an owner's residual is per key). Each rank's owner residual is checked
too, and that nothing is lost: what all steps returned plus what the owners hold
back equals what the ranks sent.
"""
import mxnet as mx
import numpy as np

import mpi_kvstore

from common import RANK, SIZE, design_arg, done, same_on_all_ranks

DESIGN = design_arg()
SHAPES = {'a': (37,), 'b': (5, 7), 'big': (3000,)}
T = np.float32(0.5)
STEPS = 5


def grad(rank, step, key):
    rng = np.random.default_rng([rank, step, sum(map(ord, key))])
    return (rng.standard_normal(SHAPES[key]) * 0.6).astype(np.float32).ravel()


def quantize(values, residual):
    """residual += values; >= t sends +t, <= -t sends -t, else 0; residual -= sent."""
    residual += values
    sent = np.where(residual >= T, T, np.where(residual <= -T, -T, np.float32(0)))
    residual -= sent
    return sent.astype(np.float32)


def owned_slice(key):
    """The values of key whose chunk this rank owns: 4 * ceil(ceil(n / 4) / N) a rank."""
    count = int(np.prod(SHAPES[key]))
    width = 4 * -(-(-(-count // 4)) // SIZE)  # noqa: B002 (ceil(ceil(n / 4) / N) in integers)
    return width * RANK, width


kv = mpi_kvstore.create('dist_mpi', design=DESIGN, two_phase_min_ranks=2)
kv.set_gradient_compression({'type': '2bit', 'threshold': float(T)})
keys = list(SHAPES)
residual = {(r, k): np.zeros(int(np.prod(SHAPES[k])), np.float32) for r in range(SIZE)
            for k in keys}
owner = {k: np.zeros(int(np.prod(SHAPES[k])), np.float32) for k in keys}
returned = {k: np.zeros(int(np.prod(SHAPES[k])), np.float64) for k in keys}
sent_total = {k: np.zeros(int(np.prod(SHAPES[k])), np.float64) for k in keys}
for step in range(STEPS):
    arrays = [mx.nd.array(grad(RANK, step, k).reshape(SHAPES[k])) for k in keys]
    if step % 2:
        kv.pushpull(keys, arrays)
    else:
        for k, arr in zip(keys, arrays):
            kv.pushpull(k, arr)
    for k, arr in zip(keys, arrays):
        sent = [quantize(grad(r, step, k), residual[(r, k)]) for r in range(SIZE)]
        ups = sum((s > 0).astype(np.int32) - (s < 0).astype(np.int32) for s in sent)
        sums = np.float32(1) * ups.astype(np.float32) * T
        expected = quantize(sums, owner[k])
        got = arr.asnumpy().ravel()
        same_on_all_ranks(got, 'two-phase %s step %d' % (k, step))
        np.testing.assert_array_equal(got, expected, err_msg='rank %d: two-phase 2-bit, key %s, '
                                      'step %d' % (RANK, k, step))
        np.testing.assert_array_equal(kv._exchange.codec.residual(k), residual[(RANK, k)])
        start, width = owned_slice(k)
        mine = np.zeros(width, np.float32)
        part = owner[k][start:start + width]
        mine[:part.size] = part
        np.testing.assert_array_equal(kv._exchange.codec.owner_residual(k), mine,
                                      err_msg='rank %d: owner residual of %s' % (RANK, k))
        returned[k] += got
        sent_total[k] += sum(sent)
for k in keys:   # nothing is lost: what came back plus what the owners hold is what was sent
    np.testing.assert_allclose(returned[k] + owner[k], sent_total[k], rtol=0, atol=1e-5)
assert any(np.abs(owner[k]).max() > 0 for k in keys), 'the owners never held anything back'
kv.close()
# what came back to this rank and what was sent, summed over its steps, and what the owners
# hold back: for the test's own balance
done('kv_two_phase[%s]' % DESIGN, returned={k: float(returned[k].sum()) for k in keys},
     sent={k: float(sent_total[k].sum()) for k in keys},
     held={k: float(owner[k].sum()) for k in keys})
