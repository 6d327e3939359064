"""RSS stays flat over many pushpulls whose engine ops run on engine worker threads.

Each step holds the arrays behind one engine op, as backward holds the gradients it
writes, pushes a pushpull of every key behind it, then releases it and waits. So every
pushpull's engine op runs on an engine worker thread (a thread Python did not create),
never inline on this one, in every design. RSS is sampled after a warm-up and at the
end; the growth, the largest over ranks, must stay under BOUND_MB.

usage: kv_memory.py DESIGN [CALLS [BOUND_MB [KEYS [KBYTES]]]]
"""
import os
import sys
import time

import mxnet as mx
from mpi4py import MPI

import mpi_kvstore

from common import RANK, SIZE, WORLD, close, design_arg, done
from memory_probe import Gate, gated_step, rss_mb


def main():
    design = design_arg()
    calls = int(sys.argv[2]) if len(sys.argv) > 2 else 100000
    bound_mb = float(sys.argv[3]) if len(sys.argv) > 3 else 3.0
    nkeys = int(sys.argv[4]) if len(sys.argv) > 4 else 10
    kbytes = int(sys.argv[5]) if len(sys.argv) > 5 else 16
    name = 'kv_memory[%s]' % design

    kv = mpi_kvstore.create('dist_mpi', design=design)
    keys = list(range(nkeys))
    arrays = [mx.nd.zeros((kbytes * 256,), dtype='float32') for _ in keys]
    kv.init(keys, arrays)
    # NaiveEngine runs every op inline and waits for it: a gate would never open.
    gate = Gate(arrays) if os.environ.get('MXNET_ENGINE_TYPE') != 'NaiveEngine' else None

    def steps(count):
        for _ in range(count):
            gated_step(kv, keys, arrays, gate)

    # Arrays of zeros stay zero whatever the sum, so the loop checks itself cheaply.
    arrays[0][:] = 1
    steps(1)
    close(arrays[0].asnumpy(), SIZE, 'first pushpull')
    arrays[0][:] = 0
    mx.nd.waitall()

    total_steps = max(1, calls // nkeys)
    warm_steps = max(1, total_steps // 20)        # 5%: allocator pools, kept thread states
    steps(warm_steps)
    mx.nd.waitall()
    before = rss_mb()
    start = time.perf_counter()
    steps(total_steps)
    mx.nd.waitall()
    seconds = time.perf_counter() - start
    after = rss_mb()
    kv.close()

    pushpulls = total_steps * nkeys
    growth = WORLD.allreduce(after - before, op=MPI.MAX)
    summary = ('%d pushpulls of %d keys x %d KB after %d warm-up: RSS %.1f -> %.1f MB, '
               'growth %.2f MB (max over %d ranks; %.1f bytes/call), bound %.1f MB, %.1f us/call'
               % (pushpulls, nkeys, kbytes, warm_steps * nkeys, before, after, growth, SIZE,
                  growth * 2 ** 20 / pushpulls, bound_mb, seconds / pushpulls * 1e6))
    if growth >= bound_mb:
        raise AssertionError('rank %d: %s: RSS grew too much: %s' % (RANK, name, summary))
    if RANK == 0:
        print('%s: %s' % (name, summary), flush=True)
    done(name, growth_mb=growth, bound_mb=bound_mb, pushpulls=pushpulls)


main()
