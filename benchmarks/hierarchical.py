"""Hierarchical against flat allreduce, with ranks on several hosts.

    python -m testbed run --hosts 2 --rate 3gbit -n 4 --ppn 2 --timeout 300 -- \\
        python -m benchmarks.hierarchical [--sizes 1M,4M,16M,64M] [--label 3gbit]

Methods (mpi:flat, mpi:hier, mpi:leaders, kv:flat, kv:hier), interleaved, on float32 buffers
in place; per size and method the median (min, max) of the slowest rank, and hierarchical /
flat ratios (below 1: the hierarchy is faster): docs/hierarchical.md#the-benchmark.
"""
import functools
import sys

from mpi4py import MPI

from benchmarks import harness, peers, report
from mpi_kvstore.comm.host import Comm

COMM = MPI.COMM_WORLD
FULL = {'sizes': harness.parse_sizes('1M,4M,16M,64M'), 'warmups': 1, 'trials': 5}


def parse_args(argv=None):
    parser = harness.parser(__doc__)
    harness.add_common_args(parser, quick=False, full=FULL, timeout=240)
    parser.add_argument('--design', default='funneled', help='design of the two kv stores')
    parser.add_argument('--methods', help='comma-separated subset of mpi:flat,mpi:hier,'
                                          'mpi:leaders,kv:flat,kv:hier (default: all)')
    parser.add_argument('--label', default='', help='added to the JSON name (e.g. the rate)')
    return harness.resolve_quick(parser.parse_args(argv), FULL)


def comm_op(reduce, nbytes, what):
    """reduce(buf) in place on a float32 buffer of nbytes (checked, then of zeros)."""
    return harness.summed_op(reduce, nbytes, COMM.size, what)


def create_store(args, hierarchical):
    """Collective: a store of --design with `hierarchical`, or SystemExit on every rank."""
    kv, why = harness.create_store(args.design, args.timeout, hierarchical=hierarchical)
    if why:
        raise SystemExit(f'no store with hierarchical={hierarchical}: {why}')
    return kv


PAIRS = (('mpi:hier', 'mpi:flat'), ('mpi:leaders', 'mpi:flat'), ('kv:hier', 'kv:flat'))


def main():
    args = parse_args()
    names = COMM.gather(MPI.Get_processor_name())
    flat = COMM.Dup()
    hier = Comm(COMM, hierarchical='on')
    active = hier.hierarchical
    if COMM.rank == 0:
        layout = ', '.join(f'{r}:{n}' for r, n in enumerate(names))
        print(f'{COMM.size} ranks on {hier.hierarchy.nodes} hosts ({layout}); hierarchy active: '
              f'{active}; {MPI.Get_library_version().splitlines()[0]}', flush=True)
    if not active:
        harness.rank0_print('the hierarchy does not apply here (one host, or one rank a '
                            'host): both columns measure flat MPI')
    stores = {mode: create_store(args, mode) for mode in ('off', 'on')}
    rows = []
    for index, nbytes in enumerate(args.sizes):
        with harness.deadline(args.timeout, f'size {harness.format_size(nbytes)}'):
            makers = {'mpi:flat': functools.partial(peers.raw_allreduce_op, nbytes, comm=flat),
                      'mpi:hier': functools.partial(comm_op, hier.allreduce, nbytes,
                                                    f'Comm.allreduce (hierarchical={hier.hierarchical})')}
            if active:
                # The store's other shape, for hosts of different sizes, forced on this layout
                # (a private method: what Comm.allreduce runs where hosts differ in size).
                makers['mpi:leaders'] = functools.partial(
                    comm_op, hier.hierarchy._via_leaders, nbytes, 'via leaders')
            for mode, kv in stores.items():
                makers[f'kv:{"hier" if mode == "on" else "flat"}'] = functools.partial(
                    harness.pushpull_op, kv, [index], nbytes)
            wanted = harness.names(args.methods) if args.methods else list(makers)
            ops = {name: make() for name, make in makers.items() if name in wanted}
            times = harness.interleaved(ops, args.trials, args.warmups)
        medians = {name: harness.median(ts) for name, ts in times.items()}
        for name, ts in times.items():
            base = 'kv:flat' if name.startswith('kv:') else 'mpi:flat'
            ratio = medians[name] / medians[base] if base in medians else float('nan')
            rows.append({'size': nbytes, 'method': name, 'median_s': medians[name],
                         'min_s': min(ts), 'max_s': max(ts), 'times_s': ts, 'vs_flat': ratio})
    harness.rank0_print(report.text(
        ['size', 'method', 'median ms', 'min ms', 'max ms', 'vs flat'],
        [[harness.format_size(r['size']), r['method'], f'{r["median_s"] * 1e3:.1f}',
          f'{r["min_s"] * 1e3:.1f}', f'{r["max_s"] * 1e3:.1f}', f'{r["vs_flat"]:.3f}'] for r in rows],
        align=['right'] * 6))
    harness.rank0_print('\nratios hierarchical / flat (median of the slowest rank; < 1: '
                        'hierarchy faster)')
    ratios = []
    for nbytes in args.sizes:
        found = {r['method']: r['median_s'] for r in rows if r['size'] == nbytes}
        ratios.append([harness.format_size(nbytes)] + [
            f'{found[a] / found[b]:.3f}' if a in found and b in found else '-' for a, b in PAIRS])
    harness.rank0_print(report.text(['size'] + [f'{a}/{b}' for a, b in PAIRS], ratios,
                                    align=['right'] * (1 + len(PAIRS))))
    for kv in stores.values():
        kv.close()
    hier.free()
    flat.Free()
    run = harness.Run('hierarchical', args, label=args.label)
    run.write({'results': rows}, sizes=[harness.format_size(n) for n in args.sizes],
              hosts=names, nodes=hier.hierarchy.nodes, hierarchy_active=active)
    harness.rank0_print('wrote', run.json_path)

if __name__ == '__main__':
    sys.exit(harness.run_main(main))
