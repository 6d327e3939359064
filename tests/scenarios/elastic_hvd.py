"""hvd.elastic.run with MXNetState over the store (tests/test_elastic_run.py).

usage: elastic_hvd.py OUT [--steps N] [--commit-every K] [--fail-at S] [--perturb]

A Dense layer trained with Adam through hvd.DistributedTrainer: the global batch of step s
is drawn from RandomState(s) and each rank takes its slice, so the update does not depend on
the number of ranks. With --perturb rank 1 starts from other weights (elastic.run's first
sync gives it rank 0's). With --fail-at S every rank raises HorovodInternalError once, after
step S: elastic.run restores the last commit, resets, syncs and calls train again. Each rank
writes its final weights to OUT.<rank>.npz and prints the steps each call started at.
"""
import argparse

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import mpi_kvstore.horovod as hvd

GLOBAL = 12

parser = argparse.ArgumentParser()
parser.add_argument('out')
parser.add_argument('--steps', type=int, default=10)
parser.add_argument('--commit-every', type=int, default=3)
parser.add_argument('--fail-at', type=int, default=None)
parser.add_argument('--perturb', action='store_true')
args = parser.parse_args()

hvd.init()
net = gluon.nn.Dense(3, in_units=5)
mx.random.seed(11)
net.initialize(mx.init.Xavier())
if args.perturb and hvd.rank() == 1:
    for param in net.collect_params().values():
        param.set_data(param.data() * 0 + 0.5)
trainer = hvd.DistributedTrainer(net.collect_params(), 'adam', {'learning_rate': 0.05})
state = hvd.elastic.MXNetState(net.collect_params(), trainer, step=0)
resets, starts, failed = [], [], []
state.register_reset_callbacks([lambda: resets.append(state.step)])
loss_fn = gluon.loss.L2Loss()


@hvd.elastic.run
def train(state):
    starts.append(state.step)
    per = GLOBAL // hvd.size()
    for step in range(state.step, args.steps):
        rng = np.random.RandomState(500 + step)
        data = rng.uniform(-1, 1, (GLOBAL, 5)).astype(np.float32)
        label = rng.uniform(-1, 1, (GLOBAL, 3)).astype(np.float32)
        mine = slice(hvd.rank() * per, (hvd.rank() + 1) * per)
        with autograd.record():
            loss = loss_fn(net(mx.nd.array(data[mine])), mx.nd.array(label[mine]))
        loss.backward()
        trainer.step(per)
        state.step = step + 1
        if state.step % args.commit_every == 0:
            state.commit()
        if state.step == args.fail_at and not failed:
            failed.append(True)
            raise hvd.elastic.HorovodInternalError('a simulated lost peer')


train(state)
weights = [p.data().asnumpy() for p in net.collect_params().values()]
np.savez('%s.%d.npz' % (args.out, hvd.rank()), *weights)
print('rank %d of %d: starts %s resets %s' % (hvd.rank(), hvd.size(), starts, resets),
      flush=True)
hvd.shutdown()
