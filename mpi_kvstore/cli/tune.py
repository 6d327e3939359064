"""``python -m mpi_kvstore tune``: choose each collective's algorithm per message size,
measured on the job itself (MCR-DL: backends mixed by message size).

    mpiexec -n N python -m mpi_kvstore tune [--sizes 4K,64K,1M,16M,64M] [--trials 7]
        [--out mpi_kvstore_tune.json]

Per size, on host float32 buffers, every algorithm this job can run:
  mpi           MPI_Allreduce in place (what the store does without a table);
  rsag          MPI_Reduce_scatter then MPI_Allgatherv, in place;
  hierarchical  the hierarchy of comm.Comm (only where ranks span hosts and some host runs
                more than one);
and, reported but never chosen (they change the numbers), the fp16 and bf16 wire casts of
compression/ (compressed once and as a ring). Where every rank has a GPU, each GPU
transport every rank can use (transports/) is timed on CuPy buffers too (tune_device.py:
``device_ms``), and the table's ``device`` rows keep, per size, the one gpu_transport=auto
would take unless another is faster by the margin.
Then, on host buffers of the same sizes, each other collective (tuning.OPS) across its
algorithms: broadcast flat (one MPI_Bcast), pipelined and chain in chunks of 256 KB, 1 MB
and 4 MB (those smaller than the buffer), and through the hosts (whole, and in those
chunks) where the hierarchy applies; allgather and reduce-scatter by MPI, and through the
hosts where every host runs as many ranks; alltoall by MPI. Each size keeps MPI's own
(flat) unless another is faster by the margin; these become the table's ``ops`` rows. Where
every rank has a GPU, each other collective runs through each GPU transport on CuPy buffers
too (``device_ops_ms``), and the table's ``device_ops`` rows keep each size's transport by
the same rule as allreduce's.
The table keeps the fastest lossless algorithm per size; a second pass times the table's
dispatch against every single algorithm (and every single GPU transport), in the same
run, and prints how far from the best each size is (``--no-check`` skips it; the table is
written before it).

The store loads the table with the option ``tune_table`` (tuning.py, docs/tuning.md).
"""
import argparse
import json
import math
import sys
import time

import numpy as np

from .. import compression
from ..comm import broadcast
from ..comm.fusion import pieces
from ..comm.host import Comm
from ..comm.mpiabi import MPI
from ..comm.tuning import LOSSLESS, LOSSY, OPS, Table
from ..config import format_bytes, parse_bytes
from ..launch.console import HelpFormatter, console, to_stdout
from . import tune_device
from .tune_device import pick  # one rule, one margin, for host and device picks

__all__ = ['main']


def _sizes(text):
    """--sizes' type: '4K,64K,1M' -> [4096, 65536, 1048576], sorted and each once (a
    table's device_ops rows must increase)."""
    try:
        sizes = [parse_bytes(part) for part in text.split(',') if part.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(s < 4 for s in sizes):
        raise argparse.ArgumentTypeError('%r: sizes of at least 4 bytes, like 4K,1M,64M' % text)
    return sorted(set(sizes))


def _positive(text):
    """--trials' type: an int of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError('%r: a whole number of at least 1' % text)
    return value


def _interleaved(comm, fns, trials, spread=None):
    """{name: median over trials of the slowest rank's seconds}; each round runs every fn
    once, starting at a different one, so drifting load slows them alike. ``spread``, a
    dict, gets {name: (min, max)} of the same seconds."""
    names = list(fns)
    for name in names:
        fns[name]()                                      # warm
    times = {name: [] for name in names}
    for r in range(trials):
        for name in names[r % len(names):] + names[:r % len(names)]:
            comm.mpi.Barrier()
            start = time.perf_counter()
            fns[name]()
            times[name].append(comm.mpi.allreduce(time.perf_counter() - start, op=MPI.MAX))
    if spread is not None:
        spread.update({name: (min(t), max(t)) for name, t in times.items()})
    return {name: float(np.median(t)) for name, t in times.items()}


def _runners(comm, hier, buf):
    runners = {'mpi': lambda: comm.allreduce_with(buf, 'mpi'),
               'rsag': lambda: comm.allreduce_with(buf, 'rsag')}
    if hier is not None and hier.hierarchical:
        runners['hierarchical'] = lambda: hier.allreduce_with(buf, 'hierarchical')
    for kind in LOSSY:
        try:
            codec = compression.wire_cast(kind)
        except ImportError:
            continue
        runners[kind] = lambda codec=codec: codec.exchange([_Plain(buf)], comm)
    return runners


# Below this size every algorithm is timed SMALL_TRIALS times as often.
SMALL_BYTES, SMALL_TRIALS = 256 << 10, 8
# Another algorithm replaces MPI_Allreduce only where it is this much faster (tune_device.MARGIN):
# closer than that, a pick is noise (docs/tuning.md).


def _pick(times):
    """The lossless algorithm for one size: 'mpi' unless another beats it by the margin."""
    return pick({name: t for name, t in times.items() if name in LOSSLESS}, 'mpi')


# Chunk sizes that broadcast's chunked algorithms are timed with (below the buffer's size).
CHUNKS = (256 << 10, 1 << 20, 4 << 20)


def _broadcasts(comm, hier, buf):
    """{candidate: run} of broadcast of ``buf`` from rank 0: 'flat', and 'algorithm/chunk'
    for the chunked ones (their table rows carry the chunk)."""
    mpi = comm.mpi
    runs = {'flat': lambda: broadcast.flat(mpi, buf, 0)}
    chunks = [c for c in CHUNKS if c < buf.nbytes]
    for chunk in chunks:
        runs['pipelined/%d' % chunk] = lambda c=chunk: broadcast.pipelined(mpi, buf, 0, c)
        runs['chain/%d' % chunk] = lambda c=chunk: broadcast.chain(mpi, buf, 0, c)
    if hier.hierarchy.active:
        through = broadcast.Hierarchical(hier.mpi, hier.hierarchy.node, hier.hierarchy.cross)
        for chunk in [None, *chunks]:
            runs['hierarchical' if chunk is None else 'hierarchical/%d' % chunk] = (
                lambda c=chunk: through(buf, 0, c))
    return runs


def _op_runners(op, comm, hier, nbytes):
    """{candidate: run} of ``op`` (tuning.OPS) on host float32 buffers of ``nbytes``."""
    count = max(nbytes // 4, comm.size)
    buf = np.zeros(count, np.float32)
    if op == 'broadcast':
        return _broadcasts(comm, hier, buf)
    counts, displs = pieces(count, comm.size)
    grid = hier.hierarchy.grid
    if op == 'allgather':
        runs = {'mpi': lambda: comm.allgather_flat(buf, counts, displs)}
        if grid is not None:
            runs['hierarchical'] = lambda: grid.allgather(buf, counts, displs)
        return runs
    if op == 'reducescatter':
        piece = np.zeros(counts[comm.rank], np.float32)
        runs = {'mpi': lambda: comm.reduce_scatter_flat(buf, piece, counts)}
        if grid is not None:
            runs['hierarchical'] = lambda: grid.reduce_scatter(buf, piece, counts)
        return runs
    buf = np.zeros(count - count % comm.size, np.float32)   # alltoall: whole chunks
    recv = np.empty_like(buf)
    return {'mpi': lambda: comm.alltoall(buf, recv)}


def _pick_op(op, times):
    """The candidate for one size of ``op``: MPI's own unless another beats it by the margin."""
    return pick(times, OPS[op][0])


def _ops_rows(comm, hier, sizes, trials, say):
    """Each other collective timed per size. -> ({op: rows for Table}, {op: {size: ms}})"""
    rows, measured = {}, {}
    for op in OPS:
        rows[op], measured[op] = [], {}
        for nbytes in sizes:
            scale = SMALL_TRIALS if nbytes <= SMALL_BYTES else 1
            spread = {}
            times = _interleaved(comm, _op_runners(op, comm, hier, nbytes), trials * scale,
                                 spread)
            best = _pick_op(op, times)
            algorithm, _, chunk = best.partition('/')
            rows[op].append((nbytes, algorithm, int(chunk) if chunk else None))
            measured[op][str(nbytes)] = {name: t * 1e3 for name, t in times.items()}
            say('%-13s %10d B  ' % (op, nbytes) + '  '.join(
                '%s %.3f ms (%.3f-%.3f)%s' % (n, t * 1e3, spread[n][0] * 1e3,
                                              spread[n][1] * 1e3, ' *' if n == best else '')
                for n, t in times.items()))
    return rows, measured


class _Plain:
    """The least of a request that a codec exchanges."""

    def __init__(self, buf):
        self.buf, self.nbytes, self.dtype, self.mirror, self.key = buf, buf.nbytes, buf.dtype, False, 'tune'

    def buffer(self):
        return self.buf


def _parser():
    parser = argparse.ArgumentParser(prog='python -m mpi_kvstore tune', description=__doc__,
                                     formatter_class=HelpFormatter)
    parser.add_argument('--sizes', type=_sizes, default='4K,64K,256K,1M,4M,16M,64M',
                        help='message sizes to time, in bytes, comma-separated, with K, M or G '
                             'suffixes')
    parser.add_argument('--trials', type=_positive, default=7,
                        help='timed rounds a size (sizes up to %s run %d times as many; the '
                             'check of the table runs 6 times as many)'
                             % (format_bytes(SMALL_BYTES), SMALL_TRIALS))
    parser.add_argument('--out', default='mpi_kvstore_tune.json',
                        help='the JSON table rank 0 writes, for the tune_table option '
                             '(MPI_KVSTORE_TUNE_TABLE)')
    parser.add_argument('--no-check', dest='check', action='store_false',
                        help="skip the second pass that times the table's dispatch against "
                             'each single algorithm (it takes as long as the first, or '
                             'longer, at the largest sizes)')
    return parser


def main(argv=None):
    """-> exit status: 0, or 1 where a timing came out unusable (not finite)."""
    args = _parser().parse_args(argv)
    world = MPI.COMM_WORLD
    sizes = args.sizes
    comm = Comm(world, 'off')
    hier = Comm(world, 'on')
    say = console.info if world.Get_rank() == 0 else (lambda *a, **k: None)
    say('tuning allreduce, then %s, on %d ranks (%d host(s)), %d trials a size'
        % (', '.join(OPS), world.Get_size(), hier.hierarchy.nodes, args.trials))
    measured, chosen = {}, []
    for nbytes in sizes:
        buf = np.zeros(max(nbytes // 4, 1), np.float32)
        # Small sizes take microseconds, and their medians need many rounds to settle.
        trials = args.trials * (SMALL_TRIALS if nbytes <= SMALL_BYTES else 1)
        spread = {}
        times = _interleaved(comm, _runners(comm, hier, buf), trials, spread)
        best = _pick(times)
        chosen.append(best)
        measured[str(nbytes)] = {name: t * 1e3 for name, t in times.items()}
        say('%10d B  ' % nbytes + '  '.join(
            '%s %.3f ms (%.3f-%.3f)%s' % (n, t * 1e3, spread[n][0] * 1e3, spread[n][1] * 1e3,
                                          ' *' if n == best else '')
            for n, t in times.items()))
    made, device_ms, device_rows, device_ops, device_ops_ms = {}, {}, None, None, {}
    if tune_device.present():
        made, default = tune_device.built(comm, say)
        timing = (sizes, args.trials, _interleaved, say)
        device_rows, device_ms = tune_device.allreduce_rows(comm, made, default, *timing)
        device_ops, device_ops_ms = tune_device.ops_rows(comm, made, default, *timing)
    ops, ops_ms = _ops_rows(comm, hier, sizes, args.trials, say)
    table = Table(sizes, chosen, world.Get_size(), device_rows, ops=ops, device_ops=device_ops)
    # Written before the check, which only reports: a run stopped during the check (at
    # 256 MB across 8 ranks it can take a quarter of an hour) still leaves its table.
    if world.Get_rank() == 0:
        with open(args.out, 'w') as fh:
            json.dump(dict(table.to_json(measured), device_ms=device_ms, ops_ms=ops_ms,
                           device_ops_ms=device_ops_ms), fh, indent=1)
        say('table written to %s: use it with tune_table=%s (MPI_KVSTORE_TUNE_TABLE)'
            % (args.out, args.out))
    worst = _check(args, world, comm, hier, table, made, sizes, say) if args.check else 0.0
    for transport in made.values():
        transport.free()
    for c in (comm, hier):
        c.free()
    return 0 if math.isfinite(worst) else 1


def _check(args, world, comm, hier, table, made, sizes, say):
    """The table's dispatch against each single algorithm (and GPU transport), timed again
    in this run, in pairs -> the worst ratio."""
    tuned = Comm(world, 'on' if table.needs_hierarchy else 'off', table=table)
    say('check: the table against the best single lossless algorithm, each timed again in '
        'pairs with the table')
    worst = 0.0
    for nbytes in sizes:
        buf = np.zeros(max(nbytes // 4, 1), np.float32)
        table_run = lambda buf=buf: tuned.allreduce(buf)   # noqa: E731
        trials = 6 * args.trials * (SMALL_TRIALS if nbytes <= SMALL_BYTES else 1)
        lossless = {name: run for name, run in _runners(comm, hier, buf).items()
                    if name in LOSSLESS}
        best, table_s, best_s = tune_device.against_each(comm, _interleaved, table_run,
                                                         lossless, trials)
        worst = max(worst, table_s / best_s)
        say('%10d B  table (%s) %.3f ms, best single (%s) %.3f ms: %.2fx'
            % (nbytes, table.choose(buf.nbytes), table_s * 1e3, best, best_s * 1e3,
               table_s / best_s))
    if world.Get_size() == 1:
        # The table's dispatch returns at once at one rank, while each single algorithm still
        # runs its copies: the ratios above time those copies, not a choice.
        say('one rank: nothing to exchange, so the ratios above compare the single algorithms\' '
            'copies with a call that returns at once; run tune across ranks to check the table')
    else:
        say('slowest size against its best single algorithm: %.2fx (target <= 1.05x)' % worst)
    if made:
        worst_device = tune_device.check(comm, tuned, made, sizes, 3 * args.trials,
                                         _interleaved, say)
        say('slowest size against its best single GPU transport: %.2fx (target <= 1.05x)'
            % worst_device)
        worst = max(worst, worst_device)
    tuned.free()
    return worst


if __name__ == '__main__':
    to_stdout()
    sys.exit(main())
