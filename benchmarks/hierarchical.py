"""Hierarchical against flat allreduce, with ranks on several hosts (issue 10, part 5).

    python -m testbed run --hosts 2 --rate 3gbit -n 4 --ppn 2 --timeout 300 -- \\
        python benchmarks/hierarchical.py [--sizes 1M,4M,16M,64M] [--warmups W] [--trials T]
        [--design funneled] [--no-kv] [--methods mpi:flat,mpi:hier] [--label 3gbit]
        [--out DIR]

Measured in one run, interleaved (every trial runs each method once, in an order that
rotates from trial to trial, so load from other work slows every method alike), on float32
buffers, in place:
  mpi:flat     COMM.Allreduce(IN_PLACE, buf): MPICH's own algorithm;
  mpi:hier     mpi_kvstore.comm.Comm(hierarchical='on').allreduce(buf): what the store
               runs where every host has as many ranks: Reduce_scatter inside each host,
               an Allreduce of each piece among the ranks with the same local rank (every
               rank of a host sends its share over the link), Allgatherv inside each host;
  mpi:leaders  the store's shape for hosts of different sizes, forced here: Reduce inside
               each host to its lowest rank, Allreduce among those leaders, Bcast inside
               each host;
  kv:flat, kv:hier  kv.pushpull(key, arr) then arr.wait_to_read(), on two stores, one with
               hierarchical=off, one with hierarchical=on (design --design).
Per size and method: the median over trials of the slowest rank's time; ratios are
hierarchical / flat from this run (below 1: the hierarchy is faster). Rank 0 prints a
table and writes benchmarks/results/hierarchical_n<N>[_<label>].json.
"""
import argparse
import os
import sys

import numpy as np
from mpi4py import MPI

import common

common.use_checkout()
import mxnet as mx  # noqa: E402

import mpi_kvstore  # noqa: E402
from mpi_kvstore.comm import Comm  # noqa: E402

COMM = MPI.COMM_WORLD
DEFAULT_SIZES = '1M,4M,16M,64M'


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--sizes', type=common.parse_sizes,
                        default=common.parse_sizes(DEFAULT_SIZES))
    parser.add_argument('--warmups', type=int, default=1)
    parser.add_argument('--trials', type=int, default=5)
    parser.add_argument('--design', default='funneled', help='design of the two kv stores')
    parser.add_argument('--no-kv', action='store_true', help='raw MPI methods only')
    parser.add_argument('--methods', default=None,
                        help='comma-separated subset of mpi:flat,mpi:hier,mpi:leaders,'
                             'kv:flat,kv:hier (default: all)')
    parser.add_argument('--label', default='', help='added to the JSON name (e.g. the rate)')
    parser.add_argument('--timeout', type=float, default=240,
                        help='seconds one size may take (all methods, all trials)')
    parser.add_argument('--out', default=common.DEFAULT_OUT)
    return parser.parse_args(argv)


def _check(values, expected, what):
    if not np.allclose(values, expected):
        raise RuntimeError(f'{what}: got {np.unique(values)[:5]}, expected {expected}')


def flat_op(comm, nbytes):
    buf = np.ones(nbytes // 4, np.float32)

    def op():
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    op()
    _check(buf, COMM.size, 'flat Allreduce')
    buf[:] = 0     # in-place sums of zeros neither grow to inf nor change the work
    return op


def comm_op(comm, nbytes):
    buf = np.ones(nbytes // 4, np.float32)

    def op():
        comm.allreduce(buf)
    op()
    _check(buf, COMM.size, 'Comm.allreduce (hierarchical=%s)' % comm.hierarchical)
    buf[:] = 0
    return op


def leaders_op(comm, nbytes):
    """The store's other shape, for hosts of different sizes, forced on this layout."""
    buf = np.ones(nbytes // 4, np.float32)

    def op():
        comm._allreduce_via_leaders(buf)   # noqa: SLF001 (what allreduce runs on uneven hosts)
    op()
    _check(buf, COMM.size, 'via leaders')
    buf[:] = 0
    return op


def kv_op(kv, key, nbytes):
    array = mx.nd.ones((nbytes // 4,), dtype='float32')

    def op():
        kv.pushpull(key, array)
        array.wait_to_read()
    op()
    _check(array.asnumpy(), COMM.size, f'pushpull ({kv.config.hierarchical})')
    array[:] = 0
    mx.nd.waitall()
    return op


def create_store(design, hierarchical):
    return mpi_kvstore.create('dist_mpi', design=design, hierarchical=hierarchical)


def interleaved(ops, warmups, trials):
    """{name: [seconds]}: every trial runs each op once, the order rotating; max over ranks."""
    names = list(ops)
    for _ in range(warmups):
        for name in names:
            COMM.Barrier()
            ops[name]()
    times = np.empty((trials, len(names)))
    for t in range(trials):
        order = names[t % len(names):] + names[:t % len(names)]
        for name in order:
            COMM.Barrier()
            with common.Timer() as timer:
                ops[name]()
            times[t, names.index(name)] = timer.elapsed
    COMM.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
    return {name: times[:, i].tolist() for i, name in enumerate(names)}


PAIRS = (('mpi:hier', 'mpi:flat'), ('mpi:leaders', 'mpi:flat'), ('kv:hier', 'kv:flat'))


def main():
    args = parse_args()
    names = COMM.gather(MPI.Get_processor_name())
    flat = COMM.Dup()
    hier = Comm(COMM, hierarchical='on')
    active = hier.hierarchical
    if COMM.rank == 0:
        layout = ', '.join(f'{r}:{n}' for r, n in enumerate(names))
        print(f'{COMM.size} ranks on {hier.nodes} hosts ({layout}); hierarchy active: '
              f'{active}; {MPI.Get_library_version().splitlines()[0]}', flush=True)
    if not active:
        common.rank0_print('the hierarchy does not apply here (one host, or one rank a '
                           'host): both columns measure flat MPI')
    stores = {}
    if not args.no_kv:
        for mode in ('off', 'on'):
            stores[mode] = create_store(args.design, mode)
    rows = []
    header = (f"{'size':>6} {'method':>12} {'median ms':>10} {'min ms':>8} {'vs flat':>8}")
    common.rank0_print(header)
    for index, nbytes in enumerate(args.sizes):
        with common.deadline(args.timeout, f'size {common.format_size(nbytes)}'):
            makers = {'mpi:flat': lambda: flat_op(flat, nbytes),
                      'mpi:hier': lambda: comm_op(hier, nbytes)}
            if active:
                makers['mpi:leaders'] = lambda: leaders_op(hier, nbytes)
            if stores:
                makers['kv:flat'] = lambda: kv_op(stores['off'], index, nbytes)
                makers['kv:hier'] = lambda: kv_op(stores['on'], index, nbytes)
            wanted = args.methods.split(',') if args.methods else list(makers)
            ops = {name: make() for name, make in makers.items() if name in wanted}
            times = interleaved(ops, args.warmups, args.trials)
        medians = {name: common.median(ts) for name, ts in times.items()}
        for name, ts in times.items():
            base = 'kv:flat' if name.startswith('kv:') else 'mpi:flat'
            ratio = medians[name] / medians[base] if base in medians else float('nan')
            rows.append({'size': nbytes, 'method': name, 'median_s': medians[name],
                         'min_s': min(ts), 'times_s': ts, 'vs_flat': ratio})
            common.rank0_print(f'{common.format_size(nbytes):>6} {name:>12} '
                               f'{medians[name] * 1e3:10.1f} {min(ts) * 1e3:8.1f} {ratio:8.3f}')
    common.rank0_print('\nratios hierarchical / flat (median of the slowest rank; < 1: '
                       'hierarchy faster)')
    common.rank0_print(f"{'size':>6} " + ' '.join(f'{a + "/" + b:>22}' for a, b in PAIRS))
    for nbytes in args.sizes:
        found = {r['method']: r['median_s'] for r in rows if r['size'] == nbytes}
        cells = [f'{found[a] / found[b]:22.3f}' if a in found and b in found else f'{"-":>22}'
                 for a, b in PAIRS]
        common.rank0_print(f'{common.format_size(nbytes):>6} ' + ' '.join(cells))
    for kv in stores.values():
        kv.close()
    hier.free()
    flat.Free()
    name = 'hierarchical_n%d%s.json' % (COMM.size, '_' + args.label if args.label else '')
    config = dict(vars(args), sizes=[common.format_size(n) for n in args.sizes],
                  hosts=names, nodes=hier.nodes, hierarchy_active=active)
    common.write_json(os.path.join(args.out, name), {'benchmark': 'hierarchical',
                                                     'results': rows}, config)
    if COMM.rank == 0:
        print('wrote', os.path.join(args.out, name), flush=True)


if __name__ == '__main__':
    sys.exit(common.run_main(main))
