"""Survivors that keep going in memory (tests/test_elastic_run.py): a linear model trained by
workers that are each their own launch (mpi_kvstore.launch.workers), in a world that
mpi_kvstore.elastic.world forms and re-forms.

usage: elastic_world.py OUT [--steps N] [--commit-every K] [--kill-id I --kill-at S]
                            [--kill-id I --kill-in-commit S] [--step-seconds T]

Started by launch.workers (MPI_KVSTORE_ELASTIC_* set) it runs in an elastic world; started
as one MPI job (under ``python -m mpi_kvstore run --state-dir D``) the same training runs on
COMM_WORLD with commits on disk, and the kill happens on the first launch only: the
supervisor's relaunch from disk, for comparison.

The global batch of step s is drawn from RandomState(s) and split over the world's ranks;
the gradient is summed over the world and divided by the global batch, so the update does
not depend on the number of workers. Worker I SIGKILLs itself in the middle of step S (after
its forward pass, before its allreduce), having written the time to OUT.killed. Survivors
get HorovodInternalError, restore the last commit, re-form the world (the oldest survivor
is rank 0), sync from it and go on. Each survivor writes its weights to OUT.<id>.npy and
prints, for each step, the time it completed.
"""
import argparse
import os
import signal
import time

import mxnet as mx
import numpy as np

from mpi_kvstore import elastic
from mpi_kvstore.comm.mpiabi import MPI
from mpi_kvstore.elastic.world import World
from mpi_kvstore.launch import rendezvous, supervision

DIM, GLOBAL, LR = 16, 24, 0.1

parser = argparse.ArgumentParser()
parser.add_argument('out')
parser.add_argument('--steps', type=int, default=30)
parser.add_argument('--commit-every', type=int, default=5)
parser.add_argument('--kill-id', type=int, default=None)
parser.add_argument('--kill-at', type=int, default=None)
parser.add_argument('--step-seconds', type=float, default=0.0)
parser.add_argument('--kill-in-commit', type=int, default=None,
                    help='worker --kill-id dies inside the commit after this step: after its '
                         'in-memory copy, before the commit\'s broadcast')
args = parser.parse_args()



class Fixed:
    """COMM_WORLD in World's shape: one MPI job, relaunched from disk by the supervisor."""
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    id = rank

    def allreduce(self, array):
        out = np.empty_like(array)
        self.comm.Allreduce(array, out, op=MPI.SUM)
        return out


ELASTIC = bool(os.environ.get(rendezvous.DIR_ENV))
if ELASTIC:
    world = World.from_environment(deadline=30.0)
    world.form()
else:
    world = Fixed()
    if supervision.launch_index() > 0:
        args.kill_at = None
weights = {'w': mx.nd.zeros((DIM,))}
if ELASTIC:
    state = elastic.State(weights, directory=False, comm=lambda: world.comm,
                          bcast_object=world.bcast_object, step=0)
else:
    state = elastic.State(weights, step=0)
if ELASTIC and args.kill_in_commit is not None and world.id == args.kill_id:
    checking = state.check_host_updates

    def dying_check():
        if state.step == args.kill_in_commit:
            with open(args.out + '.killed', 'w') as fh:
                fh.write('%.6f' % time.time())
            os.kill(os.getpid(), signal.SIGKILL)
        checking()
    state.check_host_updates = dying_check
state.register_reset_callbacks([lambda: print(
    'worker %d: reset at step %d, rank %d of %d' % (world.id, state.step, world.rank,
                                                    world.size), flush=True)])


def batch(step):
    rng = np.random.RandomState(700 + step)
    data = rng.uniform(-1, 1, (GLOBAL, DIM)).astype(np.float32)
    target = data @ np.linspace(-1, 1, DIM).astype(np.float32) + 0.1
    mine = np.array_split(np.arange(GLOBAL), world.size)[world.rank]
    return data[mine], target[mine]


def train(state):
    for step in range(state.step, args.steps):
        data, target = batch(step)
        w = weights['w'].asnumpy()
        local = data.T @ (data @ w - target)
        if step == args.kill_at and world.id == args.kill_id:
            with open(args.out + '.killed', 'w') as fh:
                fh.write('%.6f' % time.time())
            os.kill(os.getpid(), signal.SIGKILL)
        grad = world.allreduce(local.astype(np.float32)) / GLOBAL
        weights['w'][:] = mx.nd.array(w - LR * grad)
        state.step = step + 1
        print('worker %d: step %d done at %.6f' % (world.id, state.step, time.time()),
              flush=True)
        if args.step_seconds:
            time.sleep(args.step_seconds)
        if state.step % args.commit_every == 0:
            state.commit()


if ELASTIC:
    elastic.run_fn(train, world.reform)(state)
else:
    train(state)
np.save('%s.%d.npy' % (args.out, world.id), weights['w'].asnumpy())
print('worker %d: finished at rank %d of %d' % (world.id, world.rank, world.size), flush=True)
