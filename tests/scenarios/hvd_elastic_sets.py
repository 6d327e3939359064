"""hvd's process sets on an elastic world (tests/test_hvd_elastic_sets.py): workers that are
each their own launch (mpi_kvstore.launch.workers) call hvd.init, then add_process_set.

usage: hvd_elastic_sets.py [--die-id J]

Without --die-id (3 workers): a set of ranks [0, 2] and one built from a communicator of
ranks 1 and 2 allreduce (Sum) each rank's values; each rank prints its sums. It also prints
how many times the hosts were gathered on the world's communicator (topology.host_facts'
allgather) by init and by a reset of the whole world (basics.reform_world): once each.

With --die-id J (J > 0, 3 workers): worker J SIGKILLs itself 1 s after the others enter
add_process_set([0, J]): rank 0 prints the HorovodInternalError it ends with and the seconds
it took (the rank outside the set returns at once); both re-form the world without J and
allreduce (Sum) their values over it, and rank 1 over a set of its own.
"""
import argparse
import os
import signal
import time

import mpi_kvstore.horovod as hvd
from mpi_kvstore.comm import topology
from mpi_kvstore.comm.mpiabi import MPI
from mpi_kvstore.elastic.world import World
from mpi_kvstore.horovod import basics

from common import set_sums

parser = argparse.ArgumentParser()
parser.add_argument('--die-id', type=int, default=None)
args = parser.parse_args()

worlds = []   # this process's World, once made
gathered = []   # one entry for each allgather of the hosts on the world's communicator
real_init, real_allgather = World.__init__, topology._Polled.allgather


def world_init(self, *a, **k):
    real_init(self, *a, **k)
    worlds.append(self)


def allgather(self, obj):
    # counted when made, on the world's communicator of the moment (never freed: its
    # handle is no other communicator's)
    if isinstance(obj, tuple) and worlds and worlds[0].comm is not None \
            and self.comm == worlds[0].comm:
        gathered.append(worlds[0].generation)
    return real_allgather(self, obj)


World.__init__ = world_init
topology._Polled.allgather = allgather


hvd.init()
world = basics.elastic_world()
me = hvd.rank()
print('worker %d: rank %d of %d, hosts gathered %d time(s) by init'
      % (world.id, me, hvd.size(), len(gathered)), flush=True)

if args.die_id is None:
    pair = hvd.add_process_set([0, 2])
    comm = world.comm.Split(0 if me in (1, 2) else MPI.UNDEFINED, me)
    other = hvd.add_process_set(hvd.ProcessSet(comm))
    for name, process_set in (('[0, 2]', pair), ('from a communicator', other)):
        if process_set.included():
            print('worker %d: set %s ranks %s sums %s'
                  % (world.id, name, process_set.ranks, set_sums(process_set, me)), flush=True)
    before = len(gathered)
    basics.reform_world()
    world.settled()
    print('worker %d: reset, rank %d of %d, hosts gathered %d time(s) by the reset'
          % (world.id, hvd.rank(), hvd.size(), len(gathered) - before), flush=True)
else:
    if world.id == args.die_id:   # while rank 0 waits in the set's Create_group for it
        print('worker %d: dies before add_process_set' % world.id, flush=True)
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)
    started = time.monotonic()
    try:
        hvd.add_process_set([0, args.die_id])
        print('worker %d: add_process_set returned' % world.id, flush=True)
    except hvd.elastic.HorovodInternalError as err:
        print('worker %d: add_process_set ended in %.1f s: %s'
              % (world.id, time.monotonic() - started, err), flush=True)
    basics.reform_world()
    world.settled()
    me = hvd.rank()
    alone = hvd.add_process_set([1])
    print('worker %d: re-formed, rank %d of %d, sums %s' % (
        world.id, me, hvd.size(), set_sums(hvd.global_process_set, me)), flush=True)
    if alone.included():
        print('worker %d: set [1] ranks %s sums %s'
              % (world.id, alone.ranks, set_sums(alone, me)), flush=True)
hvd.shutdown()
print('worker %d: done' % world.id, flush=True)
