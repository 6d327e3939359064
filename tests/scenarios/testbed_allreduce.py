"""Where each rank runs, and how long an allreduce takes: checks of the test bed (testbed/).

Rank 0 prints one line per rank ('testbed: rank R on HOST') and the slowest rank's
median time of REPEATS allreduces of MEGABYTES of float32 ('testbed: allreduce ...
median X ms'); every rank checks the sum.

usage: testbed_allreduce.py [MEGABYTES] [REPEATS]
"""
import sys
import time

import numpy as np
from mpi4py import MPI

COMM = MPI.COMM_WORLD
MEGABYTES = float(sys.argv[1]) if len(sys.argv) > 1 else 4.0
REPEATS = int(sys.argv[2]) if len(sys.argv) > 2 else 5

send = np.full(int(MEGABYTES * 2 ** 20) // 4, COMM.rank + 1, dtype=np.float32)
recv = np.empty_like(send)
COMM.Allreduce(send, recv)   # warm-up: connections are made here
times = []
for _ in range(REPEATS):
    COMM.Barrier()
    start = time.perf_counter()
    COMM.Allreduce(send, recv)
    times.append(time.perf_counter() - start)
expected = COMM.size * (COMM.size + 1) / 2
assert np.all(recv == expected), 'rank %d: sum %s, expected %s' % (COMM.rank, recv[:3], expected)
median = COMM.allreduce(sorted(times)[len(times) // 2], op=MPI.MAX)
names = COMM.gather(MPI.Get_processor_name())
if COMM.rank == 0:
    for rank, name in enumerate(names):
        print('testbed: rank %d on %s' % (rank, name))
    print('testbed: allreduce %g MB x %d at %d ranks: median %.2f ms'
          % (MEGABYTES, REPEATS, COMM.size, median * 1e3), flush=True)
