"""Ranks pushpull one key with shapes (6,4) and (4,6), read the output, and exit
without another store call. No read may return the rank's own unsummed values,
and the process must not exit 0 with the error unraised.

usage: fault_mismatch_read.py DESIGN DTYPE
"""
import sys

import mxnet as mx
import numpy as np

import mpi_kvstore

from common import RANK, design_arg

DESIGN = design_arg()
DTYPE = sys.argv[2] if len(sys.argv) > 2 else 'float32'

kv = mpi_kvstore.create('dist_mpi', design=DESIGN)
shape = (6, 4) if RANK == 0 else (4, 6)
out = mx.nd.ones(shape, dtype=DTYPE) * (RANK + 1)
try:
    kv.pushpull('grad', out)
except mpi_kvstore.RankMismatchError as err:   # blocking: the call itself knows
    print('rank %d: call raised %s' % (RANK, type(err).__name__), flush=True)
try:
    first = out.asnumpy()
    print('rank %d: first read returned %s' % (RANK, first.ravel()[:3]), flush=True)
except mx.base.MXNetError as err:
    print('rank %d: first read raised MXNetError: %s' % (RANK, str(err).splitlines()[0]),
          flush=True)
again = out.asnumpy()
print('rank %d: read returned %s' % (RANK, again.ravel()[:3]), flush=True)
poison = mpi_kvstore.store.deferred.poison_value(DTYPE)
assert np.array_equal(again, np.full(shape, poison, dtype=DTYPE), equal_nan=True), \
    'rank %d: a failed collective left %s, not the poison %s' % (RANK, again.ravel()[:3], poison)
print('rank %d: output poisoned' % RANK, flush=True)
# no kv.wait(), no kv.close(): the exit hook must not let this pass as a success
