"""Gluon training across two test hosts whose link the test cuts mid-training.

usage: fault_link_cut.py MARKER [DESIGN] [--steps N] [--cut-after K] [--step-seconds T]

Each rank trains a small convolutional net through the store (default options unless the
environment sets them). After step K rank 0 creates the file MARKER and prints when; the
test then takes h1's link down. The job must then end in words: a stall report naming the
collective and the rank that went silent, or a line naming the lost peer, never a bare
``Segmentation fault`` (tests/test_link_cut.py).
"""
import argparse
import time

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import mpi_kvstore

from common import RANK, SIZE

parser = argparse.ArgumentParser()
parser.add_argument('marker')
parser.add_argument('design', nargs='?', default=None)   # None: the store's default
parser.add_argument('--steps', type=int, default=100000)
parser.add_argument('--cut-after', type=int, default=5)
parser.add_argument('--step-seconds', type=float, default=0.05)
parser.add_argument('--hidden', type=int, default=0, help='a Dense layer of this many units (0: none)')
parser.add_argument('--late', type=float, default=0.0,
                    help='rank 1 sleeps this long before the step after the cut: rank 0 has '
                         'sent its part and waits, with nothing of its own in flight')
args = parser.parse_args()
PER_RANK = 4


def make_net():
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(8, 3, padding=1, in_channels=3, activation='relu'),
            gluon.nn.Flatten())
    if args.hidden:   # megabytes of gradient in flight when the link goes down
        net.add(gluon.nn.Dense(args.hidden, in_units=8 * 16 * 16))
    net.add(gluon.nn.Dense(10, in_units=args.hidden or 8 * 16 * 16))
    mx.random.seed(1234)
    net.initialize(mx.init.Xavier())
    return net


def main():
    net = make_net()
    kv = mpi_kvstore.create('dist_mpi', design=args.design)
    trainer = gluon.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1}, kvstore=kv)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    for step in range(args.steps):
        if step == args.cut_after + 1 and RANK == 1:
            time.sleep(args.late)
        rng = np.random.RandomState(100 + step * SIZE + RANK)
        data = mx.nd.array(rng.uniform(-1, 1, size=(PER_RANK, 3, 16, 16)).astype(np.float32))
        label = mx.nd.array(rng.randint(0, 10, size=(PER_RANK,)).astype(np.float32))
        with autograd.record():
            loss = loss_fn(net(data), label)
        loss.backward()
        trainer.step(PER_RANK * SIZE)
        mx.nd.waitall()
        if step == args.cut_after and RANK == 0:
            open(args.marker, 'w').close()
            print('fault_link_cut: rank 0 finished step %d at t=%.3f' % (step, time.time()),
                  flush=True)
        time.sleep(args.step_seconds)
    print('fault_link_cut: rank %d finished %d steps, which it should not have'
          % (RANK, args.steps), flush=True)


main()
