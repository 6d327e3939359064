"""Training with elastic.State under the supervisor (tests/test_elastic.py).

usage: elastic_train.py OUT [--steps N] [--commit-every K] [--kill-at S] [--kill-rank R]
                            [--kill-always] [--kill-in-commit C] [--raise-at S]
                            [--step-seconds T] [--marker FILE] [--trainer gluon|distributed]

A small convolutional net, Adam in the store (gluon update_on_kvstore), a global batch of
12 split over the ranks: the batch of step s is drawn from RandomState(s), so the data
order is decided by the step and any number of ranks sees the same global batches. On the
first launch (supervision.launch_index() == 0; every launch with --kill-always), rank R
SIGKILLs itself after step S, raises at step S (--raise-at), or SIGKILLs itself halfway
through writing commit C (--kill-in-commit). Rank 0 writes the final weights to OUT (npz)
and prints the step it resumed from.
"""
import argparse
import os
import signal
import time

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import mpi_kvstore
from mpi_kvstore import elastic
from mpi_kvstore.launch import supervision

from common import RANK, SIZE

GLOBAL = 12

parser = argparse.ArgumentParser()
parser.add_argument('out')
parser.add_argument('--steps', type=int, default=12)
parser.add_argument('--commit-every', type=int, default=5)
parser.add_argument('--kill-at', type=int, default=None)
parser.add_argument('--kill-rank', type=int, default=1)
parser.add_argument('--kill-always', action='store_true')
parser.add_argument('--kill-in-commit', type=int, default=None)
parser.add_argument('--raise-at', type=int, default=None)
parser.add_argument('--step-seconds', type=float, default=0.0)
parser.add_argument('--marker', default=None)
parser.add_argument('--trainer', choices=['gluon', 'distributed'], default='gluon')
args = parser.parse_args()
FIRST = supervision.launch_index() == 0 or args.kill_always


def make_net():
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(4, 3, padding=1, in_channels=2, activation='relu'),
            gluon.nn.Flatten(), gluon.nn.Dense(3, in_units=4 * 6 * 6))
    mx.random.seed(1234)
    net.initialize(mx.init.Xavier())
    return net


def batch(step):
    rng = np.random.RandomState(1000 + step)
    data = rng.uniform(-1, 1, size=(GLOBAL, 2, 6, 6)).astype(np.float32)
    label = rng.randint(0, 3, size=(GLOBAL,)).astype(np.float32)
    per = GLOBAL // SIZE
    return (mx.nd.array(data[RANK * per:(RANK + 1) * per]),
            mx.nd.array(label[RANK * per:(RANK + 1) * per]))


def kill_midway(state):
    """Rank 0 writes commit C's files, then dies before the rename."""
    write = state._write_files

    def dying(number, files):
        if number == args.kill_in_commit and FIRST:
            real_rename = os.rename
            os.rename = lambda *a: os.kill(os.getpid(), signal.SIGKILL)
            try:
                write(number, files)
            finally:
                os.rename = real_rename
        write(number, files)
    state._write_files = dying


def main():
    kv = mpi_kvstore.create('dist_mpi')
    net = make_net()
    if args.trainer == 'gluon':   # the optimizer in the store
        trainer = gluon.Trainer(net.collect_params(), 'adam', {'learning_rate': 0.01},
                                kvstore=kv, update_on_kvstore=True)
    else:                         # grouped pushpulls, the optimizer on each rank
        trainer = mpi_kvstore.DistributedTrainer(net.collect_params(), 'adam',
                                                 {'learning_rate': 0.01}, store=kv)

    def rescale(old, new):
        if RANK == 0:
            print('resized from %d to %d ranks' % (old, new), flush=True)

    state = elastic.State(net.collect_params(), trainer, step=0, on_resize=rescale)
    if RANK == 0:
        print('launch %d: starting at step %d (restored: %s)'
              % (supervision.launch_index(), state.step, state.restored), flush=True)
    if RANK == 0 and args.kill_in_commit is not None:
        kill_midway(state)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    for step in range(state.step, args.steps):
        data, label = batch(step)
        with autograd.record():
            loss = loss_fn(net(data), label)
        loss.backward()
        trainer.step(GLOBAL)
        if args.marker and RANK == 0 and step == 1:
            open(args.marker, 'w').close()
        if args.step_seconds:
            time.sleep(args.step_seconds)
        if FIRST and args.raise_at == step and RANK == args.kill_rank:
            raise ValueError('a bug in the training script at step %d' % step)
        if FIRST and args.kill_at == step and RANK == args.kill_rank:
            mx.nd.waitall()
            os.kill(os.getpid(), signal.SIGKILL)
        state.step = step + 1
        if state.step % args.commit_every == 0:
            state.commit()
    weights = [p.data().asnumpy() for p in net.collect_params().values()]
    if RANK == 0:
        np.savez(args.out, *weights)
        print('finished %d steps at %d ranks' % (args.steps, SIZE), flush=True)
    kv.close()


main()
