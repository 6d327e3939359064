"""A user's training script on a cluster whose hosts are not alike: rank 0 asks for
design='funneled', the other ranks' environment sets MPI_KVSTORE_DESIGN=chained (the test
sets it per rank through the launcher's environment). Launched as users launch (python
SCRIPT, no mpi4py -m), so nothing catches the store's ConfigError: every rank must end with
it, naming the design and every rank's choice, instead of training into a hang.

usage: kv_agree_train.py
"""
import os
import time

import mxnet as mx
import numpy as np
from mpi4py import MPI

import mpi_kvstore

RANK = MPI.COMM_WORLD.Get_rank()
if RANK > 0:
    os.environ['MPI_KVSTORE_DESIGN'] = 'chained'   # what one host's environment said
start = time.monotonic()
try:
    kv = mpi_kvstore.create('dist_mpi', design='funneled' if RANK == 0 else None)
finally:
    # How long the refusal took, for the test (the traceback follows on stderr).
    print('rank %d: store creation ended after %.2f s' % (RANK, time.monotonic() - start),
          flush=True)
net = mx.gluon.nn.Dense(4, in_units=8)
net.initialize(mx.init.Constant(0.1))
trainer = mx.gluon.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1}, kvstore=kv)
for step in range(5):
    x = mx.nd.array(np.full((2, 8), RANK + step, dtype=np.float32))
    with mx.autograd.record():
        loss = net(x).sum()
    loss.backward()
    trainer.step(2 * kv.num_workers)
mx.nd.waitall()
print('rank %d: trained 5 steps' % RANK, flush=True)
