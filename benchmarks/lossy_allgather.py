"""What a 16-bit weight allgather would cost the sharded optimizer (docs/sharded-optimizer.md):
one process trains a small classifier with Adam, rounding every weight to fp16 or bf16 after
each step, as receiving the other ranks' shares in 16 bits would, against exact weights.

    python -m benchmarks.lossy_allgather [--steps 200] [--seeds 3]

No MPI: the rounding is the whole effect (a rank's own share would stay exact in its
optimizer's float32 state; here every weight is rounded, an upper bound). Prints, per seed,
the mean loss over the last 20 steps and the accuracy on 2000 held-out samples.
"""
import time

import ml_dtypes
import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

from benchmarks import harness
from benchmarks.sharded_loss import CLASSES, FEATURES, HIDDEN, samples, templates

ROUNDINGS = {'exact': None, 'fp16': np.float16, 'bf16': ml_dtypes.bfloat16}


def batch(temps, seed, count):
    """sharded_loss's synthetic data, drawn from a generator seeded by `seed` alone."""
    data, labels = samples(temps, np.random.RandomState(seed), count)
    return mx.nd.array(data), labels


def train(rounding, seed, steps, lr):
    """-> (mean loss of the last 20 steps, held-out accuracy)."""
    mx.random.seed(seed)
    temps = templates(seed)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(HIDDEN, activation='relu', in_units=FEATURES),
            gluon.nn.Dense(CLASSES, in_units=HIDDEN))
    net.initialize(mx.init.Xavier())
    trainer = gluon.Trainer(net.collect_params(), 'adam', {'learning_rate': lr})
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    losses = []
    for step in range(steps):
        data, labels = batch(temps, 1000 + step, 64)
        with autograd.record():
            loss = loss_fn(net(data), mx.nd.array(labels))
        loss.backward()
        trainer.step(64)
        losses.append(loss.mean().asscalar())
        if rounding is not None:
            for param in net.collect_params().values():
                rounded = param.data().asnumpy().astype(rounding).astype(np.float32)
                param.set_data(mx.nd.array(rounded))
    data, labels = batch(temps, 7, 2000)
    accuracy = float((net(data).argmax(axis=1).asnumpy() == labels).mean())
    return float(np.mean(losses[-20:])), accuracy


def main():
    parser = harness.parser(__doc__)
    parser.add_argument('--steps', type=int, default=200)
    parser.add_argument('--seeds', type=int, default=3)
    parser.add_argument('--lr', type=float, default=1e-3)
    args = parser.parse_args()
    print('Adam lr %g, %d steps, %s' % (args.lr, args.steps,
                                        time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())))
    for name, rounding in ROUNDINGS.items():
        runs = [train(rounding, seed, args.steps, args.lr) for seed in range(args.seeds)]
        print('%-5s loss (last 20 steps) %s   accuracy %s'
              % (name, ' '.join('%.4f' % loss for loss, _ in runs),
                 ' '.join('%.3f' % acc for _, acc in runs)))


if __name__ == '__main__':
    main()
