"""A worker lost inside the store's broadcast, barrier or object collective
(tests/test_elastic_bcast.py): a small Gluon model trained under ``python -m mpi_kvstore run
--elastic`` with hvd.elastic.run, as tests/scenarios/elastic_store.py trains it.

usage: elastic_bcast.py OUT --op params|kv|object|barrier [--steps N] [--commit-every K]
                        [--kill-id I --kill-at S]

After each step's update every rank but rank 1 spoils its copy of the weights (+1), then the
step's ``--op`` runs with rank 1 as its root: ``params``, hvd.broadcast_parameters;
``kv``, kv.broadcast of the weights in place; ``object``, hvd.broadcast_object of the step,
then hvd.allgather_object of the ranks; ``barrier``, the store's barrier (for ``object`` and
``barrier`` the weights are not spoilt). Worker I, rank 1 at the start, SIGKILLs itself in
step S inside the store's communication thread, as that call's MPI collective starts there
(after every rank agreed to run it): the others are then inside the broadcast, barrier or
object collective, waiting for it. A survivor whose call raises prints
which call raised what; each survivor prints its rank and size after each reset, and writes
its weights to OUT.<id>.npz.
"""
import argparse
import os
import signal
import threading

import numpy as np
from mxnet import autograd, gluon

import mpi_kvstore.horovod as hvd
from mpi_kvstore.comm.collective import Collective
from mpi_kvstore.comm.host import Comm
from mpi_kvstore.launch import rendezvous

from common import elastic_batch, elastic_net

DIM, HIDDEN, GLOBAL, LR, ROOT = 8, 6, 24, 0.2, 1

parser = argparse.ArgumentParser()
parser.add_argument('out')
parser.add_argument('--op', choices=('params', 'kv', 'object', 'barrier'), required=True)
parser.add_argument('--steps', type=int, default=12)
parser.add_argument('--commit-every', type=int, default=4)
parser.add_argument('--kill-id', type=int, default=None)
parser.add_argument('--kill-at', type=int, default=None)
args = parser.parse_args()

net, params = elastic_net(DIM, HIDDEN)

hvd.init()
trainer = hvd.DistributedTrainer(params, 'sgd', {'learning_rate': LR})
state = hvd.elastic.MXNetState(params, trainer, step=0)
kv = hvd.store()
worker = int(os.environ[rendezvous.ID_ENV])
state.register_reset_callbacks([lambda: print(
    'worker %d: reset at step %d, rank %d of %d, kv %d of %d'
    % (worker, state.step, hvd.rank(), hvd.size(), kv.rank, kv.num_workers), flush=True)])
loss_fn = gluon.loss.L2Loss()
names = sorted(params.keys())


def batch(step):
    return elastic_batch(step, hvd.rank(), hvd.size(), DIM, GLOBAL)


def spoil():
    """Every rank but the root adds 1 to its weights: only a broadcast puts them right."""
    if hvd.rank() != ROOT:
        for name in names:
            params[name].set_data(params[name].data() + 1)


def collective(step):
    if args.op == 'params':   # no wait: the call returns once the values arrived, or raises
        spoil()
        hvd.broadcast_parameters(params, root_rank=ROOT)
        return
    if args.op == 'kv':
        spoil()
        kv.broadcast(['bcast:' + name for name in names],
                     [params[name].data() for name in names], root=ROOT)
    elif args.op == 'object':
        got = hvd.broadcast_object(('step', step, hvd.rank()), root_rank=ROOT)
        assert got == ('step', step, ROOT), got
        ranks = hvd.allgather_object(hvd.rank())
        assert ranks == list(range(hvd.size())), ranks
    else:
        kv._barrier()
    kv.wait()   # the step's collectives finished: what failed raises here


ARMED = []


def dying(method):
    """``method``, which SIGKILLs this worker once ARMED instead of calling MPI."""
    def call(*args, **kwargs):
        if ARMED:
            print('worker %d: dies in step %d, in %s' % (worker, ARMED[0], method.__name__),
                  flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return method(*args, **kwargs)
    return call


if worker == args.kill_id:   # where each op's MPI call starts, on the store's thread
    Comm.bcast_host = dying(Comm.bcast_host)
    Comm.barrier = dying(Comm.barrier)
    Collective.run_custom = dying(Collective.run_custom)


@hvd.elastic.run
def train(state):
    for step in range(state.step, args.steps):
        data, target = batch(step)
        with autograd.record():
            loss = loss_fn(net(data), target)
        loss.backward()
        trainer.step(data.shape[0])
        for param in params.values():
            param.data().wait_to_read()
        if step == args.kill_at and worker == args.kill_id:
            ARMED.append(step)
        try:
            collective(step)
        except Exception as err:
            print('worker %d: %s in step %d raised %s: %s' % (
                worker, args.op, step, type(err).__name__, str(err).splitlines()[0]), flush=True)
            raise
        state.step = step + 1
        print('worker %d: step %d done' % (worker, state.step), flush=True)
        if state.step % args.commit_every == 0:
            state.commit()


train(state)
np.savez('%s.%d.npz' % (args.out, worker), *[params[name].data().asnumpy() for name in names])
print('worker %d: finished at rank %d of %d, threads %s' % (
    worker, hvd.rank(), hvd.size(), sorted(t.name for t in threading.enumerate())), flush=True)
