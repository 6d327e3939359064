"""Module.fit with elastic.State.fit under the supervisor (tests/test_elastic.py).

usage: elastic_module.py OUT [--kill-epoch E --kill-batch B]

Two epochs of 6 batches (4 samples a rank, no shuffling), SGD with momentum in the store,
commits every 3 batches: after batches 3 and 6 of each epoch. On the first launch rank 1
SIGKILLs itself at the end of batch B of epoch E (counted from 0). Rank 0 writes the final
parameters to OUT (npz, sorted by name) and says where it resumed.
"""
import argparse
import os
import signal

import mxnet as mx
import numpy as np

import mpi_kvstore
from mpi_kvstore import elastic
from mpi_kvstore.launch import supervision

from common import RANK, SIZE

PER_RANK, BATCHES = 4, 6

parser = argparse.ArgumentParser()
parser.add_argument('out')
parser.add_argument('--kill-epoch', type=int, default=None)
parser.add_argument('--kill-batch', type=int, default=None)
args = parser.parse_args()


def symbol():
    data = mx.sym.Variable('data')
    net = mx.sym.FullyConnected(mx.sym.Flatten(data), num_hidden=7, name='fc1')
    net = mx.sym.Activation(net, act_type='relu')
    net = mx.sym.FullyConnected(net, num_hidden=3, name='fc2')
    return mx.sym.SoftmaxOutput(net, name='softmax')


def shard():
    rng = np.random.RandomState(7)
    n = PER_RANK * SIZE * BATCHES
    data = rng.uniform(-1, 1, (n, 2, 5)).astype(np.float32)
    label = rng.randint(0, 3, (n,)).astype(np.float32)
    rows = np.concatenate([np.arange(b * PER_RANK * SIZE + RANK * PER_RANK,
                                     b * PER_RANK * SIZE + (RANK + 1) * PER_RANK)
                           for b in range(BATCHES)])
    return mx.io.NDArrayIter(data[rows], label[rows], batch_size=PER_RANK, shuffle=False)


def main():
    kv = mpi_kvstore.create('dist_mpi')
    train = shard()
    mod = mx.mod.Module(symbol(), context=mx.cpu())
    mod.bind(data_shapes=train.provide_data, label_shapes=train.provide_label)
    mx.random.seed(11)
    mod.init_params(initializer=mx.init.Xavier())
    state = elastic.State(mod, epoch=0, batch=0)
    if RANK == 0:
        print('launch %d: starting at epoch %d batch %d (restored: %s)'
              % (supervision.launch_index(), state.epoch, state.batch, state.restored),
              flush=True)

    def kill(param):
        if (supervision.launch_index() == 0 and RANK == 1 and param.epoch == args.kill_epoch
                and param.nbatch == args.kill_batch):
            mx.nd.waitall()
            os.kill(os.getpid(), signal.SIGKILL)

    state.fit(train, commit_every=3, batch_end_callback=kill, num_epoch=2, kvstore=kv,
              optimizer='sgd', optimizer_params={'learning_rate': 0.1, 'momentum': 0.9})
    params, _ = mod.get_params()
    if RANK == 0:
        np.savez(args.out, *[params[k].asnumpy() for k in sorted(params)])
        print('finished at epoch %d' % state.epoch, flush=True)
    kv.close()


main()
