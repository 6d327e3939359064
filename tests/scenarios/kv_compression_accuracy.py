"""Training with compressed gradients ends near training without (issue 11, accuracy).

A small MLP on a synthetic regression, the same start and data on every run, each
rank its own shard; 60 SGD steps with each compression. The final loss over every
rank's data must be within the stated tolerance of the uncompressed run's:
  fp16, bf16      1% (16-bit sums of gradients: rounding only);
  2-bit           15% (t = 3, the scale of these gradients, which are sums over a batch
                  of 32: a value sends at most t a step, and error feedback carries the
                  rest; t = 0.05 ended at 21x the uncompressed loss, t = 2 within 7-12%).
"""
import mxnet as mx
import numpy as np
from mpi4py import MPI
from mxnet import autograd, gluon

import mpi_kvstore

from common import RANK, SIZE, design_arg, done

DESIGN = design_arg()
TOLERANCE = {'fp16': 0.01, 'bf16': 0.01, '2bit': 0.15}
STEPS, BATCH = 60, 32
THRESHOLD = 3.0      # on the scale of these gradients (sums over a batch of 32)


def data(rank):
    rng = np.random.default_rng(100 + rank)
    x = rng.standard_normal((BATCH, 8)).astype(np.float32)
    w = np.random.default_rng(0).standard_normal((8, 1)).astype(np.float32)
    y = np.tanh(x @ w) + 0.05 * rng.standard_normal((BATCH, 1)).astype(np.float32)
    return mx.nd.array(x), mx.nd.array(y)


def train(kind):
    options = {'compression': kind} if kind in ('fp16', 'bf16') else {}
    kv = mpi_kvstore.create('dist_mpi', design=DESIGN, **options)
    mx.random.seed(7)
    net = gluon.nn.Sequential()
    net.add(gluon.nn.Dense(16, activation='tanh', in_units=8), gluon.nn.Dense(1, in_units=16))
    net.initialize(mx.init.Xavier())
    params = {'compression_params': {'type': '2bit', 'threshold': THRESHOLD}} if kind == '2bit' else {}
    trainer = gluon.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1}, kvstore=kv,
                            update_on_kvstore=False, **params)
    x, y = data(RANK)
    loss_fn = gluon.loss.L2Loss()
    for _ in range(STEPS):
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(BATCH * SIZE)
    final = float(loss_fn(net(x), y).mean().asscalar())
    kv.close()
    return MPI.COMM_WORLD.allreduce(final) / SIZE


losses = {kind: train(kind) for kind in ('none', 'fp16', 'bf16', '2bit')}
if RANK == 0:
    print('final losses: ' + ', '.join('%s %.5f' % kv for kv in losses.items()), flush=True)
for kind, tol in TOLERANCE.items():
    rel = abs(losses[kind] - losses['none']) / losses['none']
    assert rel <= tol, ('%s: final loss %.5f is %.1f%% from the uncompressed %.5f (allowed %g%%)'
                        % (kind, losses[kind], 100 * rel, losses['none'], 100 * tol))
done('kv_compression_accuracy[%s]' % DESIGN)
