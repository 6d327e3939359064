"""Train a small classifier the Horovod way, on mpi_kvstore.

    mpirun -n 2 python examples/horovod_style.py --epochs 2

Written as a horovod.mxnet script is: hvd.init(), the learning rate scaled by hvd.size(),
broadcast_parameters, a DistributedTrainer that averages gradients, trainer.step(local batch
size), and rank 0 alone printing. Only the import line differs from Horovod's. The data is
synthetic and embedded (ten noisy class prototypes), each rank training on its own part.
"""
import argparse
import time

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import mpi_kvstore.horovod as hvd  # instead of: import horovod.mxnet as hvd

FEATURES, CLASSES = 64, 10


def synthetic(count, seed):
    """``count`` samples: a class's prototype (the same on every rank) plus noise."""
    prototypes = np.random.RandomState(1234).normal(0, 1, (CLASSES, FEATURES))
    rng = np.random.RandomState(seed)
    labels = rng.randint(0, CLASSES, count)
    data = prototypes[labels] + rng.normal(0, 3.0, (count, FEATURES))
    return data.astype('float32'), labels.astype('float32')


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--batch-size', type=int, default=32, help='batch size of one rank')
    p.add_argument('--epochs', type=int, default=2)
    p.add_argument('--steps', type=int, default=0, help='steps an epoch (0: the whole part)')
    p.add_argument('--lr', type=float, default=0.02, help='learning rate of one rank')
    p.add_argument('--momentum', type=float, default=0.9)
    p.add_argument('--fp16-allreduce', action='store_true', help='Compression.fp16')
    p.add_argument('--gradient-predivide-factor', type=float, default=1.0)
    return p.parse_args()


def evaluate(net, data, labels, batch_size, context):
    """Summed loss, correct answers and count over this rank's part."""
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    loss = correct = 0.0
    for start in range(0, len(labels), batch_size):
        x = mx.nd.array(data[start:start + batch_size], ctx=context)
        y = mx.nd.array(labels[start:start + batch_size], ctx=context)
        out = net(x)
        loss += loss_fn(out, y).sum().asscalar()
        correct += (out.argmax(axis=1) == y).sum().asscalar()
    return np.array([loss, correct, len(labels)])


def main():
    args = parse_args()
    hvd.init()
    context = mx.cpu(hvd.local_rank())

    # Each rank reads its own part of the training set; all of them evaluate the whole test set.
    train_x, train_y = synthetic(4096, seed=0)
    train_x, train_y = train_x[hvd.rank()::hvd.size()], train_y[hvd.rank()::hvd.size()]
    test_x, test_y = synthetic(1024, seed=1)
    steps = len(train_y) // args.batch_size
    if args.steps:
        steps = min(steps, args.steps)

    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(128, activation='relu'), gluon.nn.Dense(CLASSES))
    net.initialize(mx.init.Xavier(magnitude=2), ctx=context)   # shapes deferred to the data
    net.hybridize()

    # Horovod: start every rank from rank 0's weights (deferred ones at the first forward).
    params = net.collect_params()
    hvd.broadcast_parameters(params, root_rank=0)

    # Horovod: scale the learning rate by the number of workers; gradients are averaged.
    opt = mx.optimizer.create('sgd', learning_rate=args.lr * hvd.size(),
                              momentum=args.momentum)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    trainer = hvd.DistributedTrainer(params, opt, compression=compression,
                                     gradient_predivide_factor=args.gradient_predivide_factor)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()

    if hvd.rank() == 0:
        print('horovod_style: %d rank(s), %d steps/epoch of %d images a rank'
              % (hvd.size(), steps, args.batch_size), flush=True)
    order = np.random.RandomState(hvd.rank())
    for epoch in range(args.epochs):
        tic = time.perf_counter()
        perm = order.permutation(len(train_y))
        totals = np.zeros(3)
        for step in range(steps):
            rows = perm[step * args.batch_size:(step + 1) * args.batch_size]
            x = mx.nd.array(train_x[rows], ctx=context)
            y = mx.nd.array(train_y[rows], ctx=context)
            with autograd.record():
                out = net(x)
                loss = loss_fn(out, y)
            loss.backward()
            trainer.step(args.batch_size)     # Horovod: the local batch size
            totals += [loss.sum().asscalar(), (out.argmax(axis=1) == y).sum().asscalar(),
                       len(rows)]
        elapsed = time.perf_counter() - tic
        # Horovod: sums over the ranks for the epoch's figures
        train_sum = hvd.allreduce(mx.nd.array(totals), op=hvd.Sum, name='train').asnumpy()
        val = evaluate(net, test_x, test_y, 256, context)
        if hvd.rank() == 0:
            print('epoch %d/%d: loss=%.4f acc=%.4f val_loss=%.4f val_acc=%.4f images/s=%.1f '
                  'time=%.1fs' % (epoch + 1, args.epochs, train_sum[0] / train_sum[2],
                                  train_sum[1] / train_sum[2], val[0] / val[2], val[1] / val[2],
                                  train_sum[2] / elapsed, elapsed), flush=True)

    # Every rank holds the same weights: compare a checksum of each rank's.
    checksum = float(sum(p.data().asnumpy().astype(np.float64).sum()
                         for p in params.values()))
    sums = hvd.allgather_object(checksum)
    if hvd.rank() == 0:
        print('weights identical on all %d ranks: %s' % (hvd.size(), len(set(sums)) == 1),
              flush=True)
    hvd.shutdown()


if __name__ == '__main__':
    main()
