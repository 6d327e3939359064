"""The options left 'auto' follow the hosts the job spans, and a store with them sums right.

usage: kv_topology.py DESIGN HOSTS   (HOSTS: how many hosts the test placed the ranks on)

A store created with no options resolves partition_bytes, credit_bytes, progress_sleep_us
and autotune from the hosts (mpi_kvstore/comm/topology.py): across hosts 4M, 8M, 200 us and
on (the negotiated designs then run a tuner), on one host 0, 0, 0 and off (200 us where the
ranks outnumber the cores). Then a 10 MB pushpull
(cut in pieces across hosts) and a few small ones give numpy's sums. A store whose ranks are
given different partition_bytes raises
ConfigError on every rank.
"""
import os
import sys

import mxnet as mx
import numpy as np

import mpi_kvstore
from mpi_kvstore import debug

from common import RANK, SIZE, close, design_arg, done, expect_raises

DESIGN = design_arg()
HOSTS = int(sys.argv[2])
# One host with more ranks than cores polls with sleeps too (mpiexec here binds no rank).
CROWDED = HOSTS == 1 and SIZE > len(os.sched_getaffinity(0))
EXPECTED = ((4 << 20, 8 << 20, 200.0, True) if HOSTS > 1 else
            (0, 0, 200.0 if CROWDED else 0.0, False))

kv = mpi_kvstore.create('dist_mpi', design=DESIGN)
got = (kv.config.partition_bytes, kv.config.credit_bytes, kv.config.progress_sleep_us,
       kv.config.autotune)
if got != EXPECTED:
    raise AssertionError('rank %d: %d host(s): auto options resolved to %s, expected %s'
                         % (RANK, HOSTS, got, EXPECTED))
state = kv.autotune_state
if (state is not None) != (HOSTS > 1 and DESIGN in ('funneled', 'concurrent')):
    raise AssertionError('rank %d: %d host(s), %s: autotune state %r' % (RANK, HOSTS, DESIGN,
                                                                          state))

before = debug.snapshot()
big = mx.nd.array(np.arange(10 << 18, dtype=np.float32) % 1000 * (RANK + 1))   # 10 MB
small = [mx.nd.full((257,), RANK + i) for i in range(3)]
kv.pushpull('big', big, priority=-1)
for i, arr in enumerate(small):
    kv.pushpull('small%d' % i, arr, priority=i)
total = SIZE * (SIZE + 1) / 2
close(big.asnumpy(), np.arange(10 << 18, dtype=np.float64) % 1000 * total, 'big')
for i, arr in enumerate(small):
    close(arr.asnumpy(), sum(r + i for r in range(SIZE)), 'small%d' % i)
cut = debug.since(before, 'schedule').get('pieces_cut', 0)
if HOSTS > 1 and DESIGN in ('funneled', 'concurrent') and cut != 1:
    raise AssertionError('rank %d: the 10 MB array was not cut (pieces_cut %d)' % (RANK, cut))
if HOSTS == 1 and cut:
    raise AssertionError('rank %d: something was cut on one host (%d)' % (RANK, cut))
kv.close()

# Ranks given different pieces would pair different collectives: all must raise instead.
expect_raises(mpi_kvstore.ConfigError, mpi_kvstore.create, 'dist_mpi', design=DESIGN,
              partition_bytes=4096 * (RANK + 1), contains='disagree on partition_bytes: 4K on rank 0')
# So would ranks of different negotiation windows (the agreement message's size), which
# window=auto makes 512 with shard_optimizer and 256 without.
expect_raises(mpi_kvstore.ConfigError, mpi_kvstore.create, 'dist_mpi', design=DESIGN,
              shard_optimizer=RANK == 0, contains='disagree on shard_optimizer: True on rank 0')
expect_raises(mpi_kvstore.ConfigError, mpi_kvstore.create, 'dist_mpi', design=DESIGN,
              window=100 + RANK, contains='disagree on window: 100 on rank 0')
done('kv_topology[%s, %d hosts]' % (DESIGN, HOSTS), pieces_cut=cut)
