"""Two workers, each its own launch (tests/test_elastic_world_ports.py), form a world, wait
while the test connects to the root's port of that world with nothing to accept it (the
launcher's stand-in, started too late), then re-form the same world and allreduce again.

usage: elastic_world_ports.py OUT

After each forming, worker I allreduces RandomState(I + 10 * generation)'s 8 floats and saves
the sum to OUT.<I>.<generation>.npy. Between the two it prints 'worker I: formed' and waits
for the file OUT.go.
"""
import os
import sys
import time

import numpy as np

from mpi_kvstore.elastic.world import World

out = sys.argv[1]
world = World.from_environment(deadline=20.0)


def allreduce_and_save():
    mine = np.random.RandomState(world.id + 10 * world.generation).uniform(-1, 1, 8)
    total = world.allreduce(mine.astype(np.float32))
    np.save('%s.%d.%d.npy' % (out, world.id, world.generation), total)


world.form()
allreduce_and_save()
print('worker %d: formed generation %d' % (world.id, world.generation), flush=True)
ends = time.monotonic() + 120
while not os.path.exists(out + '.go'):
    if time.monotonic() > ends:
        sys.exit('worker %d: no %s.go in 120 s' % (world.id, out))
    time.sleep(0.02)
world.reform(wait_for_loss=False)
allreduce_and_save()
print('worker %d: re-formed generation %d, rank %d of %d' % (world.id, world.generation,
                                                            world.rank, world.size), flush=True)
