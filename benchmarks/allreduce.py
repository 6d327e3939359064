"""Allreduce through kv.pushpull: every mpi_kvstore design against raw MPI and MXNet's dist_sync.

    mpiexec -n 2 python -m benchmarks.allreduce --quick
    mpiexec -n N python -m benchmarks.allreduce [--sizes 4K,1M,256M] [--designs funneled,chained]

Methods, on the same float32 arrays: raw_mpi (Allreduce(send, recv), the reference),
raw_mpi:in_place, mpi_kvstore:D (kv.pushpull in place, then wait_to_read, per design D),
dist_sync (ps-lite; --p3: its P3 van) and engine_floor (one engine op per array, no MPI;
raw_mpi + engine_floor is the best a pushpull-then-wait can do, column 'vs floor'). The
fusion case pushes 100 keys of 16 KB back to back, as gluon.Trainer does, against one raw
Allreduce of the same bytes. Every store is created first and stays alive; each case times
every method in interleaved rounds, a round the slowest rank's, under --timeout.
"""
import functools
import gc

from mpi4py import MPI

import mpi_kvstore  # noqa: F401  (registers dist_mpi with mx.kv.create)
from benchmarks import harness, peers, report

COMM = MPI.COMM_WORLD
FUSION_KEY0 = 1000       # fusion keys sit apart from the size sweep's keys 0, 1, ...
TARGET_FUSION_RATIO = 3.0


def parse_args(argv=None):
    parser = harness.parser(__doc__)
    harness.add_common_args(parser)
    parser.add_argument('--designs', help='comma-separated mpi_kvstore designs (default: all)')
    peers.add_args(parser)
    parser.add_argument('--fusion-keys', type=int, default=100, help='keys in the fusion case')
    parser.add_argument('--fusion-size', type=harness.parse_size, default=16 << 10,
                        help='bytes per key in the fusion case')
    return harness.resolve_quick(parser.parse_args(argv))


# ---------------------------------------------------------------- one run's bookkeeping

class Run(harness.Run):
    """Results so far; saved after every case so a killed job still leaves them."""

    def __init__(self, args):
        super().__init__('allreduce', args)
        self.rows = []

    def time_case(self, case, nbytes, keys, makers):
        """Build every method's op, time them in interleaved rounds under one deadline, keep
        a row per method. makers: {name: make_op}, name a method, or 'fusion_reference'
        (raw_mpi's one Allreduce of the case's keys * nbytes)."""
        times = self.time_ops(f'{case} {harness.format_size(nbytes)} x {keys}', makers)
        for name, seconds in times.items():
            row = harness.summarize(seconds, nbytes * keys, COMM.size)
            if name == 'fusion_reference':
                self.rows.append({'method': 'raw_mpi', 'case': name, 'keys': 1, **row})
            else:
                self.rows.append({'method': name, 'case': case, 'keys': keys, **row})
        gc.collect()
        self.save()

    def save(self):
        derive(self.rows)
        self.write({'results': self.rows},
                   sizes=[harness.format_size(n) for n in self.args.sizes], interleaved=True)


# ---------------------------------------------------------------- the stores, and each case's ops

def create_stores(run):
    """Collective: ({method: store} of every design that could be created, DistSync or None).
    All stay alive together, so that every case can interleave them; a design that fails is
    skipped with its reason. dist_sync comes last: ps-lite allows one worker per process,
    and a hang there is the likeliest."""
    stores = {}
    for design in harness.designs(run.args.designs):
        method = f'mpi_kvstore:{design}'
        kv, why = harness.create_store(design, run.args.timeout)
        if why:
            run.skip(method, why)
        else:
            stores[method] = kv
    # Each case is bounded by --timeout; the servers' own alarm bounds all of them together.
    dist_sync = peers.DistSync(run, lifetime=run.args.timeout * (len(run.args.sizes) + 3))
    why = dist_sync.start()
    if why:
        run.skip(dist_sync.name, why)
        return stores, None
    stores[dist_sync.name] = dist_sync.kv
    return stores, dist_sync


def close_stores(stores, dist_sync):
    """Collective: close every mpi_kvstore store (re-raising any error one deferred), then
    stop dist_sync, whose stop is collective and needs its store unreferenced."""
    for method in list(stores):
        if dist_sync is None or method != dist_sync.name:
            kv = stores.pop(method)
            kv.wait()
            kv.close()
            del kv
    stores.clear()
    gc.collect()
    if dist_sync is not None:
        dist_sync.stop()


def makers(stores, keys, nbytes, fusion=False):
    """{name: make_op} of one case, each op moving len(keys) arrays of nbytes: raw MPI (and
    in place, or for the fusion case one Allreduce of all keys' bytes), the engine floor,
    then each store's pushpull."""
    count = len(keys)
    found = {'raw_mpi': functools.partial(peers.raw_allreduce_op, nbytes, count, in_place=False)}
    if fusion:
        found['fusion_reference'] = functools.partial(peers.raw_allreduce_op, nbytes * count,
                                                      in_place=False)
    else:
        found['raw_mpi:in_place'] = functools.partial(peers.raw_allreduce_op, nbytes, count)
    found['engine_floor'] = functools.partial(peers.engine_floor_op, nbytes, count)
    for method, kv in stores.items():
        found[method] = functools.partial(harness.pushpull_op, kv, keys, nbytes)
    return found


def bench(run):
    """Every case (the size sweep, then the fusion case), every method interleaved in each."""
    stores, dist_sync = create_stores(run)
    for index, nbytes in enumerate(run.args.sizes):
        run.time_case('allreduce', nbytes, 1, makers(stores, [index], nbytes))
    keys = list(range(FUSION_KEY0, FUSION_KEY0 + run.args.fusion_keys))
    run.time_case('fusion', run.args.fusion_size, len(keys),
                  makers(stores, keys, run.args.fusion_size, fusion=True))
    close_stores(stores, dist_sync)
    run.save()


# ---------------------------------------------------------------- report

def derive(rows):
    """Add busbw/raw (the same as raw latency / latency, for one size and rank count) and the
    speed-up over dist_sync (or dist_sync:p3) to every row that has both references."""
    def latency_of(method):
        return {(r['case'], r['bytes']): r['latency_us'] for r in rows if r['method'] == method}
    pslite = next((r['method'] for r in rows if r['method'].startswith('dist_sync')), 'dist_sync')
    raw, dist = latency_of('raw_mpi'), latency_of(pslite)
    floor = latency_of('engine_floor')
    one_op = next((r['latency_us'] for r in rows if r['case'] == 'fusion_reference'), None)
    for row in rows:
        key = (row['case'], row['bytes'])
        row['busbw_vs_raw'] = raw[key] / row['latency_us'] if key in raw else None
        row['vs_floor'] = ((raw[key] + floor[key]) / row['latency_us']
                           if key in raw and key in floor and row['method'] != 'engine_floor'
                           else None)
        row['speedup_vs_dist_sync'] = dist[key] / row['latency_us'] if key in dist else None
        if row['case'] == 'fusion' and one_op:
            row['vs_one_raw_allreduce'] = row['latency_us'] / one_op


def _ratio(value):
    return f'{value:.2f}x' if value is not None else '-'


def _latencies(row):
    """'median (min-max)' of a row's latency in us (report.spread_text)."""
    return report.spread_text({'median': row['latency_us'], 'min': row['min_us'], 'max': row['max_us']})


LATENCY_HEADER = 'median (min-max) us'


def print_sizes(run):
    harness.rank0_print(f'\nallreduce of float32, {COMM.size} ranks, {run.args.trials} interleaved rounds '
                        f'(max over ranks): median (min-max); GB = 1e9 bytes')
    derive(run.rows)
    rows = [[harness.format_size(nbytes), row['method'], _latencies(row), f'{row["algbw_GBps"]:.3f}',
             f'{row["busbw_GBps"]:.3f}', _ratio(row['busbw_vs_raw']), _ratio(row['vs_floor']),
             _ratio(row['speedup_vs_dist_sync'])]
            for nbytes in run.args.sizes
            for row in run.rows if row['case'] == 'allreduce' and row['bytes'] == nbytes]
    harness.rank0_print(report.text(['size', 'method', LATENCY_HEADER, 'algbw(GB/s)', 'busbw(GB/s)',
                                     'busbw/raw', 'vs floor', 'vs dist_sync'], rows,
                                    align=['right', 'left'] + ['right'] * 6, indent='  ') + '\n')


def print_fusion(run):
    keys, size = run.args.fusion_keys, run.args.fusion_size
    reference = next((r for r in run.rows if r['case'] == 'fusion_reference'), None)
    if reference is None:
        return
    harness.rank0_print(f'fusion: {keys} keys x {harness.format_size(size)}, one pushpull each, then wait; '
                        f'vs one raw Allreduce of {harness.format_size(keys * size)} '
                        f'({reference["latency_us"]:.1f} us); target <= {TARGET_FUSION_RATIO:g}x')
    derive(run.rows)
    rows = []
    for row in (r for r in run.rows if r['case'] == 'fusion'):
        ratio = row['vs_one_raw_allreduce']
        verdict = 'ok' if ratio <= TARGET_FUSION_RATIO else 'over target'
        verdict = '' if row['method'] in ('raw_mpi', 'engine_floor') else verdict
        rows.append([row['method'], _latencies(row), f'{ratio:.2f}x', _ratio(row['vs_floor']),
                     _ratio(row['speedup_vs_dist_sync']), verdict])
    harness.rank0_print(report.text(['method', LATENCY_HEADER, 'x raw 1 op', 'vs floor',
                                     'vs dist_sync', ''], rows, align=['left'] + ['right'] * 4 + ['left']))
    harness.rank0_print("x raw 1 op and vs floor compare medians; vs floor: (raw_mpi + engine_floor) "
                        "/ total, the share of what an op inside MXNet's engine can reach")


def plot(run):
    """A panel per size: each method's median bandwidth (busbw; algbw at one rank, where busbw
    is 0). engine_floor moves no data between ranks: a bandwidth for it would mislead."""
    field = 'busbw_GBps' if COMM.size > 1 else 'algbw_GBps'
    panels = {}
    for row in (r for r in run.rows if r['case'] == 'allreduce' and r['method'] != 'engine_floor'):
        panels.setdefault(harness.format_size(row['bytes']), {})[row['method']] = row[field]
    return report.plot_bars(run.png_path, panels, field.replace('_GBps', ' (GB/s)'),
                            f'allreduce via pushpull, {COMM.size} ranks, float32')


def main(argv=None):
    run = Run(parse_args(argv))
    harness.rank0_print(f'allreduce benchmark: {COMM.size} ranks, sizes '
                        f'{",".join(harness.format_size(n) for n in run.args.sizes)}, '
                        f'{run.args.warmups} warmups, {run.args.trials} trials, methods interleaved')
    bench(run)
    print_sizes(run)
    print_fusion(run)
    run.save()
    if COMM.rank == 0:
        print(f'\nresults written to {run.json_path}\n{plot(run)}', flush=True)


if __name__ == '__main__':
    harness.run_main(main)
