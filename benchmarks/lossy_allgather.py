"""What a 16-bit weight allgather would cost the sharded optimizer (docs/sharded-optimizer.md):
one process trains a small classifier with Adam, rounding every weight to fp16 or bf16 after
each step, as receiving the other ranks' shares in 16 bits would, against exact weights.

    python -m benchmarks.lossy_allgather [--steps 200] [--seeds 3]

No MPI: the rounding is the whole effect (a rank's own share would stay exact in its
optimizer's float32 state; here every weight is rounded, an upper bound). Prints, per seed,
the mean loss over the last 20 steps and the accuracy on 2000 held-out samples.
"""
import argparse
import time

import ml_dtypes
import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

ROUNDINGS = {'exact': None, 'fp16': np.float16, 'bf16': ml_dtypes.bfloat16}


def batch(templates, seed, count, noise=1.5):
    rng = np.random.RandomState(seed)
    labels = rng.randint(0, len(templates), count)
    data = templates[labels] + rng.normal(0, noise, (count, templates.shape[1]))
    return mx.nd.array(data.astype(np.float32)), labels


def train(rounding, seed, steps, lr):
    """-> (mean loss of the last 20 steps, held-out accuracy)."""
    mx.random.seed(seed)
    templates = np.random.RandomState(seed).uniform(-1, 1, (10, 64)).astype(np.float32)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(128, activation='relu', in_units=64), gluon.nn.Dense(10, in_units=128))
    net.initialize(mx.init.Xavier())
    trainer = gluon.Trainer(net.collect_params(), 'adam', {'learning_rate': lr})
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    losses = []
    for step in range(steps):
        data, labels = batch(templates, 1000 + step, 64)
        with autograd.record():
            loss = loss_fn(net(data), mx.nd.array(labels))
        loss.backward()
        trainer.step(64)
        losses.append(loss.mean().asscalar())
        if rounding is not None:
            for param in net.collect_params().values():
                rounded = param.data().asnumpy().astype(rounding).astype(np.float32)
                param.set_data(mx.nd.array(rounded))
    data, labels = batch(templates, 7, 2000)
    accuracy = float((net(data).argmax(axis=1).asnumpy() == labels).mean())
    return float(np.mean(losses[-20:])), accuracy


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
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
