"""A grouped hvd.allreduce_ repeated on one rank (again_group: one engine op for the list)
while another takes the full path: the full path of a group of dense tensors of distinct
storage is one engine op too (store/collectives.py, allreduce's one_op), so the ranks stay
paired. Before, the full path pushed one op a tensor, the chained design's agreement found
'rank 0 issued 2, rank 1 issued 1', and the ranks' sequence numbers parted: the next
collective waited for a partner that never came (60 s, then the stall inspector).

usage: hvd_group_paths.py DESIGN

- paths: a group called twice on every rank (the second a repeat), then rank 1 replaces
  one of its tensors by a new array of the same shape (a valid program: its full path)
  while rank 0 repeats; then both repeat. Every sum as numpy's, on every step.
- factors: a group called with postscale 2.0 on rank 0 and 3.0 on rank 1 fails on every
  rank (RankMismatchError), then the group sums right with 2.0 on both, twice.
"""
import mxnet as mx
import numpy as np

import mpi_kvstore
import mpi_kvstore.horovod as hvd
from mpi_kvstore import debug

from common import RANK, SIZE, close, design_arg, done, expect_raises

DESIGN = design_arg()
FACTOR = SIZE * (SIZE + 1) // 2      # sum over ranks of (rank + 1)
SHAPES = [(16,), (5,), (2, 3)]

hvd.init(design=DESIGN, autotune='0')
store = hvd.global_process_set._store


def values(shape, step):
    return (np.arange(int(np.prod(shape))).reshape(shape) % 5 + step) * (RANK + 1)


def check(xs, step, what, scale=1.0):
    for i, x in enumerate(xs):
        want = (np.arange(int(np.prod(x.shape))).reshape(x.shape) % 5 + step) * FACTOR
        close(x.asnumpy(), want * scale, '%s, tensor %d, step %d' % (what, i, step))


def call(xs, step, name, **kwargs):
    for x in xs:
        x[:] = values(x.shape, step)
    before = debug.snapshot()
    hvd.grouped_allreduce_(xs, name=name, op=hvd.Sum, **kwargs)
    store.wait()
    return debug.since(before, 'again')


def paths():
    xs = [mx.nd.zeros(shape) for shape in SHAPES]
    seen = [call(xs, step, 'g') for step in range(2)]
    check(xs, 1, 'paths warm-up')
    if RANK == 1:   # a new array in the list: this rank's call takes the full path
        xs[1] = mx.nd.zeros(SHAPES[1])
    seen.append(call(xs, 2, 'g'))
    check(xs, 2, 'paths, rank 1 on the full path')
    for step in (3, 4):
        seen.append(call(xs, step, 'g'))
        check(xs, step, 'paths after')
    return seen


def factors():
    xs = [mx.nd.zeros(shape) for shape in SHAPES]
    for step in range(2):
        call(xs, step, 'f', postscale_factor=2.0)
        check(xs, step, 'factors warm-up', 2.0)
    err = expect_raises(mpi_kvstore.RankMismatchError,
                        lambda: call(xs, 2, 'f', postscale_factor=2.0 + RANK))
    for step in (3, 4):
        call(xs, step, 'f', postscale_factor=2.0)
        check(xs, step, 'factors after', 2.0)
    return str(err)


seen = paths()
said = factors()
done('hvd_group_paths[%s]' % DESIGN, paths=seen, said=said)
hvd.shutdown()
