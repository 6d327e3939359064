"""Leave the interpreter with collectives still in flight: no crash, no hang, and the
work done.

The store's exit hook must finish the work and stop its threads before MXNet shuts its
engine down and MPI finalizes. The evidence is read after that hook, by an exit handler
registered before the store's (atexit runs the last registered first) and after MXNet's:
on each rank it prints the distinct values the keys hold, the threads left besides the
main one, and whether MPI is finalized. tests/test_store.py checks them against the sum
it computes.

usage: kv_exit.py DESIGN
"""
import atexit
import threading

import mxnet as mx
import numpy as np
from mpi4py import MPI

from common import RANK, design_arg

KEYS, STEPS, COUNT = 50, 5, 1 << 14


def after_the_store_closed():
    held = sorted({float(v) for value in values for v in np.unique(value.asnumpy())})
    threads = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())
    print('kv_exit: rank %d after the exit hook: %d keys hold %s; threads left %s; '
          'MPI finalized %s' % (RANK, len(values), held, threads, MPI.Is_finalized()),
          flush=True)


atexit.register(after_the_store_closed)

import mpi_kvstore  # noqa: E402  (after the handler above: its exit hook must run first)

kv = mpi_kvstore.create('dist_mpi', design=design_arg())
keys = list(range(KEYS))
kv.init(keys, [mx.nd.zeros((COUNT,)) for _ in keys])
values = [mx.nd.ones((COUNT,)) * (RANK + 1) for _ in keys]
for _step in range(STEPS):
    for k in keys:
        kv.pushpull(k, values[k], priority=-k)
if RANK == 0:
    print('kv_exit: leaving with work in flight', flush=True)
# no wait: the exit hook must finish the work and stop the threads before MPI finalizes
