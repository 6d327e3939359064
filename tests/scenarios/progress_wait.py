"""comm.progress.wait_polling, the compiled wait: sums right against numpy whether the
others are there already or come late (across several of its slices), the request
complete for mpi4py afterwards, and no Python run while it waits: a trace of the
waiting thread sees a bounded number of lines per slice where a loop in Python would
run one a wake-up (thousands in a late peer's half second).

usage: progress_wait.py
"""
import sys
import time

import numpy as np
from mpi4py import MPI

from mpi_kvstore.comm import progress

from common import RANK, SIZE, WORLD, done

LATE_S = 0.5            # how late the last rank comes to the traced collective
POLL_US = 200


def reference(n, dtype, seed):
    """What every rank's buffer sums to, from numpy: rank r holds rng(seed + r)."""
    return sum(np.random.default_rng(seed + r).standard_normal(n).astype(dtype)
               for r in range(SIZE))


def allreduce_polled(n, dtype, seed, late=0.0, tests=progress.PROGRESS_TESTS, watch=None):
    """-> (Python lines run inside the wait, its seconds) when ``watch`` (traced_lines)."""
    data = np.random.default_rng(seed + RANK).standard_normal(n).astype(dtype)
    if RANK == SIZE - 1 and late:
        time.sleep(late)
    request = WORLD.Iallreduce(MPI.IN_PLACE, data, op=MPI.SUM)
    wait = lambda: progress.wait_polling(request, POLL_US, tests)  # noqa: E731
    lines = traced_lines(wait) if watch else (wait(), 0.0)
    if request != MPI.REQUEST_NULL:
        raise AssertionError('rank %d: the request is still active for mpi4py after the wait'
                             % RANK)
    expected = reference(n, dtype, seed)
    if not np.allclose(data, expected, rtol=1e-5, atol=1e-5):
        raise AssertionError('rank %d: %d x %s: got %s, numpy says %s'
                             % (RANK, n, np.dtype(dtype), data[:4], expected[:4]))
    return lines


def traced_lines(fn):
    """(Python lines this thread runs inside ``fn()`` (sys.settrace sees each), seconds
    it took)."""
    count = [0]

    def trace(frame, event, arg):
        if event == 'line':
            count[0] += 1
        return trace
    start = time.monotonic()
    sys.settrace(trace)
    try:
        fn()
    finally:
        sys.settrace(None)
    return count[0], time.monotonic() - start


progress.prepare()
for seed, (n, dtype, late) in enumerate([(1, np.float64, 0), (1000, np.float32, 0),
                                         (1 << 20, np.float32, 0), (4096, np.float64, 0.25),
                                         (300_000, np.int64, 0.05)]):
    allreduce_polled(n, dtype, 10 * seed, late, tests=1 + seed % 3)
WORLD.Barrier()
lines, waited = allreduce_polled(64, np.float64, 99, LATE_S, watch=True)
# The wait runs ~6 lines a slice, and a slice sleeps 100 ms (longer in wall time when the
# machine is busy), so LINES_PER_SLICE per started slice of the wait as this rank timed it
# holds whatever the lateness a loaded machine adds; a wait in Python runs a few lines a
# wake-up, every POLL_US at most: thousands a second, 5 per slice's 100 ms at the least.
LINES_PER_SLICE = 10
bound = LINES_PER_SLICE * (int(waited / 0.1) + 2)
if RANK != SIZE - 1 and lines > bound:
    raise AssertionError('rank %d: %d Python lines ran while waiting %.2f s for a late rank '
                         '(bound %d)' % (RANK, lines, waited, bound))
# each rank's figures, for the test: every rank but the late one waited and was traced
done('progress_wait', lines=lines, waited_s=waited, bound=bound)
