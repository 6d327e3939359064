"""The store on a world that loses a worker (tests/test_elastic_store.py): a small Gluon model
trained by workers that ``python -m mpi_kvstore run --elastic`` starts, each its own launch.

usage: elastic_store.py OUT --api hvd|kv [--steps N] [--commit-every K]
                        [--kill-id I --kill-at S] [--kill-id I --kill-in-commit S]
                        [--step-seconds T]

``--api hvd``: hvd.init() forms the world, hvd.DistributedTrainer averages the gradients,
hvd.elastic.run with hvd.elastic.MXNetState. ``--api kv``: an elastic world of our own API
(elastic.world.World), a store made with mpi_kvstore.create(world=...), gluon.Trainer on it
(update_on_kvstore=False: kv.pushpull sums the gradients), elastic.run_fn with elastic.State.

The global batch of step s is drawn from RandomState(900 + s) and split over the world's
ranks; hvd averages and steps by the local batch, kv sums and steps by the global batch, so
the update does not depend on the number of workers. Worker I SIGKILLs itself in the middle
of step S (after its backward pass, while the others' gradient exchange is in flight),
having written the time to OUT.killed. Each survivor prints each completed step, its rank and
size after each reset, and writes its weights to OUT.<id>.npz.
"""
import argparse
import os
import signal
import time

from mxnet import gluon

from mpi_kvstore import elastic
from mpi_kvstore.launch import rendezvous, supervision

from common import ElasticModel, elastic_batch, elastic_store

DIM, HIDDEN, GLOBAL, LR = 8, 6, 24, 0.2

parser = argparse.ArgumentParser()
parser.add_argument('out')
parser.add_argument('--api', choices=('hvd', 'kv'), default='hvd')
parser.add_argument('--steps', type=int, default=20)
parser.add_argument('--commit-every', type=int, default=4)
parser.add_argument('--kill-id', type=int, default=None)
parser.add_argument('--kill-at', type=int, default=None)
parser.add_argument('--step-seconds', type=float, default=0.0)
parser.add_argument('--kill-in-commit', type=int, default=None,
                    help="worker --kill-id dies inside the commit after this step: after its "
                         "in-memory copy, before the commit's broadcast")
args = parser.parse_args()
# Under run --elastic each worker has an id; under the supervisor's relaunch from disk
# (run --state-dir D, for comparison: hvd only) the worker is the rank, the commits go to D,
# and the kill happens on the first launch only.
ELASTIC = bool(os.environ.get(rendezvous.DIR_ENV))
if not ELASTIC and supervision.launch_index() > 0:
    args.kill_at = None

model = ElasticModel(DIM, HIDDEN)
params = model.params

if args.api == 'hvd':
    import mpi_kvstore.horovod as hvd
    hvd.init()
    trainer = hvd.DistributedTrainer(params, 'sgd', {'learning_rate': LR})
    state = hvd.elastic.MXNetState(params, trainer, step=0)
    kv = hvd.store()
    rank, size = hvd.rank, hvd.size
    worker = int(os.environ[rendezvous.ID_ENV]) if ELASTIC else hvd.rank()
    wrap = hvd.elastic.run
else:
    world, kv, reset = elastic_store()
    worker = world.id
    trainer = gluon.Trainer(params, 'sgd', {'learning_rate': LR}, kvstore=kv,
                            update_on_kvstore=False)
    state = elastic.State(params, trainer, directory=False, comm=lambda: world.comm,
                          bcast_object=world.bcast_object, step=0)
    rank, size = (lambda: kv.rank), (lambda: kv.num_workers)

    def wrap(func):
        return elastic.run_fn(func, reset)

state.register_reset_callbacks([lambda: print(
    'worker %d: reset at step %d, rank %d of %d, kv %d of %d'
    % (worker, state.step, rank(), size(), kv.rank, kv.num_workers), flush=True)])
if args.kill_in_commit is not None and worker == args.kill_id:
    checking = state.check_host_updates

    def dying_check():
        if state.step == args.kill_in_commit:
            os.kill(os.getpid(), signal.SIGKILL)
        checking()
    state.check_host_updates = dying_check


def batch(step):
    return elastic_batch(step, rank(), size(), DIM, GLOBAL)


@wrap
def train(state):
    for step in range(state.step, args.steps):
        data, target = batch(step)
        model.forward_backward(data, target)
        if step == args.kill_at and worker == args.kill_id:
            with open(args.out + '.killed', 'w') as fh:
                fh.write('%.6f' % time.time())
            os.kill(os.getpid(), signal.SIGKILL)
        trainer.step(data.shape[0] if args.api == 'hvd' else GLOBAL)
        for param in params.values():
            param.data().wait_to_read()
        state.step = step + 1
        print('worker %d: step %d done at %.6f' % (worker, state.step, time.time()), flush=True)
        if args.step_seconds:
            time.sleep(args.step_seconds)
        if state.step % args.commit_every == 0:
            state.commit()


train(state)
model.save('%s.%d.npz' % (args.out, worker))
print('worker %d: finished at rank %d of %d' % (worker, rank(), size()), flush=True)
