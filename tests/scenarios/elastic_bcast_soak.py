"""20 resets of an elastic store in one job (tests/test_elastic_bcast.py), under ``python -m
mpi_kvstore run --elastic``: rank 0 announces a host update at each of the first 20 commits,
so every commit raises HostsUpdatedInterrupt, the world is re-formed with the same workers
and the store is rebuilt on it (kv.reset). Each step runs the store's pushpull, broadcast,
object broadcast and gather, and barrier. Each worker prints how its memory (RSS), open file
descriptors and threads grew from the first reset to the last, and the sum it trained.

usage: elastic_bcast_soak.py [--resets N]
"""
import argparse
import time

import mxnet as mx

import mpi_kvstore
from mpi_kvstore import elastic, functional
from mpi_kvstore.elastic.world import World

from memory_probe import report_growth, usage

parser = argparse.ArgumentParser()
parser.add_argument('--resets', type=int, default=20)
args = parser.parse_args()


world = World.from_environment()
world.form()
kv = mpi_kvstore.create('dist_mpi', world=world)
weights = {'w': mx.nd.zeros((1000,))}
state = elastic.State(weights, directory=False, comm=lambda: world.comm,
                      bcast_object=world.bcast_object, step=0)
seen = []
state.register_reset_callbacks([lambda: seen.append(usage())])


def reset():
    world.reform(wait_for_loss=False)
    kv.reset()


def train(state):
    while state.step < args.resets + 2:
        grad = mx.nd.ones((1000,)) * (kv.rank + 1)
        kv.pushpull('g', grad)                      # 1 + 2 + 3 = 6 each element
        mine = mx.nd.full((1000,), float(kv.rank))
        kv.broadcast('b%d' % state.step, mine, out=mine, root=kv.num_workers - 1)
        step = functional.broadcast_object(state.step, root=0, store=kv)
        ranks = functional.allgather_object(kv.rank, store=kv)
        kv._barrier()
        assert ranks == list(range(kv.num_workers)) and step == state.step, (ranks, step)
        weights['w'][:] = weights['w'] + grad + mine - (kv.num_workers - 1)
        state.step += 1
        if world.rank == 0 and len(seen) < args.resets:
            elastic.notify_hosts_updated(time.time())
        state.commit()


elastic.run_fn(train, reset)(state)
report_growth(world.id, seen, float(weights['w'].asnumpy().sum()))
kv.close()
