"""Rank 1 skips the last pushpull the other ranks make, then stays alive elsewhere.

Every rank then calls ``kv.wait()``; rank 1's returns (it waits on nothing),
and it goes on sleeping, as a rank stuck outside the store would. The other
ranks wait on a collective rank 1 never pushed: without the stall inspector a
silent hang. Run with MPI_KVSTORE_STALL_WARNING and MPI_KVSTORE_STALL_ABORT
set (the test uses 2 and 6): the waiting ranks must name the collective (key
and sequence number) and which ranks have and have not pushed it, repeat that,
and abort the job after stall_abort seconds.

With MPI_KVSTORE_SHARD_OPTIMIZER=1 the store runs SGD on 16-element keys, sharded: the
collective rank 1 skips is then a reduce-scatter.

usage: fault_stall.py [DESIGN] [sleep|exit]
  sleep  rank 1 sleeps after its kv.wait() (default)
  exit   rank 1 exits after its kv.wait(): it finished, and cannot answer questions
"""
import os
import sys
import time

import mxnet as mx

import mpi_kvstore

from common import RANK, design_arg

SKIPPING_RANK = 1
KEYS = ['layer0_weight', 'layer1_weight', 'layer2_weight']
STEPS = 3          # rank 1 skips KEYS[-1] in the last step
STAY_ALIVE = 600   # seconds: longer than any test waits
MODE = sys.argv[2] if len(sys.argv) > 2 else 'sleep'


def main():
    kv = mpi_kvstore.create('dist_mpi', design=design_arg())
    kv.init(KEYS, [mx.nd.zeros((16,)) for _ in KEYS])   # one broadcast per key
    sharded = os.environ.get('MPI_KVSTORE_SHARD_OPTIMIZER') == '1'
    if sharded:
        kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1))
    values = [mx.nd.ones((16,)) for _ in KEYS]
    # Collectives are numbered in call order from 0: the init broadcasts, then the pushpulls
    # (sharded: a reduce-scatter and an allgather each).
    skipped = len(KEYS) + (2 if sharded else 1) * (STEPS * len(KEYS) - 1)
    for step in range(STEPS):
        if step == STEPS - 1:
            # The blocking design waits inside pushpull itself: stamp the time before.
            print('fault_stall: rank %d starts the last step at t=%.3f' % (RANK, time.time()),
                  flush=True)
        for key, value in zip(KEYS, values):
            if step == STEPS - 1 and key == KEYS[-1] and RANK == SKIPPING_RANK:
                print('fault_stall: rank %d skips collective #%d (key %r)'
                      % (RANK, skipped, key), flush=True)
                continue
            kv.pushpull(key, value)
    kv.wait()
    if RANK == SKIPPING_RANK:
        if MODE == 'exit':
            print('fault_stall: rank %d exits' % RANK, flush=True)
            return
        time.sleep(STAY_ALIVE)
    print('fault_stall: rank %d is through kv.wait(), which it should not be' % RANK,
          flush=True)


main()
