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

With --params MODEL (vgg16: 32 float32 tensors, 528 MiB; resnet50: 267, 97.7 MiB, as
Gluon counts them, BatchNorm's 4 each; tiny: 4 small ones, for the smoke test), it times
instead mpi_kvstore.broadcast_parameters of Gluon parameters of that model's shapes,
interleaved, on two stores: 'before' without a tune table (every broadcast one MPI_Bcast)
and 'after' with --table (the tune table's broadcast rows choose, per tensor size); each
tensor is one collective.
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


def _resnet50():
    """ResNet-50 v1's parameter shapes, in Gluon's order (25.6 M floats)."""
    shapes = [(64, 3, 7, 7)] + [(64,)] * 4
    cin = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            bn = lambda c: [(c,)] * 4   # noqa: E731  (gamma, beta, running mean and var)
            shapes += [(width, cin, 1, 1)] + bn(width) + [(width, width, 3, 3)] + bn(width)
            shapes += [(width * 4, width, 1, 1)] + bn(width * 4)
            if b == 0:
                shapes += [(width * 4, cin, 1, 1)] + bn(width * 4)
            cin = width * 4
    return shapes + [(1000, 2048), (1000,)]


_VGG_CONV = [(64, 3), (64, 64), (128, 64), (128, 128), (256, 128), (256, 256), (256, 256),
             (512, 256), (512, 512), (512, 512), (512, 512), (512, 512), (512, 512)]
MODELS = {
    'vgg16': [s for o, i in _VGG_CONV for s in ((o, i, 3, 3), (o,))]
    + [(4096, 25088), (4096,), (4096, 4096), (4096,), (1000, 4096), (1000,)],
    'resnet50': _resnet50(),
    'tiny': [(3, 5), (7,), (1000, 33), (64, 64, 3, 3)],
}
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
    parser.add_argument('--params', choices=sorted(MODELS), default=None,
                        help="time broadcast_parameters of this model's shapes instead")
    parser.add_argument('--table', default=None,
                        help="with --params: the tune table of the 'after' store")
    args = harness.resolve_quick(parser.parse_args(argv), FULL)
    if isinstance(args.chunks, str):
        args.chunks = harness.parse_sizes(args.chunks)
    if not 0 <= args.root < COMM.size:
        parser.error('--root %d: not a rank of %d' % (args.root, COMM.size))
    if args.params and not args.table:
        parser.error('--params %s needs --table (the tune table of the after store)' % args.params)
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
    # 1..251 repeated (never 0), built in uint8: a uint64 ramp peaked at 16 bytes a byte,
    # 4 GB a rank at 256 MB, more than 8 ranks of this machine have
    pattern = np.resize(np.arange(1, 252, dtype=np.uint8), nbytes)
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


def params_main(args):
    """broadcast_parameters of args.params' shapes, before (no table) against after (the
    table), interleaved; rows as main's, 'size' the model's bytes."""
    import mxnet as mx
    from mxnet import gluon

    import mpi_kvstore
    stores = {'before': mpi_kvstore.create('dist_mpi'),
              'after': mpi_kvstore.create('dist_mpi', tune_table=args.table)}
    params = {}
    for i, shape in enumerate(MODELS[args.params]):
        # no gradient buffers: broadcast_parameters reads only the data, and VGG-16's
        # would add 528 MiB a rank
        param = params['p%03d' % i] = gluon.Parameter('p%03d' % i, shape=shape,
                                                      grad_req='null')
        param.initialize(mx.init.Constant(0), ctx=mx.cpu())
    nbytes = sum(4 * int(np.prod(p.shape)) for p in params.values())
    harness.rank0_print('%d ranks, root %d, %s: %d tensors, %s; after: %s' % (
        COMM.size, args.root, args.params, len(params), harness.format_size(nbytes), args.table))

    def fill(value):
        for p in params.values():
            p.set_data(mx.nd.full(p.shape, value))
        mx.nd.waitall()

    ops = {}
    for name, kv in stores.items():
        fill(COMM.rank + 1)      # the root's value must arrive everywhere
        mpi_kvstore.broadcast_parameters(params, root=args.root, store=kv)
        mx.nd.waitall()
        wrong = [k for k, p in params.items() if not (p.data().asnumpy() == args.root + 1).all()]
        bad = harness.agree('rank %d: %s: %s not the root\'s' % (COMM.rank, name, wrong[:3])
                            if wrong else None, COMM)
        if bad:
            raise RuntimeError(bad)
        ops[name] = functools.partial(
            lambda kv: (mpi_kvstore.broadcast_parameters(params, root=args.root, store=kv),
                        mx.nd.waitall()), kv)
    run = harness.Run('broadcast', args, label=args.label)
    with harness.deadline(args.timeout, args.params):
        times = harness.interleaved(ops, args.trials, args.warmups, comm=COMM)
    rows = rows_of(nbytes, {'flat': times['before'], 'after': times['after']})
    rows[0]['method'] = 'before'
    run.write({'results': rows}, model=args.params, tensors=len(params),
              topology=harness.topology(COMM, args.label))
    print_table(rows)
    for kv in stores.values():
        kv.close()
    harness.rank0_print('wrote', run.json_path)


def main():
    args = parse_args()
    if args.params:
        return params_main(args)
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
