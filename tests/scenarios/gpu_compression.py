"""Gradient compression of GPU (CuPy) arrays, against the host path bit for bit.

usage: gpu_compression.py

The same gradients go through each codec twice: as CuPy arrays (encoded and decoded by
device_codecs' kernels, only the compressed bytes crossing to the host) and as numpy
arrays (the host kernels of compression/kernels.py, which tests/test_compression.py checks against
numpy references and MXNet's transcribed loop). Results, and 2-bit residuals after every
step, must be bitwise equal, and equal on every rank. No MXNet.
"""
import cupy
import numpy as np

from mpi_kvstore import compression
from mpi_kvstore.comm import host as comm_mod
from mpi_kvstore.comm.collective import Collective
from mpi_kvstore.comm.reduce import Reducer
from mpi_kvstore.compression import device as device_codecs

from common import RANK, SIZE, WORLD, done, record, same_on_all_ranks

DEVICE = RANK % cupy.cuda.runtime.getDeviceCount()
cupy.cuda.Device(DEVICE).use()
comm = comm_mod.Comm(WORLD, 'off', gpu_transport='staged')
errors = []
reducer = Reducer(SIZE, lambda req, err: errors.append((req.key, err)),
                  lambda reqs, err: errors.extend((r.key, err) for r in reqs))
device_calls = []
for name in ('encode16', 'decode16', 'quantize_pack', 'count_sum'):
    real = getattr(device_codecs, name)
    setattr(device_codecs, name,
            lambda *a, _real=real, _name=name: (device_calls.append(_name), _real(*a))[1])


def gradients(step, dtype):
    rng = np.random.default_rng(1000 * step + RANK)
    sizes = (1, 7, 1000, 4099, 33)   # odd sizes: partial code bytes and padded chunks
    return [(rng.standard_normal(n) * (0.3 + i)).astype(dtype) for i, n in enumerate(sizes)]


def run(codec, arrays, place):
    reqs = [Collective('allreduce', 'g%d' % i, array.dtype, array.shape, place=place, seq=i,
                       view=array, codec=codec) for i, array in enumerate(arrays)]
    reducer.allreduce(reqs, comm)
    cupy.cuda.Device().synchronize()
    return [cupy.asnumpy(a) if place == 'gpu' else a for a in arrays]


def check(what, on_device, on_host, across_ranks=True):
    for i, (d, h) in enumerate(zip(on_device, on_host)):
        record(d, h, '%s, array %d' % (what, i))
        if not np.array_equal(d.view(np.uint8), h.view(np.uint8)):
            bad = np.flatnonzero(d != h)
            raise AssertionError('rank %d: %s, array %d: the GPU path differs from the host '
                                 'path at %d of %d values (first %s: %r against %r)'
                                 % (RANK, what, i, bad.size, d.size, bad[:3], d[bad[:3]],
                                    h[bad[:3]]))
        if across_ranks:
            same_on_all_ranks(d, '%s, array %d' % (what, i))


for kind in ('fp16', 'bf16', 'fp16-ring', 'bf16-ring'):
    codec = compression.wire_cast(kind)
    for dtype in ('float32', 'float64'):
        host = gradients(1, dtype)
        device = [cupy.asarray(h) for h in host]
        check('%s of %s' % (kind, dtype), run(codec, device, 'gpu'), run(codec, host, 'cpu'))

for phases in (32, 2):   # two_phase_min_ranks: one phase here, then two from 2 ranks on
    on_gpu, on_cpu = compression.TwoBit(0.5, phases), compression.TwoBit(0.5, phases)
    for step in range(4):
        host = gradients(step, 'float32')
        device = [cupy.asarray(h) for h in host]
        what = '2bit (two_phase_min_ranks=%d) step %d' % (phases, step)
        check(what, run(on_gpu, device, 'gpu'), run(on_cpu, host, 'cpu'))
        for i in range(len(host)):
            check('%s residual %d' % (what, i),
                  [cupy.asnumpy(on_gpu.residual('g%d' % i))], [on_cpu.residual('g%d' % i)],
                  across_ranks=False)   # each rank's own

# float16 overflow: every rank fails the bucket alike, on the GPU as on the host.
huge = [np.full(5, 1e6 * SIZE, np.float32)]
for place, arrays in (('gpu', [cupy.asarray(huge[0])]), ('cpu', [huge[0].copy()])):
    del errors[:]
    run(compression.WireCast('fp16'), arrays, place)
    assert errors and isinstance(errors[0][1], OverflowError) if SIZE > 1 else not errors, \
        (place, errors)
del errors[:]

assert not errors, errors
assert {'encode16', 'decode16', 'quantize_pack', 'count_sum'} <= set(device_calls) \
    if SIZE > 1 else {'quantize_pack', 'count_sum'} <= set(device_calls), set(device_calls)
if RANK == 0:
    print('device codec calls: %d' % len(device_calls))
comm.free()
done('gpu_compression', device_calls=sorted(set(device_calls)))
