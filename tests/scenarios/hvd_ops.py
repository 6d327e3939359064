"""mpi_kvstore.horovod's collectives against numpy: every op and scale factor, keyword and
positional forms, process sets, and bad input raising on the ranks that give it."""
import json
import os
import sys
import warnings

import mxnet as mx
import numpy as np
from mpi4py import MPI

import mpi_kvstore.horovod as hvd

from common import RANK, SIZE, close, done, expect_raises, same_on_all_ranks


def data(rank, shape=(5, 3), dtype='float32'):
    """Rank-dependent values, positive (Product stays finite) and all different."""
    x = np.arange(np.prod(shape), dtype=np.float64).reshape(shape)
    return (1.0 + 0.1 * rank + 0.01 * x).astype(dtype)


ALL = [data(r) for r in range(SIZE)]
REDUCE = {hvd.Sum: lambda a: np.sum(a, axis=0), hvd.Average: lambda a: np.mean(a, axis=0),
          hvd.Min: lambda a: np.min(a, axis=0), hvd.Max: lambda a: np.max(a, axis=0),
          hvd.Product: lambda a: np.prod(a, axis=0)}

hvd.init(process_sets='dynamic')
assert hvd.is_initialized() and hvd.rank() == RANK and hvd.size() == SIZE
assert 0 <= hvd.local_rank() < hvd.local_size() and 0 <= hvd.cross_rank() < hvd.cross_size()
assert hvd.local_size() * hvd.cross_size() == SIZE
assert hvd.mpi_built() and hvd.mpi_enabled() and not hvd.gloo_built() and not hvd.gloo_enabled()
assert hvd.nccl_built() == 0 and not hvd.ddl_built() and not hvd.ccl_built()
assert not hvd.cuda_built() and not hvd.rocm_built()
assert isinstance(hvd.mpi_threads_supported(), bool)

# Horovod's environment: the fusion threshold and a dynamic timeline are honoured
TRACE = sys.argv[1] if len(sys.argv) > 1 else None
if 'HOROVOD_FUSION_THRESHOLD' in os.environ:
    assert hvd.store().config.fusion_threshold == int(os.environ['HOROVOD_FUSION_THRESHOLD'])
if TRACE:
    hvd.start_timeline(TRACE)
else:
    expect_raises(ValueError, hvd.start_timeline, 'x.json', contains='HOROVOD_TIMELINE=DYNAMIC')

# allreduce / allreduce_: every op, with and without scale factors
stacked = np.stack(ALL).astype(np.float64)
for op, reduce in REDUCE.items():
    for pre, post in ((1.0, 1.0), (0.5, 3.0), (2.0, 0.25)):
        want = post * reduce(pre * stacked)
        x = mx.nd.array(ALL[RANK])
        got = hvd.allreduce(x, op=op, prescale_factor=pre, postscale_factor=post,
                            name='ar.%d' % op)
        close(got.asnumpy(), want, 'allreduce op=%d pre=%g post=%g' % (op, pre, post), rtol=1e-5)
        close(x.asnumpy(), ALL[RANK], 'allreduce left its input')
        same_on_all_ranks(got.asnumpy(), 'allreduce op=%d' % op)
        y = mx.nd.array(ALL[RANK])
        assert hvd.allreduce_(y, op=op, prescale_factor=pre, postscale_factor=post) is y
        close(y.asnumpy(), want, 'allreduce_ op=%d pre=%g post=%g' % (op, pre, post), rtol=1e-5)

# the default is Average; average= is Horovod's deprecated form; positional as documented
close(hvd.allreduce(mx.nd.array(ALL[RANK])).asnumpy(), stacked.mean(0), 'default average')
with warnings.catch_warnings():
    warnings.simplefilter('ignore', DeprecationWarning)
    close(hvd.allreduce(mx.nd.array(ALL[RANK]), False).asnumpy(), stacked.sum(0), 'average=False')
    close(hvd.allreduce(mx.nd.array(ALL[RANK]), average=True).asnumpy(), stacked.mean(0),
          'average=True')
close(hvd.allreduce(mx.nd.array(ALL[RANK]), None, 'pos', 0, 2.0, 1.0, hvd.global_process_set,
                    hvd.Sum).asnumpy(), 2 * stacked.sum(0), 'positional allreduce')
# other dtypes: float64, float16, int32 (Sum, Min, Max)
for dtype in ('float64', 'float16', 'int32'):
    parts = [data(r, dtype='float64') * 10 for r in range(SIZE)]
    parts = [p.astype(dtype) for p in parts]
    for op in (hvd.Sum, hvd.Min, hvd.Max):
        got = hvd.allreduce(mx.nd.array(parts[RANK], dtype=dtype), op=op)
        assert got.dtype == np.dtype(dtype), (got.dtype, dtype)
        want = REDUCE[op](np.stack(parts).astype(np.float64))
        close(got.asnumpy(), want, '%s op=%d' % (dtype, op), rtol=2e-3 if dtype == 'float16'
              else 1e-7)

# grouped_allreduce(_)
group = [mx.nd.array(data(RANK, (4,))), mx.nd.array(data(RANK, (2, 2)) * 2)]
wants = [np.stack([data(r, (4,)) for r in range(SIZE)]).astype(np.float64),
         np.stack([data(r, (2, 2)) * 2 for r in range(SIZE)]).astype(np.float64)]
for op, reduce in REDUCE.items():
    outs = hvd.grouped_allreduce(group, op=op, prescale_factor=0.5, postscale_factor=4.0)
    for out, want in zip(outs, wants):
        close(out.asnumpy(), 4.0 * reduce(0.5 * want), 'grouped_allreduce op=%d' % op)
copies = [g.copy() for g in group]
assert hvd.grouped_allreduce_(copies, op=hvd.Sum) is copies
for out, want in zip(copies, wants):
    close(out.asnumpy(), want.sum(0), 'grouped_allreduce_')
assert hvd.grouped_allreduce([]) == []

# allgather: alike and different first dimensions; grouped
got = hvd.allgather(mx.nd.array(ALL[RANK]))
close(got.asnumpy(), np.concatenate(ALL), 'allgather')
rows = [np.full((r + 1, 2), r, dtype='float32') for r in range(SIZE)]
close(hvd.allgather(mx.nd.array(rows[RANK]), name='ragged').asnumpy(), np.concatenate(rows),
      'allgather ragged')
outs = hvd.grouped_allgather([mx.nd.array(ALL[RANK]), mx.nd.array(rows[RANK])])
close(outs[1].asnumpy(), np.concatenate(rows), 'grouped_allgather')

# broadcast(_): every root, keyword and positional
for root in range(SIZE):
    x = mx.nd.array(ALL[RANK])
    close(hvd.broadcast(x, root).asnumpy(), ALL[root], 'broadcast root %d' % root)
    close(x.asnumpy(), ALL[RANK], 'broadcast left its input')
    y = mx.nd.array(ALL[RANK])
    assert hvd.broadcast_(y, root_rank=root, name='b') is y
    close(y.asnumpy(), ALL[root], 'broadcast_ root %d' % root)

# alltoall: equal cut, and splits (list and NDArray) with received splits
send = np.arange(SIZE * 2 * 3, dtype='float32').reshape(SIZE * 2, 3) + 100 * RANK
got = hvd.alltoall(mx.nd.array(send))
want = np.concatenate([(np.arange(SIZE * 2 * 3, dtype='float32').reshape(SIZE * 2, 3)
                        + 100 * r)[2 * RANK:2 * RANK + 2] for r in range(SIZE)])
close(got.asnumpy(), want, 'alltoall equal')


def splits_of(r):
    """Rank r sends (r + i) % 3 rows to rank i."""
    return [(r + i) % 3 for i in range(SIZE)]


def rows_of(r):
    return np.arange(sum(splits_of(r)) * 2, dtype='float64').reshape(-1, 2) + 1000 * r


for form in ('list', 'ndarray'):
    splits = splits_of(RANK) if form == 'list' else mx.nd.array(splits_of(RANK), dtype='int32')
    got, received = hvd.alltoall(mx.nd.array(rows_of(RANK), dtype='float64'), splits=splits)
    parts = []
    for r in range(SIZE):
        start = sum(splits_of(r)[:RANK])
        parts.append(rows_of(r)[start:start + splits_of(r)[RANK]])
    close(got.asnumpy(), np.concatenate(parts), 'alltoall splits (%s)' % form)
    assert received.dtype == np.int32
    assert list(received.asnumpy()) == [splits_of(r)[RANK] for r in range(SIZE)]

# reducescatter: Average (default) and Sum, scale factors, uneven rows
for nrows in (SIZE * 2, SIZE * 2 + 1):
    parts = [data(r, (nrows, 2)) for r in range(SIZE)]
    total = np.stack(parts).astype(np.float64)
    cut = np.array_split(np.arange(nrows), SIZE)[RANK]
    got = hvd.reducescatter(mx.nd.array(parts[RANK]))
    close(got.asnumpy(), total.mean(0)[cut], 'reducescatter average %d rows' % nrows)
    got = hvd.reducescatter(mx.nd.array(parts[RANK]), op=hvd.Sum, prescale_factor=2.0,
                            postscale_factor=0.5)
    close(got.asnumpy(), total.sum(0)[cut], 'reducescatter sum scaled')
    got = hvd.grouped_reducescatter([mx.nd.array(parts[RANK])], hvd.Sum)[0]
    close(got.asnumpy(), total.sum(0)[cut], 'grouped_reducescatter')

if TRACE:
    hvd.stop_timeline()
    root, ext = os.path.splitext(TRACE)
    with open('%s.rank%d%s' % (root, RANK, ext)) as fh:
        names = {event['name'] for event in json.load(fh)['traceEvents']}
    assert 'mpi_kvstore.allreduce' in names and 'mpi_kvstore.bcast' in names, names

# objects
assert hvd.broadcast_object({'from': RANK}, root_rank=SIZE - 1) == {'from': SIZE - 1}
assert hvd.broadcast_object([RANK]) == [0]
assert hvd.allgather_object(('r', RANK)) == [('r', r) for r in range(SIZE)]

# bad input raises on every rank, before any collective
x = mx.nd.array(ALL[RANK])
expect_raises(ValueError, hvd.allreduce, x, op=17, contains='unknown op')
expect_raises(ValueError, hvd.allreduce, x, op=hvd.Sum, average=True, contains='supersedes')
expect_raises(NotImplementedError, hvd.allreduce, x, op=hvd.Adasum, contains='hvd.Average')
expect_raises(NotImplementedError, hvd.allreduce_, x, op=hvd.Adasum, contains='Adasum')
expect_raises(ValueError, hvd.reducescatter, x, op=hvd.Max, contains='Average or hvd.Sum')
expect_raises(ValueError, hvd.broadcast, x, SIZE, contains='root_rank %d' % SIZE)
expect_raises(ValueError, hvd.broadcast_, x, -1, contains='root_rank -1')
expect_raises(ValueError, hvd.broadcast_object, 1, root_rank=SIZE + 3, contains='root_rank')
expect_raises(ValueError, hvd.broadcast_parameters, {'w': x}, root_rank=SIZE,
              contains='root_rank')
expect_raises(ValueError, hvd.broadcast_parameters, [x], contains='invalid params')
expect_raises(ValueError, hvd.alltoall, mx.nd.ones((SIZE * 2 + 1, 2)), contains='equal parts')
expect_raises(ValueError, hvd.alltoall, mx.nd.ones((3, 2)), splits=[3] + [1] * (SIZE - 1),
              contains='add up')
expect_raises(ValueError, hvd.alltoall, mx.nd.ones((3, 2)), splits=[1] * (SIZE + 1),
              contains='add up')
# splits may leave the last rows unsent, as in Horovod: one row to each rank of SIZE + 2
got, received = hvd.alltoall(mx.nd.array(np.arange(SIZE + 2.0) + 10 * RANK), [1] * SIZE)
close(got.asnumpy(), [10 * r + RANK for r in range(SIZE)], 'alltoall short splits')

# process sets (the whole job's ranks again would be a duplicate of the global set):
# from a list of ranks, [0, 1] at 3 ranks, [1] at 2; from a communicator, the last two
# ranks at 3, [0] at 2
FIRST = [0, 1] if SIZE > 2 else [1]
SECOND = [SIZE - 2, SIZE - 1] if SIZE > 2 else [0]
expect_raises(ValueError, hvd.add_process_set, list(range(SIZE)), contains='exists already')
first = hvd.ProcessSet(FIRST[::-1])
assert first.size() is None and first.ranks == FIRST
hvd.add_process_set(first)
assert first.size() == len(FIRST) and first.included() == (RANK in FIRST)
assert first.rank() == (FIRST.index(RANK) if RANK in FIRST else None)
sub_comm = MPI.COMM_WORLD.Split(0 if RANK in SECOND else MPI.UNDEFINED, RANK)
second = hvd.add_process_set(hvd.ProcessSet(sub_comm))
assert second.ranks == SECOND, second.ranks
if SIZE > 2:
    expect_raises(ValueError, hvd.add_process_set, [1, 0], contains='exists already')
for ps in (first, second):
    members = ps.ranks
    if ps.included():
        got = hvd.allreduce(mx.nd.array(ALL[RANK]), op=hvd.Sum, process_set=ps)
        close(got.asnumpy(), np.stack([ALL[r] for r in members]).astype(np.float64).sum(0),
              'process set %s sum' % members)
        got = hvd.allreduce(mx.nd.array(ALL[RANK]), process_set=ps, op=hvd.Max)
        close(got.asnumpy(), np.stack([ALL[r] for r in members]).max(0), 'set max')
        root = members[-1]
        close(hvd.broadcast(mx.nd.array(ALL[RANK]), root, process_set=ps).asnumpy(), ALL[root],
              'process set broadcast from global rank %d' % root)
        close(hvd.allgather(mx.nd.array(ALL[RANK]), process_set=ps).asnumpy(),
              np.concatenate([ALL[r] for r in members]), 'set allgather')
        assert hvd.allgather_object(RANK, process_set=ps) == members
        outside = [r for r in range(SIZE) if r not in members]
        if outside:
            expect_raises(ValueError, hvd.broadcast, x, outside[0], process_set=ps,
                          contains='not a rank of the process set')
    else:
        calls = ((hvd.allreduce, (x,), {}), (hvd.allreduce_, (x,), {'op': hvd.Min}),
                 (hvd.broadcast_, (x, members[0]), {}), (hvd.allgather, (x,), {}),
                 (hvd.alltoall, (x,), {}), (hvd.reducescatter, (x,), {}),
                 (hvd.broadcast_object, (1, members[0]), {}),
                 (hvd.DistributedOptimizer, (mx.optimizer.SGD(),), {}))
        for fn, args, kwargs in calls:
            expect_raises(ValueError, fn, *args, process_set=ps, contains='rank %d is not in'
                          % RANK, **kwargs)
unregistered = hvd.ProcessSet([0])
expect_raises(ValueError, hvd.allreduce, x, process_set=unregistered, contains='not registered')
assert hvd.remove_process_set(first) and not hvd.remove_process_set(first)
assert not hvd.remove_process_set(hvd.global_process_set)
expect_raises(ValueError, hvd.allreduce, x, process_set=first, contains='not registered')

hvd.shutdown()
assert not hvd.is_initialized()
expect_raises(ValueError, hvd.rank, contains='hvd.init()')

# init again, on a list of COMM_WORLD ranks, with a store option as a keyword
if SIZE > 2:
    if RANK == 2:
        expect_raises(ValueError, hvd.init, comm=[0, 1], fusion_threshold=4096,
                      contains='rank 2 is not in it')
    else:
        pair = hvd.ProcessSet([1])
        hvd.init(comm=[0, 1], process_sets=[pair], fusion_threshold=4096)
        assert pair.included() == (RANK == 1) and pair.size() == 1
        assert hvd.size() == 2 and hvd.rank() == RANK
        assert hvd.store().config.fusion_threshold == 4096
        got = hvd.allreduce(mx.nd.array(ALL[RANK]), op=hvd.Sum)
        close(got.asnumpy(), ALL[0].astype(np.float64) + ALL[1], 'init(comm=[0, 1]) sum')
        hvd.shutdown()
done('hvd_ops')
