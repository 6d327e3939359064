"""Flat against pipelined against hierarchical broadcast of host buffers (issue 33, seed 004).

    mpiexec -n 4 python -m benchmarks.broadcast [--sizes 4K,...,256M] [--warmups W]
        [--trials T] [--chunks 256K,1M,4M] [--window 4] [--root R] [--ranks-per-host L]
        [--methods flat,pipelined:1M,...] [--label LABEL] [--out DIR] [--quick]
    python -m testbed run --hosts 2 --rate 10gbit -n 4 --ppn 2 --timeout 600 -- \\
        python -m benchmarks.broadcast --label testbed_2x2

Measured in one run, interleaved (every trial runs each method once, in an order that
rotates from trial to trial), uint8 buffers from --root, in place, on a Dup of COMM_WORLD:
  flat              comm.Bcast(buf): the library's own algorithm (what the store does);
  pipelined:C       comm.broadcast.pipelined: chunks of C bytes, --window Ibcasts in flight;
  chain:C           comm.broadcast.chain: chunks of C passed along the ring from the root;
  hier, hier:C      comm.broadcast.Hierarchical over hierarchy.py's node and cross
                    communicators, whole or in chunks of C, each step a chain;
  hier-ibcast:C     the same, each step --window Ibcasts. On one host the hierarchy does
                    not apply and hier is flat through this code, unless --ranks-per-host L
                    splits COMM_WORLD into "hosts" of L ranks (a stand-in: every link is
                    still this machine's shared memory).
Each method's result is checked once against the root's bytes before timing. Per size and
method: the median, min and max over trials of the slowest rank's time, and the ratio to
flat from this run (below 1: faster than flat). Rank 0 prints the table and writes
<out>/broadcast_n<N>[_<label>].json.
"""
import argparse
import functools
import sys

import numpy as np
from mpi4py import MPI

from benchmarks import harness, report
from mpi_kvstore.comm import broadcast
from mpi_kvstore.comm.broadcast import Hierarchical

COMM = MPI.COMM_WORLD
FULL = {'warmups': 2, 'trials': 10}
DEFAULT_CHUNKS = '256K,1M,4M'


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    harness.add_common_args(parser, full=FULL, timeout=300)   # --timeout: one size, every method
    parser.add_argument('--chunks', type=harness.parse_sizes, default=DEFAULT_CHUNKS,
                        help='chunk sizes of pipelined, chain and hier (default %s)' % DEFAULT_CHUNKS)
    parser.add_argument('--window', type=int, default=broadcast.DEFAULT_WINDOW,
                        help='requests in flight (default %d)' % broadcast.DEFAULT_WINDOW)
    parser.add_argument('--root', type=int, default=0, help='the broadcasting rank (default 0)')
    parser.add_argument('--ranks-per-host', type=int, default=None,
                        help='split COMM_WORLD into "hosts" of this many ranks, in blocks')
    parser.add_argument('--methods', default=None, help='comma-separated subset (default: all)')
    parser.add_argument('--label', default='', help='added to the JSON name')
    args = harness.resolve_quick(parser.parse_args(argv), FULL)
    if isinstance(args.chunks, str):
        args.chunks = harness.parse_sizes(args.chunks)
    if not 0 <= args.root < COMM.size:
        parser.error('--root %d: not a rank of %d' % (args.root, COMM.size))
    return args


def hierarchy_of(comm, ranks_per_host):
    """(Hierarchical, what it stands on, hierarchy.Hierarchy or None to free)."""
    if ranks_per_host:
        host = comm.rank // ranks_per_host
        node = comm.Split(host, key=comm.rank)
        cross = comm.Split(node.rank, key=comm.rank)
        return Hierarchical(comm, node, cross), 'hosts of %d split from COMM_WORLD' % (
            ranks_per_host), None
    hier, hierarchy = Hierarchical.build(comm)
    return hier, '%d real host(s), hierarchy %s' % (
        hierarchy.nodes, 'active' if hier.active else 'inactive: hier is flat'), hierarchy


def methods(comm, hier, args):
    """{name: fn(buf)} of every method (see the module)."""
    root, window = args.root, args.window
    found = {'flat': functools.partial(broadcast.flat, comm, root=root),
             'hier': functools.partial(hier, root=root)}
    for chunk in args.chunks:
        tag = harness.format_size(chunk)
        found['pipelined:' + tag] = functools.partial(broadcast.pipelined, comm, root=root,
                                                      chunk_bytes=chunk, window=window)
        found['chain:' + tag] = functools.partial(broadcast.chain, comm, root=root,
                                                  chunk_bytes=chunk, window=window)
        found['hier:' + tag] = functools.partial(hier, root=root, chunk_bytes=chunk, window=window)
        found['hier-ibcast:' + tag] = functools.partial(hier, root=root, chunk_bytes=chunk,
                                                        window=window, how='ibcast')
    if args.methods:
        wanted = harness.names(args.methods)
        unknown = [name for name in wanted if name not in found]
        if unknown:
            raise SystemExit('unknown method(s) %s; known: %s' % (unknown, ', '.join(found)))
        found = {name: found[name] for name in wanted}
    return found


def checked_op(fn, buf, want, name, comm):
    """fn(buf) as an op, after one run from scratch that must give the root's bytes."""
    if comm.rank != want[1]:
        buf[:] = 0
    fn(buf)
    bad = harness.agree(None if np.array_equal(buf, want[0]) else
                        'rank %d: %s delivered wrong bytes' % (comm.rank, name), comm)
    if bad:
        raise RuntimeError(bad)
    return functools.partial(fn, buf)


def measure_size(comm, fns, nbytes, args):
    """{name: [seconds per trial]} of every method at nbytes."""
    pattern = (np.arange(nbytes, dtype=np.uint64) % 251 + 1).astype(np.uint8)   # never 0
    buf = pattern.copy()
    ops = {name: checked_op(fn, buf, (pattern, args.root), name, comm) for name, fn in fns.items()}
    del pattern
    return harness.interleaved(ops, args.trials, args.warmups, comm=comm)


def rows_of(nbytes, times):
    flat = harness.median(times['flat']) if 'flat' in times else None
    rows = []
    for name, ts in times.items():
        stats = harness.spread(ts)
        rows.append({'size': nbytes, 'method': name, 'median_s': stats['median'],
                     'min_s': stats['min'], 'max_s': stats['max'], 'times_s': ts,
                     'algbw_GBps': harness.algbw(nbytes, stats['median']),
                     'vs_flat': stats['median'] / flat if flat else None})
    return rows


def print_table(rows):
    harness.rank0_print(report.text(
        ['size', 'method', 'median ms', 'min ms', 'max ms', 'GB/s', 'vs flat'],
        [[harness.format_size(r['size']), r['method'], '%.3f' % (r['median_s'] * 1e3),
          '%.3f' % (r['min_s'] * 1e3), '%.3f' % (r['max_s'] * 1e3), '%.2f' % r['algbw_GBps'],
          report.cell(r['vs_flat'], '.3f')] for r in rows], align=['right'] * 7))
    harness.rank0_print('\nfastest per size (median of the slowest rank):')
    for nbytes in dict.fromkeys(r['size'] for r in rows):
        best = min((r for r in rows if r['size'] == nbytes), key=lambda r: r['median_s'])
        harness.rank0_print('  %8s  %-16s %s x flat' % (harness.format_size(nbytes),
                                                       best['method'],
                                                       report.cell(best['vs_flat'], '.3f')))


def main():
    args = parse_args()
    comm = COMM.Dup()
    hier, layout, hierarchy = hierarchy_of(comm, args.ranks_per_host)
    harness.rank0_print('%d ranks, root %d, %s; %s' % (
        comm.size, args.root, layout, MPI.Get_library_version().splitlines()[0]))
    fns = methods(comm, hier, args)
    run = harness.Run('broadcast', args, label=args.label)
    rows = []
    for nbytes in args.sizes:
        with harness.deadline(args.timeout, 'size %s' % harness.format_size(nbytes)):
            rows += rows_of(nbytes, measure_size(comm, fns, nbytes, args))
        run.write({'results': rows}, layout=layout, hierarchy_active=hier.active,
                  topology=harness.topology(comm, args.label))
    print_table(rows)
    if hierarchy is not None:
        hierarchy.free()
    harness.rank0_print('wrote', run.json_path)


if __name__ == '__main__':
    sys.exit(harness.run_main(main))
