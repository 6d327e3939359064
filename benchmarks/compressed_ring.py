"""Compression-assisted ring against compress-once: time and error, in one run.

    mpiexec -n N python -m benchmarks.compressed_ring [--mb 16] [--trials 7]
    python -m testbed run --hosts 2 --rate 1gbit -n 4 -- python -m benchmarks.compressed_ring

For one float32 buffer of --mb MB of rank-seeded normal values, each codec exchanges it
(compression.WireCast: fp16 and bf16 compressed once, fp16-ring and bf16-ring with every hop
compressed), beside raw MPI_Allreduce: median, min and max time of interleaved rounds (the
slowest rank's), and the error against the exact sum (a float64 MPI_Allreduce of the same values):
max and mean |error| over the values, and max |error| / sum |x_i|, whose bound is 2u for
compress-once and N u for the ring (u: 2^-11 fp16, 2^-8 bf16). Rank 0 prints the table.
"""
import argparse

import numpy as np
from mpi4py import MPI

from benchmarks import harness, report
from mpi_kvstore import compression
from mpi_kvstore.comm.host import Comm

UNIT = {'fp16': 2.0 ** -11, 'bf16': 2.0 ** -8}


class Plain:
    """The least of a request that a codec exchanges: one flat buffer, no mirror."""

    def __init__(self, buf):
        self.buf, self.nbytes, self.dtype, self.mirror, self.key = buf, buf.nbytes, buf.dtype, False, 'bench'

    def buffer(self):
        return self.buf


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--mb', type=float, default=16)
    parser.add_argument('--trials', type=int, default=7)
    args = parser.parse_args()
    comm = Comm(MPI.COMM_WORLD, 'off')
    n = comm.size
    count = int(args.mb * (1 << 20)) // 4
    values = np.random.default_rng(comm.rank).standard_normal(count).astype(np.float32)
    exact = values.astype(np.float64)
    comm.mpi.Allreduce(MPI.IN_PLACE, exact, op=MPI.SUM)
    magnitude = np.abs(values).astype(np.float64)
    comm.mpi.Allreduce(MPI.IN_PLACE, magnitude, op=MPI.SUM)
    kinds = ('fp16', 'fp16-ring', 'bf16', 'bf16-ring')
    codecs = {kind: compression.wire_cast(kind) for kind in kinds}
    buf = values.copy()
    runs = {'raw MPI_Allreduce': lambda: comm.allreduce_host(buf, 'mpi')}
    for kind, codec in codecs.items():
        runs[kind] = lambda codec=codec: codec.exchange([Plain(buf)], comm)
    # one untimed round to warm, then the slowest rank's interleaved rounds
    spreads = {name: harness.spread(t) for name, t in
               harness.interleaved(runs, args.trials, warmups=1, comm=comm.mpi).items()}
    times = {name: s['median'] for name, s in spreads.items()}
    rows = []
    for kind, codec in codecs.items():
        out = values.copy()
        failed = codec.exchange([Plain(out)], comm)
        assert not failed, failed
        error = np.abs(out.astype(np.float64) - exact)
        share = float((error / np.maximum(magnitude, 1e-30)).max())
        bound = (n if kind.endswith('ring') else 2) * UNIT[kind[:4]]
        rows.append((kind, times[kind], float(error.max()), float(error.mean()), share, bound))
    if comm.rank == 0:
        print(f'{args.mb:g} MB float32, {n} ranks, {args.trials} interleaved trials; ms: median, '
              'min, max; ratios of medians')
        def ms(name):
            return [f'{spreads[name][k] * 1e3:.1f}' for k in ('median', 'min', 'max')]
        raw = times['raw MPI_Allreduce']
        cells = [['raw MPI_Allreduce', *ms('raw MPI_Allreduce'), '-', '1.00', '0', '0', '0', '-']]
        for kind, t, emax, emean, share, bound in rows:
            once = times[kind.split('-')[0]]
            cells.append([kind, *ms(kind), f'{t / once:.2f}', f'{t / raw:.2f}', f'{emax:.3g}',
                          f'{emean:.3g}', f'{share:.3g}', f'{bound:.3g}'])
        print(report.markdown(['codec', 'ms', 'min ms', 'max ms', 'x compress-once time',
                               'x raw MPI time', 'max abs error', 'mean abs error',
                               'max error / sum of abs', 'its bound'], cells))
        assert all(share <= bound * 1.01 for *_, share, bound in rows), 'an error over its bound'
    comm.free()


if __name__ == '__main__':
    harness.run_main(main)
