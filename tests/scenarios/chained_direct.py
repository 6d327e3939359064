"""The chained design's one function for a repeated call (Chained.again_direct), which the
store calls straight (Job.again_direct): hvd.allreduce_ by name and unnamed, kv.pushpull
per key, and out-of-place hvd.allreduce, on the defaults (chained on one host).

usage: chained_direct.py

Each step issues a burst of N tensors (float32, float64, int32; 1 to 5,000 elements) of
new values, rank r contributing (r + 1) * (step + 1) * base, and checks every result
against numpy. The first array of a burst is held by an engine op until every call was
made (as scenarios/chained_fuse.py does), so the burst's first op is pending while the
rest are pushed, on every rank, whatever the machine's timing. Per step each rank reports:
the pushes through Chained._push (the burst's first call, and any call the one function
hands there), Job.again's calls (the general path), and the 'fuse' and 'fastpath'
counters. At step CHANGE one array is replaced (hvd: another shape under the same name;
kv: a new array of the same shape, a key's shape being fixed): that call takes the full
path (a 'miss') and sums right, and two steps later it is on the one function again.
"""
import collections

import mxnet as mx
import numpy as np

import mpi_kvstore
import mpi_kvstore.horovod as hvd
from mpi_kvstore import debug
from mpi_kvstore.designs import chained
from mpi_kvstore.store import job as job_module

from common import RANK, SIZE, Held, close, done

N, STEPS, CHANGE = 24, 8, 5
DTYPES = ('float32', 'float64', 'int32')
SIZES = (1, 7, 256, 5000)
FACTOR = SIZE * (SIZE + 1) // 2      # sum over ranks of (rank + 1)

kv = mpi_kvstore.create('dist_mpi', autotune='0')
hvd.init(autotune='0')

PUSHES = collections.Counter()   # design -> Chained._push calls
GENERAL = [0]                    # Job.again calls
_push, _again = chained.Chained._push, job_module.Job.again


def _counted_push(self, *args):
    PUSHES[id(self)] += 1
    return _push(self, *args)


def _counted_again(self, *args):
    GENERAL[0] += 1
    return _again(self, *args)


chained.Chained._push = _counted_push
job_module.Job.again = _counted_again


def base_of(i, count, dtype):
    return ((np.arange(count) + i) % 7).astype(dtype)


def make(i, extra=0):
    count = SIZES[i % len(SIZES)] + extra
    return mx.nd.zeros((count,), dtype=DTYPES[i % len(DTYPES)])


def call(api, i, array):
    """-> the array that holds the sum."""
    if api == 'named':
        return hvd.allreduce_(array, name='n%d' % i, op=hvd.Sum)
    if api == 'unnamed':
        return hvd.allreduce_(array, op=hvd.Sum)
    if api == 'copy':
        return hvd.allreduce(array, name='c%d' % i, op=hvd.Sum)
    kv.pushpull('k%d' % i, array)
    return array


def step(api, arrays, s, store):
    for i, array in enumerate(arrays):
        array[:] = mx.nd.array(base_of(i, array.shape[0], array.dtype) * (RANK + 1) * (s + 1),
                               dtype=array.dtype)
    mx.nd.waitall()
    design = store._job.design
    pushes, general = PUSHES[id(design)], GENERAL[0]
    held = Held([arrays[0]])
    before = debug.snapshot()
    outs = [call(api, i, array) for i, array in enumerate(arrays)]
    held.release()
    store.wait()
    for out in outs:
        out.wait_to_read()
    for i, out in enumerate(outs):
        close(out.asnumpy(), base_of(i, out.shape[0], out.dtype).astype(np.float64)
              * (s + 1) * FACTOR, '%s %d step %d' % (api, i, s))
    if api == 'copy':   # the input is left as it was
        close(arrays[1].asnumpy(), base_of(1, arrays[1].shape[0], arrays[1].dtype)
              .astype(np.float64) * (RANK + 1) * (s + 1), 'copy input step %d' % s)
    fuse = debug.since(before, 'fuse')
    return [PUSHES[id(design)] - pushes, GENERAL[0] - general, fuse.get('linked', 0),
            debug.since(before, 'fastpath')]


def run(api, store):
    arrays = [make(i) for i in range(N)]
    if api == 'kv':
        for i, array in enumerate(arrays):
            kv.init('k%d' % i, mx.nd.zeros(array.shape, dtype=array.dtype))
    steps = []
    for s in range(STEPS):
        if s == CHANGE:   # the full path for this one call, then prepared again
            arrays[3] = make(3) if api == 'kv' else make(3, extra=2)
        steps.append(step(api, arrays, s, store))
    return steps


found = {api: run(api, kv if api == 'kv' else hvd.store())
         for api in ('named', 'unnamed', 'kv', 'copy')}
direct = [kv._job.again_direct == kv._job.design.again_direct,
          hvd.store()._job.again_direct == hvd.store()._job.design.again_direct]
done('chained_direct', steps=found, direct=direct, design=kv._job.design.name)
hvd.shutdown()
kv.close()
