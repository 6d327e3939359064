"""Hierarchical allreduce (hierarchical=MODE): results against numpy, and the hierarchy's state.

usage: kv_hierarchical.py DESIGN EXPECT [MODE]

EXPECT says what every Comm of the store must be, given where the ranks run:
  scatter    hierarchy active, every host with as many ranks (reduce-scatter shape)
  leaders    hierarchy active, hosts of different sizes (reduce to leaders shape)
  inactive   flat (one host, or MODE off)
MODE (default on) goes to the store as its argument.
Values differ by rank and by position, so a piece of the sum put back in the wrong place,
or a host's part counted twice, shows; sizes that L ranks cannot split evenly are included.
"""
import sys

import mxnet as mx
import numpy as np

import mpi_kvstore
from mpi_kvstore.comm.host import MPI, Comm

from common import RANK, SIZE, WORLD, close, done, expect_raises, record

DESIGN = sys.argv[1]
EXPECT = sys.argv[2]
MODE = sys.argv[3] if len(sys.argv) > 3 else 'on'
DTYPES = ('float32', 'float64', 'int32', 'float16')
LENGTHS = (1, 3, 1001, 300_001)   # the last is over the 1 MB fusion threshold in float32/64


def values(rank, n, dtype, salt=0):
    """Small integers (sums stay exact, also in float16) that depend on rank and index."""
    i = np.arange(n, dtype=np.int64)
    return (((i * 7 + rank * 3 + salt) % 11) - 5).astype(dtype)


def expected(n, dtype, salt=0):
    return sum(values(r, n, np.float64, salt) for r in range(SIZE)).astype(dtype)


def exact(actual, wanted, what):
    record(np.asarray(actual), wanted, what)
    if not np.array_equal(np.asarray(actual), wanted):
        bad = np.flatnonzero(np.asarray(actual).ravel() != wanted.ravel())
        raise AssertionError('rank %d: %s: %d wrong values, first at %d: got %s, expected %s'
                             % (RANK, what, bad.size, bad[0], np.asarray(actual).ravel()[bad[0]],
                                wanted.ravel()[bad[0]]))


def comms_of(design):
    """Every Comm the design built (lanes, control, data)."""
    found = []
    for value in vars(design).values():
        items = value if isinstance(value, list) else [value]
        for item in items:
            for part in (item if isinstance(item, tuple) else (item,)):
                if isinstance(part, Comm) and all(part is not f for f in found):
                    found.append(part)
    return found


def check_state(kv):
    assert kv.config.hierarchical == MODE, kv.config
    comms = comms_of(kv._job.design)
    assert comms, 'no Comm found in %r' % kv._job.design
    for comm in comms:
        active = EXPECT in ('scatter', 'leaders')
        assert comm.hierarchical == active, (
            'rank %d: %s: hierarchical is %s, expected %s (nodes=%d)'
            % (RANK, DESIGN, comm.hierarchical, active, comm.hierarchy.nodes))
        if active:
            assert comm.hierarchy.uniform == (EXPECT == 'scatter'), comm.hierarchy.uniform
            assert comm.hierarchy.nodes > 1 and comm.hierarchy.node.Get_size() >= 1, comm.hierarchy.nodes
        elif MODE == 'on':
            assert comm.hierarchy.node is None and comm.hierarchy.cross is None
    if DESIGN == 'chained':   # its native op would call MPI_Allreduce flat on the handle
        assert kv._job.design._native == (kv.config.native_ops and not comms[0].hierarchical)
    return [{'hierarchical': comm.hierarchical, 'nodes': comm.hierarchy.nodes,
             'uniform': comm.hierarchy.uniform if comm.hierarchical else None} for comm in comms]


def check_single_keys(kv):
    for dtype in DTYPES:
        for n in LENGTHS:
            key = 'single_%s_%d' % (dtype, n)
            val = mx.nd.array(values(RANK, n, dtype), dtype=dtype)
            kv.pushpull(key, val)                          # in place
            exact(val.asnumpy(), expected(n, dtype), 'pushpull %s' % key)
    val = mx.nd.array(values(RANK, 6, 'float32').reshape(2, 3))
    out = mx.nd.zeros((2, 3))
    kv.pushpull('shaped', val, out=out)
    exact(out.asnumpy(), expected(6, 'float32').reshape(2, 3), 'pushpull into out')
    exact(val.asnumpy(), values(RANK, 6, 'float32').reshape(2, 3), 'value untouched')


def check_fused_lists(kv):
    for dtype in DTYPES:
        lengths = (5, 1, 1000, 33, 4097)
        keys = ['fused_%s_%d' % (dtype, i) for i in range(len(lengths))]
        vals = [mx.nd.array(values(RANK, n, dtype, salt=i), dtype=dtype)
                for i, n in enumerate(lengths)]
        kv.pushpull(keys, vals)                            # one fused bucket
        for i, (n, val) in enumerate(zip(lengths, vals)):
            exact(val.asnumpy(), expected(n, dtype, salt=i), 'fused %s' % keys[i])
    keys = ['dev_%d' % i for i in range(3)]
    ctxs = [mx.cpu(0), mx.cpu(1)]
    vals = [[mx.nd.array(values(RANK, 50 + i, 'float32', salt=d), ctx=c)
             for d, c in enumerate(ctxs)] for i in range(3)]
    outs = [[mx.nd.zeros((50 + i,), ctx=c) for c in ctxs] for i in range(3)]
    kv.pushpull(keys, vals, out=outs)                      # devices summed, then ranks
    for i, per_key in enumerate(outs):
        wanted = expected(50 + i, 'float32', salt=0) + expected(50 + i, 'float32', salt=1)
        for out in per_key:
            exact(out.asnumpy(), wanted, 'fused per-device list key %d' % i)


def check_average(kv):
    for dtype in ('float32', 'float64'):
        for n in (3, 300_001):
            val = mx.nd.array(values(RANK, n, dtype), dtype=dtype)
            mpi_kvstore.allreduce_(val, average=True, name='avg_%s_%d' % (dtype, n), store=kv)
            close(val.asnumpy(), expected(n, 'float64') / SIZE, 'average %s %d' % (dtype, n))


def check_broadcast(kv):
    for dtype in DTYPES:
        outs = [mx.nd.zeros((1001,), dtype=dtype), mx.nd.zeros((1001,), ctx=mx.cpu(1),
                                                                dtype=dtype)]
        kv.broadcast('bcast_%s' % dtype, mx.nd.array(values(RANK, 1001, dtype), dtype=dtype),
                     out=outs)
        for out in outs:
            exact(out.asnumpy(), values(0, 1001, dtype), 'broadcast %s' % dtype)


def check_wire_cast(kind):
    """compression=fp16/bf16 through the hosts where the reduce-scatter shape is active: each
    host's float32 sum / N rounded to 16 bits, summed in float32 in host order, rounded
    again, times N (elementwise; flat where the hierarchy is not: ranks in place of hosts).
    Bitwise against that simulation, and the same on every rank."""
    import ml_dtypes
    wire = np.float16 if kind == 'fp16' else ml_dtypes.bfloat16
    names = WORLD.allgather(MPI.Get_processor_name())
    groups = ([[r for r in range(SIZE) if names[r] == name] for name in sorted(set(names))]
              if EXPECT == 'scatter' else [[r] for r in range(SIZE)])
    with mpi_kvstore.create('dist_mpi', design=DESIGN, hierarchical=MODE,
                            compression=kind) as kv:
        for n in (1, 3, 1001, 300_001):
            def part(rank, n=n):
                rng = np.random.default_rng([rank, n])
                return (rng.standard_normal(n) * 3).astype(np.float32)
            val = mx.nd.array(part(RANK))
            kv.pushpull('wire_%s_%d' % (kind, n), val)
            acc = np.zeros(n, np.float32)
            for group in groups:
                total = np.zeros(n, np.float32)
                for r in group:
                    total += part(r)
                acc += (total * np.float32(1.0 / SIZE)).astype(wire).astype(np.float32)
            wanted = acc.astype(wire).astype(np.float32) * np.float32(SIZE)
            got = val.asnumpy()
            exact(got, wanted, '%s through %d group(s), %d values' % (kind, len(groups), n))
            np.testing.assert_allclose(got, sum(part(r).astype(np.float64) for r in range(SIZE)),
                                       rtol=0, atol=0.01 * SIZE * 3 * 4)


def check_disagreement():
    """Ranks given different modes fail together (none is left waiting in a Split)."""
    mine = 'on' if RANK == 0 else 'off'
    expect_raises(mpi_kvstore.ConfigError, Comm, WORLD, mine, contains='disagree')


def main():
    with mpi_kvstore.create('dist_mpi', design=DESIGN, hierarchical=MODE) as kv:
        comms = check_state(kv)
        check_single_keys(kv)
        check_fused_lists(kv)
        check_average(kv)
        check_broadcast(kv)
        kv.wait()
    for kind in ('fp16', 'bf16'):
        check_wire_cast(kind)
    if SIZE > 1:
        check_disagreement()
    if RANK == 0:
        print('kv_hierarchical[%s]: %d Comm(s), hierarchical=%s, expected %s'
              % (DESIGN, len(comms), MODE, EXPECT))
    done('kv_hierarchical[%s, %s]' % (DESIGN, EXPECT), comms=comms)


main()
