"""The GPU communication path on CuPy arrays (MXNet's GPU wheels are not here).

Reduces and broadcasts device buffers through the same backend and fusion code
the store uses, single and fused, and checks against sums from (rank, size).
"""
import cupy
import numpy as np

from mpi_kvstore.comm import Comm, cuda_aware
from mpi_kvstore.config import Config
from mpi_kvstore.collective import Collective
from mpi_kvstore.designs.base import Design
from common import RANK, SIZE, WORLD, close, done

cupy.cuda.Device(RANK % cupy.cuda.runtime.getDeviceCount()).use()
comm = Comm(WORLD)
errors = []
sched = Design(WORLD, Config(environ={}), lambda req, err: errors.append(err))


def device_request(seq, n, value, dtype='float32'):
    buf = cupy.full((n,), value, dtype=dtype)
    req = Collective('allreduce', 'g%d' % seq, np.dtype(dtype), (n,))
    req.seq, req.view = seq, buf
    return req, buf


single, buf = device_request(0, 1 << 20, RANK + 1)
sched.execute([single], comm)
close(cupy.asnumpy(buf), SIZE * (SIZE + 1) / 2, 'single device allreduce')

fused = [device_request(i, 1000 + i, (RANK + 1) * (i + 1)) for i in range(1, 6)]
sched.execute([r for r, _ in fused], comm)
for i, (_, b) in enumerate(fused, start=1):
    close(cupy.asnumpy(b), i * SIZE * (SIZE + 1) / 2, 'fused device allreduce %d' % i)

bcast = cupy.full((333,), 10 + RANK, dtype='float64')
comm.bcast(bcast, root=SIZE - 1)
close(cupy.asnumpy(bcast), 10 + SIZE - 1, 'device broadcast')
assert not errors, errors
if RANK == 0:
    print('CUDA-aware MPI: %s' % cuda_aware())
done('gpu_comm')
