"""hvd.DistributedOptimizer's allreduce, rejected by the store, leaves its gradients as they
were where its prescale (1/gradient_predivide_factor) stays an engine op (float16 and
integer gradients: horovod.ops._fold), and the retried call scales them once. Rejected: a
list with something that is no NDArray, and a call made while an earlier collective's error
waits to be raised (on every rank alike, so none of them submits). Before, the prescale op
ran first: a rejected call left them halved, the retry quartered them.

usage: hvd_opt_rejected.py DESIGN
"""
import mxnet as mx
import numpy as np

import mpi_kvstore.horovod as hvd
from mpi_kvstore.errors import MPIKVStoreError

from common import RANK, SIZE, close, design_arg, done, expect_raises

DESIGN = design_arg()
PREDIVIDE = 2.0
VALUES = np.array([1, 2, 3, 5, -7, 9])

hvd.init(design=DESIGN, autotune='0')
store = hvd.global_process_set._store
opt = hvd.DistributedOptimizer(mx.optimizer.SGD(learning_rate=0.1),
                               gradient_predivide_factor=PREDIVIDE)


def horovods(dtype):
    """Horovod's sum of allreduce_(grad, prescale_factor=1/PREDIVIDE): each rank's value
    prescaled in its dtype (float16 in float32, integers truncated), then summed."""
    parts = []
    for r in range(SIZE):
        value = VALUES * (r + 1)
        if dtype == 'float16':
            parts.append((value.astype(np.float32) * np.float32(1 / PREDIVIDE)).astype(dtype))
        else:
            parts.append((value.astype(np.float64) * (1 / PREDIVIDE)).astype(dtype))
    return sum(parts[1:], parts[0])


for dtype in ('float16', 'int32'):
    mine = (VALUES * (RANK + 1)).astype(dtype)
    grad = mx.nd.array(mine, dtype=dtype)
    expect_raises(TypeError, opt._do_allreduce, [0, 1], [grad, np.ones(6)],
                  contains='tensor 1 of 2')
    close(grad.asnumpy(), mine, '%s after a list with no NDArray' % dtype, rtol=0, atol=0)
    store._job.errors.record_error('an earlier allreduce', RuntimeError('failed earlier'))
    expect_raises(MPIKVStoreError, opt._do_allreduce, 0, grad, contains='failed earlier')
    close(grad.asnumpy(), mine, '%s after an earlier error' % dtype, rtol=0, atol=0)
    opt._do_allreduce(0, grad)
    store.wait()
    close(grad.asnumpy(), horovods(dtype), '%s retried' % dtype, rtol=0, atol=0)

done('hvd_opt_rejected[%s]' % DESIGN)
hvd.shutdown()
