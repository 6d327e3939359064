"""Hosts that come and go (tests/test_elastic_hosts.py): elastic_world.py's linear model under
``python -m mpi_kvstore run --host-discovery-script S``, in a world that the launcher's
notices grow and shrink, with the state told of them (``world.listeners``).

usage: elastic_hosts_train.py OUT [--steps N] [--commit-every K] [--step-seconds T]
                              [--kill-id I --kill-at S] [--die-in-form I] [--root-dies I]
                              [--disk] [--wait-at S --wait-for N] [--connect-stalls I]
                              [--deadline D]

The global batch of step s is drawn from RandomState(700 + s) and split over the world's
ranks; the gradient is summed and divided by the global batch, so the update does not depend
on the number of workers. Worker I SIGKILLs itself in the middle of step S (--kill-at), or
in a re-forming, once the root published the port it waits for it on (--die-in-form), or
as the root of a re-forming, before it admits anyone (--root-dies); only in the supervisor's
first launch. With --disk the state commits to the supervisor's --state-dir too. With
--wait-at S --wait-for N the world checks for host updates after step S until it has N
workers (a test then needs no race with the new worker's start). With --connect-stalls I,
worker I's first connect in a re-forming gets no answer: it gives up at the deadline (D s,
default 30), as a connect to the root of a re-forming did once on the test bed. A
worker started later joins the world at a commit and prints 'joined'. Each worker prints,
for each step, the time it completed, and writes its weights to OUT.<id>.npy at the end.
"""
import argparse
import logging
import os
import signal
import sys
import time

import mxnet as mx
import numpy as np

from mpi_kvstore import elastic
from mpi_kvstore.elastic import forming
from mpi_kvstore.elastic.world import World
from mpi_kvstore.launch import supervision

DIM, GLOBAL, LR = 16, 24, 0.1

parser = argparse.ArgumentParser()
parser.add_argument('out')
parser.add_argument('--steps', type=int, default=60)
parser.add_argument('--commit-every', type=int, default=5)
parser.add_argument('--step-seconds', type=float, default=0.0)
parser.add_argument('--kill-id', type=int, default=None)
parser.add_argument('--kill-at', type=int, default=None)
parser.add_argument('--die-in-form', type=int, default=None)
parser.add_argument('--root-dies', type=int, default=None)
parser.add_argument('--disk', action='store_true')
parser.add_argument('--wait-at', type=int, default=None)
parser.add_argument('--wait-for', type=int, default=None)
parser.add_argument('--connect-stalls', type=int, default=None)
parser.add_argument('--deadline', type=float, default=30.0)
args = parser.parse_args()
if os.environ.get('MPI_KVSTORE_TEST_DEBUG') == '1':   # the forming's steps, timed, by worker
    logging.basicConfig(level=logging.DEBUG, stream=sys.stdout, format='%%(created).3f w%s '
                        '%%(name)s %%(message)s' % os.environ.get('MPI_KVSTORE_ELASTIC_ID', '?'))
else:
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format='%(message)s')
    logging.getLogger('mpi_kvstore.elastic.world').setLevel(logging.INFO)


def die():
    with open(args.out + '.killed', 'w') as fh:
        fh.write('%.6f' % time.time())
    os.kill(os.getpid(), signal.SIGKILL)


world = World.from_environment(deadline=args.deadline)
if supervision.launch_index() > 0:   # a relaunch from disk: no death this time
    args.kill_id = args.die_in_form = args.root_dies = None
if args.root_dies == world.id:
    admitting = world._next

    def die_before_admitting(pending):
        if world.generation >= 1:
            die()
        return admitting(pending)
    world._next = die_before_admitting
if args.die_in_form == world.id:
    published = world._published_port

    def published_then_die(started):
        port = published(started)
        if world.generation >= 1:   # a re-forming: the root now waits for this worker
            die()
        return port
    world._published_port = published_then_die
if args.connect_stalls == world.id:
    connect = forming.connect

    def stalled_connect(port, worker, secret, timeout):
        if world.generation >= 1 and not stalled:
            stalled.append(world.generation)
            time.sleep(timeout + 1.0)   # MPI's connect, bounded by the same timeout
            raise RuntimeError('no answer from the root (--connect-stalls)')
        return connect(port, worker, secret, timeout)
    stalled = []
    forming.connect = stalled_connect
joining = world.joining
world.form()
if joining:
    print('worker %d: joined at rank %d of %d' % (world.id, world.rank, world.size), flush=True)
weights = {'w': mx.nd.zeros((DIM,))}
state = elastic.State(weights, directory=os.environ[supervision.STATE_ENV] if args.disk else False,
                      comm=lambda: world.comm, bcast_object=world.bcast_object, step=0)
if state.restored:
    print('worker %d: restored commit %d at step %d' % (world.id, state.number, state.step),
          flush=True)
world.listeners.append(state.on_hosts_updated)
state.register_reset_callbacks([lambda: print(
    'worker %d: reset at step %d, rank %d of %d' % (world.id, state.step, world.rank,
                                                    world.size), flush=True)])


def train(state):
    for step in range(state.step, args.steps):
        rng = np.random.RandomState(700 + step)
        data = rng.uniform(-1, 1, (GLOBAL, DIM)).astype(np.float32)
        target = data @ np.linspace(-1, 1, DIM).astype(np.float32) + 0.1
        mine = np.array_split(np.arange(GLOBAL), world.size)[world.rank]
        w = weights['w'].asnumpy()
        local = data[mine].T @ (data[mine] @ w - target[mine])
        if step == args.kill_at and world.id == args.kill_id:
            die()
        grad = world.allreduce(local.astype(np.float32)) / GLOBAL
        weights['w'][:] = mx.nd.array(w - LR * grad)
        state.step = step + 1
        print('worker %d: step %d done at %.6f (%d of %d)' % (
            world.id, state.step, time.time(), world.rank, world.size), flush=True)
        if args.step_seconds:
            time.sleep(args.step_seconds)
        if state.step % args.commit_every == 0:
            state.commit()
        while state.step == args.wait_at and world.size < args.wait_for:
            time.sleep(0.05)
            state.check_host_updates()   # every rank: it is collective


elastic.run_fn(train, world.reform)(state)
np.save('%s.%d.npy' % (args.out, world.id), weights['w'].asnumpy())
print('worker %d: finished at rank %d of %d' % (world.id, world.rank, world.size), flush=True)
