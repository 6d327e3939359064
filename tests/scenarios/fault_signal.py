"""Rank 1 dies of a segmentation fault while it waits on a collective rank 0 never pushes.

usage: fault_signal.py [DESIGN]

Both ranks make 2 pushpulls; then rank 1 alone inits and pushes key 'late': its communication
thread waits on collective #3 (the broadcast of 'late') as a rank waits on a peer behind a
cut link. After WAIT seconds (the stall inspector has looked by then), rank 1
reads address 0, as a transport library on a dead connection might. Its last words
(last_words.py) must name the signal and the collective it waited on, before faulthandler's
stack; the launcher then ends the job.
"""
import ctypes
import time

import mxnet as mx

import mpi_kvstore

from common import RANK, design_arg

WAIT = 2.0   # s: the inspector looks every 0.25 s with the test's stall_warning of 2 s
STAY = 120   # s: rank 0 outlives any test's patience


def main():
    kv = mpi_kvstore.create('dist_mpi', design=design_arg())
    kv.init('w', mx.nd.zeros((16,)))                 # collective #0
    value = mx.nd.ones((16,))
    kv.pushpull('w', value)                          # #1
    kv.pushpull('w', value)                          # #2
    kv.wait()
    if RANK == 0:
        time.sleep(STAY)
        return
    kv.init('late', mx.nd.zeros((8,)))               # #3: rank 0 never joins
    kv.pushpull('late', mx.nd.ones((8,)))
    time.sleep(WAIT)
    print('fault_signal: rank 1 reads address 0 at t=%.3f' % time.time(), flush=True)
    ctypes.string_at(0)


main()
