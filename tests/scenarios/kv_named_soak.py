"""RSS stays flat over many uniquely named collectives (``mpi_kvstore.allreduce(x,
name='metric_%d' % i)``, as a script that names a value per step does), and every sum is
right.

First, names used again after the store dropped their staging buffers: capacity + 2 names
(at most 18: a larger capacity keeps them all) in three rounds, each also under a
second shape and dtype, through allreduce (sum and mean), broadcast and reducescatter; with
HOROVOD_CACHE_CAPACITY set, the same through mpi_kvstore.horovod, whose store must take that
capacity.

Then the soak: each call allreduces a fresh 4 KB array (1024 float32) to which rank r gives
r + 1 + i, so the sum is numpy's sum of those; results are checked against numpy in batches
of CHECK calls issued before any is read (reading one waits for its collective, as reading
a metric does). RSS is sampled after the first half of the calls and at the end; the growth
over the second half, the largest over ranks, must stay under BOUND_MB. The store keeps a
staging buffer per name up to its ``name_cache_capacity`` (CAPACITY; -1: the option's
default, or MPI_KVSTORE_NAME_CACHE_CAPACITY).

usage: kv_named_soak.py DESIGN [CALLS [BOUND_MB [CAPACITY]]]
"""
import os
import sys
import time

import mxnet as mx
import numpy as np
from mpi4py import MPI

import mpi_kvstore
import mpi_kvstore.horovod as hvd

from common import RANK, SIZE, WORLD, close, design_arg, done
from memory_probe import rss_mb

ELEMENTS = 1024          # 4 KB of float32
CHECK = 64               # results read and checked at once
REUSED = 16              # names used again: the larger capacities keep them all


def run(kv, first, count):
    """Allreduce ``count`` uniquely named arrays from call ``first`` on; check every sum."""
    ranks = np.arange(SIZE, dtype=np.float64)
    for start in range(first, first + count, CHECK):
        calls = range(start, min(start + CHECK, first + count))
        out = [mpi_kvstore.allreduce(mx.nd.full((ELEMENTS,), RANK + 1 + i),
                                     name='metric_%d' % i, store=kv) for i in calls]
        got = np.stack([o.asnumpy() for o in out])
        want = np.array([np.sum(ranks + 1 + i, dtype=np.float32) for i in calls])
        close(got, want[:, None], 'allreduce of metric_%d..%d' % (calls[0], calls[-1]))


def reuse(kv, collectives):
    """Capacity + 2 names (at most REUSED + 2), used in three rounds, so that each comes back
    after it was dropped (or, past REUSED, found kept), under two shapes and dtypes each;
    ``collectives``: 'functional' or 'horovod'."""
    names = min(kv.config.name_cache_capacity, REUSED) + 2
    ranksum = SIZE * (SIZE + 1) / 2
    for round_ in range(3):
        pending = []   # issued before any is read: the cache sees them in flight
        for j in range(names):
            shift = 10 * round_ + j
            name = 'reused_%d' % j
            if collectives == 'horovod':
                pending.append((hvd.allreduce(mx.nd.full((8,), RANK + 1 + shift), op=hvd.Sum,
                                              name=name), ranksum + SIZE * shift, name))
                pending.append((hvd.allreduce(mx.nd.full((2, 3), RANK + 1 + shift,
                                                         dtype='int32'), name=name),
                                (ranksum + SIZE * shift) // SIZE, name + ' int32 mean'))
                continue
            pending.append((mpi_kvstore.allreduce(mx.nd.full((8,), RANK + 1 + shift),
                                                  name=name, store=kv),
                            ranksum + SIZE * shift, name))
            pending.append((mpi_kvstore.allreduce(mx.nd.full((2, 3), RANK + 1 + shift,
                                                             dtype='float64'),
                                                  average=True, name=name, store=kv),
                            (ranksum + SIZE * shift) / SIZE, name + ' float64 mean'))
            pending.append((mpi_kvstore.broadcast(mx.nd.full((5,), 100 * RANK + shift),
                                                  root=SIZE - 1, name=name, store=kv),
                            100 * (SIZE - 1) + shift, name + ' broadcast'))
            rows = mpi_kvstore.reducescatter(mx.nd.full((SIZE, 4), RANK + shift), name=name,
                                             store=kv)
            pending.append((rows, SIZE * shift + ranksum - SIZE, name + ' reducescatter'))
        for out, want, what in pending:
            close(out.asnumpy(), want, '%s %s, round %d' % (collectives, what, round_))
    kv.wait()


def main():
    design = design_arg()
    calls = int(sys.argv[2]) if len(sys.argv) > 2 else 50000
    bound_mb = float(sys.argv[3]) if len(sys.argv) > 3 else 5.0
    capacity = int(sys.argv[4]) if len(sys.argv) > 4 else -1
    name = 'kv_named_soak[%s]' % design
    options = {} if capacity < 0 else {'name_cache_capacity': capacity}
    kv = mpi_kvstore.create('dist_mpi', design=design, **options)
    reuse(kv, 'functional')
    if 'HOROVOD_CACHE_CAPACITY' in os.environ:
        hvd.init(design=design)
        hvd_kv = hvd.global_process_set._store
        want = int(os.environ['HOROVOD_CACHE_CAPACITY'])
        if hvd_kv.config.name_cache_capacity != want:
            raise AssertionError('rank %d: hvd.init gave its store name_cache_capacity %d, '
                                 'not HOROVOD_CACHE_CAPACITY=%d'
                                 % (RANK, hvd_kv.config.name_cache_capacity, want))
        reuse(hvd_kv, 'horovod')
        hvd.shutdown()

    half = calls // 2
    start = time.perf_counter()
    run(kv, 0, half)
    mx.nd.waitall()
    before = rss_mb()
    run(kv, half, calls - half)
    mx.nd.waitall()
    after = rss_mb()
    seconds = time.perf_counter() - start
    kept = len(kv.collectives.buffers)
    signed = len(kv.collectives._signed)
    capacity = kv.config.name_cache_capacity
    kv.close()

    growth = WORLD.allreduce(after - before, op=MPI.MAX)
    summary = ('%d uniquely named 4 KB allreduces, capacity %d (%d kept): RSS %.1f MB after '
               'the first half, %.1f MB at the end, growth %.2f MB (max over %d ranks; '
               '%.1f bytes/call), bound %.1f MB, %.1f us/call'
               % (calls, capacity, kept, before, after, growth, SIZE,
                  growth * 2 ** 20 / max(1, calls - half), bound_mb, seconds / calls * 1e6))
    if RANK == 0:
        print('%s: %s' % (name, summary), flush=True)
    if growth >= bound_mb:
        raise AssertionError('rank %d: %s: RSS grew too much: %s' % (RANK, name, summary))
    # Allreduces run in place (no staging buffer), the broadcasts and reduce-scatters of
    # reuse() stage: past the capacity only by buffers whose collectives were in flight at
    # the last call (at most the CHECK issued before any is read). The names' signatures
    # kept for repeated calls are bounded too.
    if not kept <= capacity + CHECK:
        raise AssertionError('rank %d: %s: %d staging buffers kept, with capacity %d'
                             % (RANK, name, kept, capacity))
    done(name, growth_mb=growth, bound_mb=bound_mb, kept=kept, capacity=capacity, calls=calls,
         signed=signed)


main()
