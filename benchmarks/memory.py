"""RSS growth over many pushpulls: does a long run's memory stay flat?

    mpiexec -n N python -m benchmarks.memory [--calls 1000000] [--keys 10] [--kbytes 16]

Each method runs a warm-up of 5% of --calls, then --calls measured calls, in steps of --keys
calls, one per key on float32 arrays of --kbytes KB each; RSS is sampled after the warm-up
and at every tenth of the measured calls. Methods: raw_mpi (Allreduce(IN_PLACE): what MPI
itself costs in memory), engine_op (an engine op that only completes, per array: no MPI),
and mpi_kvstore:D (kv.pushpull of every key, then kv.wait(), per design D). Each step first
holds the arrays behind one engine op, as backward holds the gradients it writes, so every
pushpull's engine op runs on an engine worker, as in training.

Reported per method: growth in MB (largest over ranks), bytes per call, growth per
1,000,000 calls (target: under 2 MB), and us per call.
"""
import gc
import os

import mxnet as mx
from mpi4py import MPI

import mpi_kvstore  # noqa: F401  (registers dist_mpi with mx.kv.create)
from benchmarks import harness, peers, report
from benchmarks.memory_probe import Gate, gated_step, rss_mb
from mpi_kvstore.engine import core as engine

COMM = MPI.COMM_WORLD
ENGINE_DESIGNS = ('funneled', 'concurrent', 'chained')   # the designs that push engine ops
TARGET_MB_PER_MILLION = 2.0
SAMPLES = 10
WARMUP = 0.05                 # warm-up calls, a share of --calls


def parse_args(argv=None):
    parser = harness.parser(__doc__)
    parser.add_argument('--calls', type=int, default=1000000,
                        help='measured calls per method, after the warm-up')
    parser.add_argument('--keys', type=int, default=10, help='keys (arrays) per step')
    parser.add_argument('--kbytes', type=int, default=16, help='KB of float32 per key')
    parser.add_argument('--designs', '--design', default=','.join(ENGINE_DESIGNS),
                        help='comma-separated mpi_kvstore designs')
    parser.add_argument('--timeout', type=float, default=3600.0, help='seconds a method may take')
    parser.add_argument('--out', default=harness.DEFAULT_OUT, help='folder for the JSON results')
    args = parser.parse_args(argv)
    if args.calls < args.keys or args.keys < 1 or args.kbytes < 1:
        raise SystemExit('need --calls >= --keys >= 1 and --kbytes >= 1')
    return args


# ---------------------------------------------------------------- measuring

def measure(step, args, sync=None):
    """Run step() for the warm-up, then for the measured calls; RSS at SAMPLES points.

    step() makes args.keys calls. Returns the row stored in the JSON; growth and time are the
    largest over ranks."""
    steps = args.calls // args.keys
    warm_steps = int(steps * WARMUP)
    for _ in range(warm_steps):
        step()
    if sync:
        sync()
    gc.collect()
    COMM.Barrier()
    samples = [rss_mb()]
    with harness.Timer() as timer:
        for i in range(SAMPLES):
            for _ in range(steps * (i + 1) // SAMPLES - steps * i // SAMPLES):
                step()
            if sync:
                sync()
            samples.append(rss_mb())
    calls = steps * args.keys
    growth = COMM.allreduce(samples[-1] - samples[0], op=MPI.MAX)
    seconds = COMM.allreduce(timer.elapsed, op=MPI.MAX)
    return {'calls': calls, 'warmup_calls': warm_steps * args.keys,
            'rss_before_MB': samples[0], 'rss_after_MB': samples[-1], 'rss_samples_MB': samples,
            'growth_MB': growth, 'bytes_per_call': growth * 2 ** 20 / calls,
            'MB_per_million': growth * 1e6 / calls, 'us_per_call': seconds / calls * 1e6}


# ---------------------------------------------------------------- the methods

def bench_raw(args):
    return measure(peers.raw_allreduce_op(args.kbytes << 10, args.keys), args)


def _arrays(args, value=0.0):
    return [mx.nd.full((args.kbytes * 256,), value, dtype='float32') for _ in range(args.keys)]


def bench_engine_op(args):
    arrays = _arrays(args)

    def complete(completion):
        completion.done()

    def step():
        for array in arrays:
            engine.push(complete, mutable=[array], name='memory_engine_op')
        for array in arrays:
            array.wait_to_read()
    return measure(step, args, sync=mx.nd.waitall)


def bench_store(args, design, kv):
    keys = list(range(args.keys))
    arrays = _arrays(args, 1.0)
    kv.init(keys, arrays)
    # NaiveEngine runs every op inline and waits for it: a gate would never open.
    naive = os.environ.get('MXNET_ENGINE_TYPE') == 'NaiveEngine'
    gate = Gate(arrays) if design in ENGINE_DESIGNS and not naive else None

    def step():
        gated_step(kv, keys, arrays, gate)
    step()
    harness.check_sum(arrays[0].asnumpy(), COMM.size, f'mpi_kvstore:{design} pushpull')
    for array in arrays:
        array[:] = 0
    mx.nd.waitall()
    return measure(step, args, sync=mx.nd.waitall)


# ---------------------------------------------------------------- one run

class Run(harness.Run):
    """Rows so far; saved after every method so a killed job still leaves them."""

    def __init__(self, args):
        super().__init__('memory', args)
        self.rows = []

    def method(self, name, bench, *bench_args):
        harness.rank0_print(f'measuring {name} ...')
        with harness.deadline(self.args.timeout, f'{name} over {self.args.calls} calls'):
            row = bench(self.args, *bench_args)
        self.rows.append({'method': name, **row})
        harness.rank0_print('  ' + '  '.join(map(str, row_cells(self.rows[-1], self.baseline()))))
        self.save()

    def baseline(self):
        return next((r for r in self.rows if r['method'] == 'raw_mpi'), None)

    def save(self):
        self.write({'results': self.rows}, pattern='gated (engine ops on workers)',
                   target_MB_per_million=TARGET_MB_PER_MILLION)


def row_cells(row, baseline):
    """One table row; 'x raw' is growth / raw_mpi's growth ('-' while raw_mpi grew nothing)."""
    extra, ratio = '-', '-'
    if baseline is not None and row is not baseline:
        extra = f'{row["growth_MB"] - baseline["growth_MB"]:+.2f}'
        if baseline['growth_MB'] > 0:
            ratio = f'{row["growth_MB"] / baseline["growth_MB"]:.1f}x'
    verdict = 'ok' if row['MB_per_million'] < TARGET_MB_PER_MILLION else 'OVER TARGET'
    return [row['method'], row['calls'], f'{row["rss_before_MB"]:.1f}', f'{row["rss_after_MB"]:.1f}',
            f'{row["growth_MB"]:.2f}', extra, ratio, f'{row["bytes_per_call"]:.1f}',
            f'{row["MB_per_million"]:.2f}', f'{row["us_per_call"]:.1f}', verdict]


HEADER = ['method', 'calls', 'RSS0(MB)', 'RSS1(MB)', 'grow(MB)', '-raw(MB)', 'x raw', 'B/call',
          'MB/1M', 'us/call', '']


def main(argv=None):
    args = parse_args(argv)
    run = Run(args)
    harness.rank0_print(f'memory benchmark: {COMM.size} ranks, {args.calls} calls per method after '
                        f'{WARMUP:.0%} warm-up, {args.keys} keys x {args.kbytes} KB float32, '
                        'engine ops on workers')
    run.method('raw_mpi', bench_raw)
    run.method('engine_op', bench_engine_op)
    for design in harness.designs(args.designs):
        name = f'mpi_kvstore:{design}'
        kv, why = harness.create_store(design, args.timeout)
        if why:
            run.skip(name, why)
            continue
        run.method(name, bench_store, design, kv)
        kv.close()
        del kv
        gc.collect()
    harness.rank0_print(f'\nRSS growth after the warm-up, largest over ranks; -raw = growth minus '
                        f'raw_mpi\'s, x raw = the ratio; MB/1M = growth per 1,000,000 calls '
                        f'(target < {TARGET_MB_PER_MILLION:g})')
    baseline = run.baseline()
    harness.rank0_print(report.text(HEADER, [row_cells(row, baseline) for row in run.rows],
                                    align=['left'] + ['right'] * 9 + ['left']))
    run.save()
    harness.rank0_print(f'\nresults written to {run.json_path}')


if __name__ == '__main__':
    harness.run_main(main)
