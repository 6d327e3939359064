"""A commit to a full disk (tests/test_elastic_run.py): every rank hears of it, the previous
commit stays whole, nothing partial is left, and training goes on.

usage: elastic_full.py DIR [--simulate]

Commits of a 40 KB array into DIR (a small tmpfs). After commit 1, rank 0 fills DIR with a
file that leaves less room than a commit needs; commit 2 must fail on every rank with an
OSError, which each rank catches and prints; the ranks then allreduce (training goes on),
rank 0 removes the filler, and commit 3 succeeds. --simulate (where no tmpfs can be
mounted): rank 0's commit writes fail with ENOSPC while the filler exists instead.
"""
import argparse
import builtins
import errno
import os

import mxnet as mx
import numpy as np

from mpi_kvstore import elastic
from mpi_kvstore.elastic import disk

from common import RANK, WORLD

parser = argparse.ArgumentParser()
parser.add_argument('dir')
parser.add_argument('--simulate', action='store_true')
args = parser.parse_args()
FILLER = os.path.join(args.dir, 'filler')

if args.simulate:
    real_open = builtins.open

    def full_open(path, mode='r', *a, **k):
        if 'w' in mode and disk.TEMPORARY_PREFIX in str(path) and os.path.exists(FILLER):
            fh = real_open(path, mode, *a, **k)
            fh.close()
            raise OSError(errno.ENOSPC, 'No space left on device')
        return real_open(path, mode, *a, **k)
    builtins.open = full_open

values = {'w': mx.nd.array(np.arange(10000, dtype=np.float32))}
state = elastic.State(values, directory=args.dir, keep=1, step=0)
state.step = 1
state.commit()
if RANK == 0:
    free = os.statvfs(args.dir).f_bavail * os.statvfs(args.dir).f_frsize
    with open(FILLER, 'wb') as fh:
        fh.write(b'\0' * max(0, free - 8192) if not args.simulate else b'')
WORLD.Barrier()
values['w'][:] = -1
state.step = 2
try:
    state.commit()
    print('rank %d: commit 2 succeeded' % RANK, flush=True)
except OSError as err:
    print('rank %d: commit 2 failed: %s' % (RANK, err), flush=True)
total = WORLD.allreduce(float(values['w'].asnumpy().sum()))   # training goes on
if RANK == 0:
    print('left after the failure: %s' % sorted(os.listdir(args.dir)), flush=True)
    found = disk.read_commit(os.path.join(args.dir, 'commit-00000001'))
    print('commit 1 whole: %s' % bool(np.array_equal(found['params'][0][1],
                                                     np.arange(10000, dtype=np.float32))),
          flush=True)
    os.unlink(FILLER)
WORLD.Barrier()
state.step = 3
print('rank %d: commit %d, allreduce %g' % (RANK, state.commit(), total), flush=True)
if RANK == 0:
    print('left at the end: %s' % sorted(os.listdir(args.dir)), flush=True)
