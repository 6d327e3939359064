"""20 resets in one elastic world (tests/test_elastic_run.py): rank 0 announces a host update
at each of the first 20 commits, so every commit raises HostsUpdatedInterrupt and the world
is re-formed with the same workers. Each worker prints how its memory (RSS), open file
descriptors and threads grew from the first reset to the last, and its final weights'
checksum.

usage: elastic_soak.py [--resets N]
"""
import argparse
import time

import mxnet as mx
import numpy as np

from mpi_kvstore import elastic
from mpi_kvstore.elastic.world import World

from memory_probe import report_growth, usage

parser = argparse.ArgumentParser()
parser.add_argument('--resets', type=int, default=20)
args = parser.parse_args()


world = World.from_environment(deadline=30.0)
world.form()
weights = {'w': mx.nd.zeros((1000,))}
state = elastic.State(weights, directory=False, comm=lambda: world.comm,
                      bcast_object=world.bcast_object, step=0)
seen = []
state.register_reset_callbacks([lambda: seen.append(usage())])


def train(state):
    while state.step < args.resets + 2:
        total = world.allreduce(np.ones(1000, dtype=np.float32))
        weights['w'][:] = weights['w'] + mx.nd.array(total)
        state.step += 1
        if world.rank == 0 and len(seen) < args.resets:
            elastic.notify_hosts_updated(time.time())
        state.commit()


elastic.run_fn(train, lambda: world.reform(wait_for_loss=False))(state)
report_growth(world.id, seen, float(weights['w'].asnumpy().sum()))
