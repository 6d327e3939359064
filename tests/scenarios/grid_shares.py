"""hierarchy.Grid on one box: the sharded optimizer's reduce-scatter and allgather through
"hosts" made by splitting COMM_WORLD (ranks in blocks, and interleaved, so that the grid's
table of places is what routes the shares), against numpy. Shares of uneven sizes,
zeros included, in float32, float64 and int32.

usage: grid_shares.py LOCAL   (LOCAL ranks a host; the job's size a multiple of it)
"""
import sys

# No MXNet: nothing here needs it (the MXNet-free contract), and each rank starts about
# 3 s of CPU sooner.
sys.modules.setdefault('mxnet', None)

import numpy as np  # noqa: E402

from mpi_kvstore.comm.hierarchy import Grid  # noqa: E402

from common import RANK, SIZE, WORLD, close, done  # noqa: E402

LOCAL = int(sys.argv[1])
HOSTS = SIZE // LOCAL
assert HOSTS * LOCAL == SIZE and HOSTS > 1 and LOCAL > 1, (SIZE, LOCAL)


def values(rank, n, dtype):
    return ((np.arange(n) * 7 + rank * 1000 + 3) % 97 - 40).astype(dtype)


def check(grid, layout):
    rng = np.random.RandomState(11)
    for dtype in ('float32', 'float64', 'int32'):
        for trial in range(4):
            counts = list(rng.randint(0, 6 if trial < 2 else 400, size=SIZE))
            counts[trial % SIZE] = 0
            total = sum(counts)
            displs = [int(v) for v in np.concatenate([[0], np.cumsum(counts)[:-1]])]
            send = values(RANK, total, dtype)
            want = sum(values(r, total, dtype) for r in range(SIZE))
            recv = np.full(counts[RANK], -1, dtype)
            grid.reduce_scatter(send, recv, counts)
            mine = slice(displs[RANK], displs[RANK] + counts[RANK])
            close(recv, want[mine], '%s: reduce-scatter, %s, counts %s' % (layout, dtype, counts))
            # the allgather: this rank's share in place, at displacements with gaps
            gaps = [d + 3 * g for g, d in enumerate(displs)]
            buf = np.full(total + 3 * SIZE, -7, dtype)
            buf[gaps[RANK]:gaps[RANK] + counts[RANK]] = want[mine]
            grid.allgather(buf, counts, gaps)
            for g in range(SIZE):
                close(buf[gaps[g]:gaps[g] + counts[g]], want[displs[g]:displs[g] + counts[g]],
                      '%s: allgather, %s, rank %d share' % (layout, dtype, g))
                assert (buf[gaps[g] + counts[g]:gaps[g] + counts[g] + 3] == -7).all(), layout


for layout, host, local in (('blocks', RANK // LOCAL, RANK % LOCAL),
                            ('interleaved', RANK % HOSTS, RANK // HOSTS)):
    node = WORLD.Split(host, key=RANK)
    cross = WORLD.Split(local, key=RANK)
    check(Grid.of(WORLD, node, cross), layout)
    node.Free()
    cross.Free()
done('grid_shares[%d a host]' % LOCAL)
