"""The fp16/bf16 reduce-scatter of the sharded optimizer (WireCast.reduce_scatter through
Reducer.reduce_scatter), on host arrays, against numpy, bit for bit.

usage: compressed_shares.py   (on 3 ranks it checks 3, then 2 of them)

The device path (tests/scenarios/gpu_compressed_shares.py) runs the same code on CuPy
arrays; only the cast kernels and the transport's all-to-all differ. So this checks, where
no GPU is, what the two share: the cut into shares (uneven where the ranks do not divide a
size, empty where a request has fewer values than ranks), the packing of fused requests,
the scale by 1/N before the cast and N after it, the float32 sum of the ranks' 16-bit values
in rank order, averaging, the values outside this rank's share left alone, and an fp16
overflow failing the bucket on every rank. The reference is numpy's own: each rank's
gradients (all ranks' are made here from their seeds) cast to float16 or ml_dtypes'
bfloat16, summed in float32, rounded once. No MXNet.
"""
import sys

# Without MXNet, as on the GPU machines: the codecs and the communicator need none (the
# mxnet-free contract), and each rank starts about 3 s of CPU sooner.
sys.modules.setdefault('mxnet', None)

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

from mpi_kvstore.comm.collective import Collective  # noqa: E402
from mpi_kvstore.comm.fusion import pieces  # noqa: E402

WIDE = {'fp16': np.float16, 'bf16': ml_dtypes.bfloat16}
# One request alone (uneven shares: 1000 N + 1 values), fused ones of odd sizes, one with
# fewer values than ranks (empty shares), as the sharded optimizer's buckets hold them.
CASES = (('alone', (3001,)), ('fused', (1, 7, 1000, 33, 4099)), ('tiny', (2,)))


def gradients(rank, sizes, dtype, seed=0):
    rng = np.random.default_rng(1000 * seed + rank)
    return [(rng.standard_normal(n) * (0.3 + i)).astype(dtype) for i, n in enumerate(sizes)]


def reference(kind, every_rank, dtype, average):
    """Numpy's reduce-scatter of the ranks' 16-bit gradients, every value (each rank keeps
    its share): float32(values) / N cast to 16 bits (round to nearest even), summed in
    float32 in rank order, cast to 16 bits once more, times N in float32, in ``dtype``."""
    n, wide = len(every_rank), WIDE[kind]
    scale = np.float32(1.0 / n)
    total = np.zeros(every_rank[0].size, np.float32)
    for values in every_rank:
        total += (values.astype(np.float32) * scale).astype(wide).astype(np.float32)
    want = (total.astype(wide).astype(np.float32) * np.float32(n)).astype(dtype)
    if average:
        want *= 1.0 / n   # Reducer._average, in the array's dtype
    return want


def requests(arrays, place, average, key, codec=None):
    return [Collective('reducescatter', '%s%d' % (key, i), np.dtype(array.dtype), array.shape,
                       average=average, place=place, seq=i, view=array, codec=codec)
            for i, array in enumerate(arrays)]


def check_share(got, before, want, rank, size, what):
    """This rank's share of ``got`` is ``want``'s, bit for bit; the rest is ``before``."""
    counts, displs = pieces(got.size, size)
    start, stop = displs[rank], displs[rank] + counts[rank]
    if not np.array_equal(got[start:stop].view(np.uint8), want[start:stop].view(np.uint8)):
        bad = np.flatnonzero(got[start:stop] != want[start:stop])
        raise AssertionError('rank %d: %s: %d of %d values of the share differ from numpy '
                             '(first at %s: %r against %r)'
                             % (rank, what, bad.size, stop - start, bad[:3] + start,
                                got[start + bad[:3]], want[start + bad[:3]]))
    if not (np.array_equal(got[:start], before[:start])
            and np.array_equal(got[stop:], before[stop:])):
        raise AssertionError('rank %d: %s: values outside the share changed' % (rank, what))


def run_all(world):
    """Every case on the ranks of ``world``; -> shares checked on this rank."""
    from mpi_kvstore import compression
    from mpi_kvstore.comm import host as comm_mod
    from mpi_kvstore.comm.reduce import Reducer
    rank, size = world.Get_rank(), world.Get_size()
    comm = comm_mod.Comm(world, 'off')
    failed = []
    reducer = Reducer(size, lambda req, err: failed.append((req.key, err)),
                      lambda reqs, err: failed.extend((r.key, err) for r in reqs))
    checked = 0
    for spec in ('fp16', 'bf16', 'fp16-ring'):
        codec, kind = compression.wire_cast(spec), spec.split('-')[0]
        for dtype in ('float32', 'float64'):
            for name, sizes in CASES:
                for average in (False, True):
                    what = '%d ranks: %s %s %s (average=%s)' % (size, spec, dtype, name,
                                                                average)
                    every = [gradients(r, sizes, dtype) for r in range(size)]
                    mine = [a.copy() for a in every[rank]]
                    reqs = requests(mine, 'cpu', average, what, codec)
                    reducer.reduce_scatter(reqs, comm)
                    assert not failed, (what, failed)
                    for i, got in enumerate(mine):
                        want = reference(kind, [e[i] for e in every], dtype, average)
                        check_share(got, every[rank][i], want, rank, size,
                                    '%s, array %d' % (what, i))
                        checked += 1
    # An fp16 sum out of range in one rank's share fails the bucket on every rank, alike.
    huge = [np.full(4 * size + 1, 1.0, np.float32)]
    huge[0][-1] = 70000.0 * size   # in the last rank's share only
    reqs = requests(huge, 'cpu', False, 'overflow', compression.wire_cast('fp16'))
    reducer.reduce_scatter(reqs, comm)
    assert len(failed) == 1 and isinstance(failed[0][1], OverflowError), failed
    comm.free()
    return checked


if __name__ == '__main__':
    from mpi4py import MPI

    from common import RANK, SIZE, WORLD, done

    # One job for both sizes (starting ranks costs more than the checks): every rank, then
    # the first two on a communicator of their own while the others wait.
    for ranks in sorted({SIZE, 2}, reverse=True):
        sub = WORLD.Split(0 if RANK < ranks else MPI.UNDEFINED, RANK)
        if sub != MPI.COMM_NULL:
            checked = run_all(sub)
            sub.Free()
            if RANK == 0:
                print('compressed_shares: %d shares at %d ranks equal numpy' % (checked, ranks))
    done('compressed_shares')
