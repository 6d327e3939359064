"""hvd's process set ids on an elastic world across a re-forming (tests/test_hvd_elastic_set_ids.py):
4 workers, each its own launch. Worker 3 SIGKILLs itself 1 s after the others enter
add_process_set([0, 3]): rank 0, a member, gives up on the set (HorovodInternalError) and
registers nothing; ranks 1 and 2, outside it, return at once and register it. The three
re-form the world without worker 3 and add the set [0, 1], whose Create_group every member must call
with the same tag (process_sets._members_comm: the set's number): each prints the set's sums.
The world's timeout is cut to 20 s, so that a Create_group that never matches ends.

usage: hvd_elastic_set_ids.py
"""
import argparse
import os
import signal
import time

import mpi_kvstore.horovod as hvd
from mpi_kvstore.horovod import basics

from common import set_sums

parser = argparse.ArgumentParser()
args = parser.parse_args()


hvd.init()
world = basics.elastic_world()
me = hvd.rank()
print('worker %d: rank %d of %d' % (world.id, me, hvd.size()), flush=True)

world.timeout = 20.0   # a Create_group whose tags differ on its members ends within this
if world.id == 3:   # while rank 0 waits in the set's Create_group for it
    print('worker %d: dies before add_process_set' % world.id, flush=True)
    time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGKILL)
try:
    hvd.add_process_set([0, 3])
    print('worker %d: add_process_set returned' % world.id, flush=True)
except hvd.elastic.HorovodInternalError as err:
    print('worker %d: add_process_set failed: %s' % (world.id, err), flush=True)
basics.reform_world()
world.settled()
me = hvd.rank()
both = hvd.add_process_set([0, 1])
if both.included():
    print('worker %d: set [0, 1] ranks %s sums %s'
          % (world.id, both.ranks, set_sums(both, me)), flush=True)
hvd.shutdown()
print('worker %d: done' % world.id, flush=True)
