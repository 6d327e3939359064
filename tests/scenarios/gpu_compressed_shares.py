"""The sharded optimizer's fp16/bf16 reduce-scatter on device (CuPy) buffers, against numpy
and the host path, bit for bit (seed 003 on a GPU).

usage: gpu_compressed_shares.py TRANSPORT

TRANSPORT is the gpu_transport option (staged, nccl, cuda_mpi, auto). The cases and the
numpy reference are compressed_shares.py's (the host run of the same code): each rank's
share equals numpy's float32 sum of the ranks' 16-bit gradients, rounded once, and the
host path's result on the same bucket; the rest of each buffer is untouched. What moved:
only 16-bit values, by the transport's all-to-all (no reduce-scatter or allreduce of the
float buffers), cast, summed and decoded by the device kernels. At one rank the store
reduces nothing, so the codec runs directly (its all-to-all to itself: NCCL's send and
receive where TRANSPORT is nccl). No MXNet.
"""
import sys

import cupy
import numpy as np
from compressed_shares import CASES, check_share, gradients, reference, requests

from mpi_kvstore import compression
from mpi_kvstore.comm import host as comm_mod
from mpi_kvstore.comm import reduce as reduce_mod
from mpi_kvstore.comm import transports
from mpi_kvstore.compression import device as device_codecs

from common import RANK, SIZE, WORLD, done

TRANSPORT = sys.argv[1]
DEVICE = RANK % cupy.cuda.runtime.getDeviceCount()
cupy.cuda.Device(DEVICE).use()
comm = comm_mod.Comm(WORLD, 'off', gpu_transport=TRANSPORT)
failed = []
reducer = reduce_mod.Reducer(SIZE, lambda req, err: failed.append((req.key, err)),
                             lambda reqs, err: failed.extend((r.key, err) for r in reqs))

moved = []          # (transport, collective, dtype, bytes) of every device collective


def spying(op, real):
    def spy(self, buf, *more):
        moved.append((self.name, op, buf.dtype.name, buf.nbytes))
        return real(self, buf, *more)
    return spy


for cls in transports.REGISTRY.values():
    for op in ('alltoall', 'reduce_scatter', 'allreduce'):
        setattr(cls, op, spying(op, getattr(cls, op)))
kernels = set()
for name in ('encode16', 'decode16', 'sum_rows16'):
    real = getattr(device_codecs, name)
    setattr(device_codecs, name,
            lambda *a, _real=real, _name=name: (kernels.add(_name), _real(*a))[1])


def reduce_scatter(reqs):
    """As the store runs a bucket; at one rank (where the store runs nothing) the codec
    itself, in the same device scope."""
    if SIZE > 1:
        reducer.reduce_scatter(reqs, comm)
        return
    with reduce_mod._scope(reqs, comm):
        failed.extend((r.key, e) for r, e in reqs[0].codec.reduce_scatter(reqs, comm).items())


checked = 0
for spec in ('fp16', 'bf16', 'fp16-ring'):
    codec, kind = compression.wire_cast(spec), spec.split('-')[0]
    for dtype in ('float32', 'float64'):
        for name, sizes in CASES:
            for average in ((False, True) if SIZE > 1 else (False,)):
                what = '%s %s %s (average=%s)' % (spec, dtype, name, average)
                every = [gradients(r, sizes, dtype) for r in range(SIZE)]
                on_gpu = [cupy.asarray(a) for a in every[RANK]]
                on_cpu = [a.copy() for a in every[RANK]]
                del moved[:]
                for place, arrays in (('gpu', on_gpu), ('cpu', on_cpu)):
                    reqs = requests(arrays, place, average, place + what, codec)
                    reduce_scatter(reqs)
                    assert not failed, (what, failed)
                cupy.cuda.Device().synchronize()
                values = sum(sizes)
                assert moved and all(op == 'alltoall' and dt == 'uint16'
                                     and nbytes <= 2 * (values + SIZE * len(sizes))
                                     for _, op, dt, nbytes in moved), (what, moved)
                for i, array in enumerate(on_gpu):
                    got = cupy.asnumpy(array)
                    want = reference(kind, [e[i] for e in every], dtype, average)
                    label = '%s, array %d' % (what, i)
                    check_share(got, every[RANK][i], want, RANK, SIZE, label + ' (GPU)')
                    assert np.array_equal(got.view(np.uint8), on_cpu[i].view(np.uint8)), \
                        'rank %d: %s: the GPU path differs from the host path' % (RANK, label)
                    checked += 1
ran = {name for name, _, _, _ in moved}
assert ran == {TRANSPORT} or TRANSPORT == 'auto', (TRANSPORT, ran)
assert kernels == {'encode16', 'decode16', 'sum_rows16'}, kernels

# An fp16 sum out of range in one rank's share fails the bucket on every rank, alike.
huge = np.full(4 * SIZE + 1, 1.0, np.float32)
huge[-1] = 70000.0 * SIZE
reqs = requests([cupy.asarray(huge)], 'gpu', False, 'overflow', compression.wire_cast('fp16'))
reduce_scatter(reqs)
assert len(failed) == 1 and isinstance(failed[0][1], OverflowError), failed

if RANK == 0:
    print('gpu_compressed_shares: %d shares equal numpy and the host path through %s'
          % (checked, ', '.join(sorted(ran))))
comm.free()
done('gpu_compressed_shares[%s]' % TRANSPORT)
