"""Compression-assisted ring against compress-once: time and error, in one run.

    mpiexec -n N python benchmarks/compressed_ring.py [--mb 16] [--trials 7]
    python -m testbed run --hosts 2 --rate 1gbit -n 4 -- python benchmarks/compressed_ring.py

For one float32 buffer of --mb MB of rank-seeded normal values, each codec exchanges it
(compression.WireCast: fp16 and bf16 compressed once, fp16-ring and bf16-ring with every hop
compressed), beside raw MPI_Allreduce: median time of interleaved rounds (the slowest
rank's), and the error against the exact sum (a float64 MPI_Allreduce of the same values):
max and mean |error| over the values, and max |error| / sum |x_i|, whose bound is 2u for
compress-once and N u for the ring (u: 2^-11 fp16, 2^-8 bf16). Rank 0 prints the table.
"""
import argparse
import os
import sys

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mpi_kvstore import compression  # noqa: E402
from mpi_kvstore.comm import Comm  # noqa: E402
from mpi_kvstore.tune import _interleaved, _Plain  # noqa: E402

UNIT = {'fp16': 2.0 ** -11, 'bf16': 2.0 ** -8}


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
        runs[kind] = lambda codec=codec: codec.exchange([_Plain(buf)], comm)
    times = _interleaved(comm, runs, args.trials)
    rows = []
    for kind, codec in codecs.items():
        out = values.copy()
        failed = codec.exchange([_Plain(out)], comm)
        assert not failed, failed
        error = np.abs(out.astype(np.float64) - exact)
        share = float((error / np.maximum(magnitude, 1e-30)).max())
        bound = (n if kind.endswith('ring') else 2) * UNIT[kind[:4]]
        rows.append((kind, times[kind], float(error.max()), float(error.mean()), share, bound))
    if comm.rank == 0:
        print('%g MB float32, %d ranks, %d trials' % (args.mb, n, args.trials))
        print('| codec | ms | x compress-once time | x raw MPI time | max abs error | '
              'mean abs error | max error / sum of abs | its bound |')
        print('|---|---|---|---|---|---|---|---|')
        raw = times['raw MPI_Allreduce']
        print('| raw MPI_Allreduce | %.1f | - | 1.00 | 0 | 0 | 0 | - |' % (raw * 1e3))
        for kind, t, emax, emean, share, bound in rows:
            once = times[kind.split('-')[0]]
            print('| %s | %.1f | %.2f | %.2f | %.3g | %.3g | %.3g | %.3g |'
                  % (kind, t * 1e3, t / once, t / raw, emax, emean, share, bound))
        assert all(share <= bound * 1.01 for *_, share, bound in rows), 'an error over its bound'
    comm.free()


if __name__ == '__main__':
    main()
