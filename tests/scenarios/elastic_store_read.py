"""What a survivor sees of a collective in flight when its peer dies (tests/test_elastic_store.py),
2 workers under ``python -m mpi_kvstore run --elastic``, a store on the world:

both pushpull once (a sum of 1 + 2); worker 1 then SIGKILLs itself, and worker 0 pushpulls
again, then reads the output. It prints what the read raised, what the output holds after
it, what the next pushpull raised, whether the store's threads still run, and then, after
``world.reform()`` and ``kv.reset()``, the store's rank and size and a sum on the new world.
"""
import os
import signal
import threading
import time

import mxnet as mx

import mpi_kvstore
from mpi_kvstore.elastic import HorovodInternalError
from mpi_kvstore.elastic.world import World

world = World.from_environment()
world.form()
kv = mpi_kvstore.create('dist_mpi', world=world)
me = world.id
x = mx.nd.full((1000,), me + 1.0)
kv.pushpull('g', x)
print('worker %d: first sum %.1f' % (me, x.asnumpy()[0]), flush=True)
if me == 1:
    os.kill(os.getpid(), signal.SIGKILL)
started = time.monotonic()
kv.pushpull('g', x)
try:
    x.asnumpy()
    print('worker 0: the read raised nothing', flush=True)
except mx.base.MXNetError as err:
    print('worker 0: the read raised MXNetError (%s) after %.2f s'
          % ('lost' in str(err), time.monotonic() - started), flush=True)
print('worker 0: the output holds %s' % x.asnumpy()[:2], flush=True)
try:
    kv.pushpull('g', x)
    print('worker 0: the next pushpull raised nothing', flush=True)
except HorovodInternalError as err:
    print('worker 0: the next pushpull raised HorovodInternalError: %s' % err, flush=True)
time.sleep(0.5)
print('worker 0: store threads alive %s' % sorted(
    t.name for t in threading.enumerate() if t.name.startswith('mpi_kvstore-')), flush=True)
world.reform()
kv.reset()
y = mx.nd.full((4,), 5.0)
kv.pushpull('g2', y)
print('worker 0: after the reset rank %d of %d, sum %.1f' % (kv.rank, kv.num_workers,
                                                           y.asnumpy()[0]), flush=True)
kv.close()
