"""Workers that join a running job that trains through the store (tests/test_elastic_join.py):
a small Gluon model under ``python -m mpi_kvstore run --host-discovery-script S``.

usage: elastic_join.py OUT --api hvd|kv|kvopt [--steps N] [--commit-every K] [--shard]
                       [--wait-at S --wait-for N] [--kill-id I --kill-at S]
                       [--step-seconds T] [--reference]

``--api hvd``: hvd.init() forms (or joins) the world, hvd.DistributedTrainer averages the
gradients (SGD with momentum on the ranks), hvd.elastic.run with hvd.elastic.MXNetState.
``--api kv``: our own API: World, mpi_kvstore.create(world=...), gluon.Trainer on it with
update_on_kvstore=False (SGD with momentum), elastic.run_fn with elastic.State. ``--api
kvopt``: the same with the optimizer in the store (update_on_kvstore=True, Adam), its
states sharded over the ranks with ``--shard``. Under the supervisor's ``--state-dir`` the
commits go to disk too.

The global batch of step s is drawn from RandomState(900 + s) and split over the world's
ranks; the gradients are averaged (hvd) or summed and stepped by the global batch (kv), so
the update does not depend on the number of workers. With --wait-at S --wait-for N the
world checks for host updates after step S until it has N workers; worker I SIGKILLs itself
after its backward pass of step S (--kill-at). ``--reference``: one process, no launcher,
the same model and optimizer on the whole batch of each step (gluon.Trainer without a store),
writes OUT.ref.npz. Each worker prints each step, each reset, and writes its weights to
OUT.<id>.npz.
"""
import argparse
import logging
import os
import signal
import time

import numpy as np
from mxnet import gluon

from common import ElasticModel, elastic_batch, elastic_store

DIM, HIDDEN, GLOBAL, LR = 8, 6, 24, 0.1

parser = argparse.ArgumentParser()
parser.add_argument('out')
parser.add_argument('--api', choices=('hvd', 'kv', 'kvopt'), default='hvd')
parser.add_argument('--steps', type=int, default=16)
parser.add_argument('--commit-every', type=int, default=3)
parser.add_argument('--shard', action='store_true')
parser.add_argument('--wait-at', type=int, default=None)
parser.add_argument('--wait-for', type=int, default=None)
parser.add_argument('--kill-id', type=int, default=None)
parser.add_argument('--kill-at', type=int, default=None)
parser.add_argument('--step-seconds', type=float, default=0.0)
parser.add_argument('--reference', action='store_true')
args = parser.parse_args()
logging.basicConfig(format='%(message)s')
logging.getLogger('mpi_kvstore.elastic.state').setLevel(logging.INFO)

model = ElasticModel(DIM, HIDDEN)
params = model.params
if args.api == 'kvopt':
    OPTIMIZER, OPTIONS = 'adam', {'learning_rate': LR / 4}
else:
    OPTIMIZER, OPTIONS = 'sgd', {'learning_rate': LR, 'momentum': 0.9}
if args.reference:
    model.reference(args.out, args.steps, OPTIMIZER, OPTIONS, GLOBAL)
    raise SystemExit(0)

from mpi_kvstore import elastic  # noqa: E402
from mpi_kvstore.launch import rendezvous, supervision  # noqa: E402

worker = int(os.environ[rendezvous.ID_ENV])
joining = os.environ.get(rendezvous.JOIN_ENV) == '1'
if args.api == 'hvd':
    import mpi_kvstore.horovod as hvd
    hvd.init()
    trainer = hvd.DistributedTrainer(params, OPTIMIZER, OPTIONS)
    state = hvd.elastic.MXNetState(params, trainer, step=0)
    kv = hvd.store()
    wrap = hvd.elastic.run
else:
    world, kv, reset = elastic_store(shard_optimizer=args.shard)
    trainer = gluon.Trainer(params, OPTIMIZER, OPTIONS, kvstore=kv,
                            update_on_kvstore=args.api == 'kvopt')
    state = elastic.State(params, trainer, comm=lambda: world.comm,
                          bcast_object=world.bcast_object, step=0,
                          directory=os.environ.get(supervision.STATE_ENV) or False)
    world.listeners.append(state.on_hosts_updated)

    def wrap(func):
        return elastic.run_fn(func, reset)

if joining:
    print('worker %d: joined at rank %d of %d' % (worker, kv.rank, kv.num_workers), flush=True)
state.register_reset_callbacks([lambda: print(
    'worker %d: reset at step %d, rank %d of %d' % (worker, state.step, kv.rank,
                                                    kv.num_workers), flush=True)])


@wrap
def train(state):
    for step in range(state.step, args.steps):
        data, target = elastic_batch(step, kv.rank, kv.num_workers, DIM, GLOBAL)
        model.forward_backward(data, target)
        if step == args.kill_at and worker == args.kill_id:
            os.kill(os.getpid(), signal.SIGKILL)
        trainer.step(data.shape[0] if args.api == 'hvd' else GLOBAL)
        for param in params.values():
            param.data().wait_to_read()
        state.step = step + 1
        print('worker %d: step %d done (%d of %d)' % (worker, state.step, kv.rank,
                                                      kv.num_workers), flush=True)
        time.sleep(args.step_seconds)
        if state.step % args.commit_every == 0:
            state.commit()
        while state.step == args.wait_at and kv.num_workers < args.wait_for:
            time.sleep(0.05)
            state.check_host_updates()   # every rank: it is collective


train(state)
if args.shard:   # each rank holds its share of every sharded key's states, cut anew
    shares = 0
    for key, states in kv._updater.states.items():
        known = kv._keys.get(key)
        want = (len(np.array_split(np.arange(known.count), kv.num_workers)[kv.rank])
                if kv._keys.sharded(known) else known.count)
        for leaf in states if isinstance(states, (tuple, list)) else [states]:
            assert leaf.size == want, (key, leaf.size, want)
        shares += kv._keys.sharded(known)
    print('worker %d: sharded keys %d' % (worker, shares), flush=True)
model.save('%s.%d.npz' % (args.out, worker))
print('worker %d: finished at rank %d of %d' % (worker, kv.rank, kv.num_workers), flush=True)
