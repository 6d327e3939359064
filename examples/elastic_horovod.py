"""Horovod's elastic pattern on MXNet: ``hvd.elastic.run``, ``MXNetState`` and a reset
callback that rescales the learning rate and repartitions the data by the new size and rank.

    mpiexec -n 2 python examples/elastic_horovod.py                 # a fixed MPI world
    mpiexec -n 2 python examples/elastic_horovod.py --fail-at 7     # one simulated reset

A script written for ``horovod.torch``'s elastic mode reads the same: the state commits
every few batches (an in-memory copy); a HorovodInternalError (a lost peer) restores the last
commit, re-forms the world and syncs the state from rank 0 before ``train`` is called again;
the reset callbacks then see the new ``hvd.size()`` and ``hvd.rank()``. In a fixed MPI world
a reset keeps the same ranks; ``--fail-at`` raises HorovodInternalError on every rank once,
after that batch, to show the path. Under ``python -m mpi_kvstore run --state-dir D`` every
commit also goes to disk, and a relaunched job resumes from it (docs/elastic.md).
"""
import argparse

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import mpi_kvstore.horovod as hvd

parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
parser.add_argument('--epochs', type=int, default=2)
parser.add_argument('--batches', type=int, default=12, help='batches per epoch')
parser.add_argument('--batch-size', type=int, default=16, help='samples per rank and batch')
parser.add_argument('--lr', type=float, default=0.05, help='learning rate of one rank')
parser.add_argument('--commit-every', type=int, default=4)
parser.add_argument('--fail-at', type=int, default=None,
                    help='raise HorovodInternalError on every rank once, after this batch')
args = parser.parse_args()

hvd.init()
rng = np.random.RandomState(0)
DATA = rng.uniform(-1, 1, (4096, 20)).astype(np.float32)
LABELS = (DATA[:, :10].sum(axis=1) > DATA[:, 10:].sum(axis=1)).astype(np.float32)

net = gluon.nn.HybridSequential()
net.add(gluon.nn.Dense(32, in_units=20, activation='relu'), gluon.nn.Dense(2, in_units=32))
mx.random.seed(1)
net.initialize(mx.init.Xavier())
net.hybridize()
# linear scaling: the global batch grows with the ranks, and so does the learning rate
trainer = hvd.DistributedTrainer(net.collect_params(), 'sgd',
                                 {'learning_rate': args.lr * hvd.size(), 'momentum': 0.9})
state = hvd.elastic.MXNetState(net.collect_params(), trainer, epoch=0, batch=0)
shard = {}


def partition():
    """This rank's share of the samples, for the world of the moment."""
    shard['rows'] = np.array_split(np.arange(len(DATA)), hvd.size())[hvd.rank()]


def on_reset():
    trainer.set_learning_rate(args.lr * hvd.size())
    partition()
    if hvd.rank() == 0:
        print('reset: %d rank(s), learning rate %.3f, resuming at epoch %d batch %d'
              % (hvd.size(), trainer.learning_rate, state.epoch, state.batch), flush=True)


state.register_reset_callbacks([on_reset])
partition()
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
failed = []


@hvd.elastic.run
def train(state):
    while state.epoch < args.epochs:
        order = np.random.RandomState(state.epoch).permutation(shard['rows'])
        while state.batch < args.batches:
            rows = order[state.batch * args.batch_size:(state.batch + 1) * args.batch_size]
            data, label = mx.nd.array(DATA[rows]), mx.nd.array(LABELS[rows])
            with autograd.record():
                loss = loss_fn(net(data), label)
            loss.backward()
            trainer.step(args.batch_size)
            state.batch += 1
            if state.batch % args.commit_every == 0:
                state.commit()
            if state.batch == args.fail_at and not failed:
                failed.append(True)
                raise hvd.elastic.HorovodInternalError('simulated: a peer was lost')
        accuracy = (net(mx.nd.array(DATA)).argmax(axis=1).asnumpy() == LABELS).mean()
        if hvd.rank() == 0:
            print('epoch %d: accuracy %.3f' % (state.epoch + 1, accuracy), flush=True)
        state.epoch, state.batch = state.epoch + 1, 0
        state.commit()

train(state)
if hvd.rank() == 0:
    print('done: %d epochs at %d rank(s)' % (args.epochs, hvd.size()), flush=True)
hvd.shutdown()
