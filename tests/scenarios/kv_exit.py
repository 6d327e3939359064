"""Leave the interpreter with collectives still in flight: no crash, no hang.

usage: kv_exit.py DESIGN
"""
import mxnet as mx

import mpi_kvstore

from common import RANK, design_arg

kv = mpi_kvstore.create('dist_mpi', design=design_arg())
keys = list(range(50))
kv.init(keys, [mx.nd.zeros((1 << 14,)) for _ in keys])
values = [mx.nd.ones((1 << 14,)) * (RANK + 1) for _ in keys]
for _step in range(5):
    for k in keys:
        kv.pushpull(k, values[k], priority=-k)
if RANK == 0:
    print('kv_exit: leaving with work in flight', flush=True)
# no wait: the exit hook must finish the work and stop the threads before MPI finalizes
