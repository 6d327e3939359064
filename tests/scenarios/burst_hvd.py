"""Horovod's allreduce_ on its one-function prepared path (horovod.ops.allreduce_ ->
store.collectives.Collectives.again; debug counter 'fastpath').

usage: burst_hvd.py DESIGN

burst      20 tensors (16 KB float32, float64, int32) reduced by hvd.allreduce_ back to
           back under their names, then waited for; 4 steps on the same arrays with new
           values: op Sum and the default Average (folded for floats, scaled after for
           int32) sum or average as numpy does, and from step 2 every call is prepared.
switches   On a prepared name and array: Sum -> Average -> Sum, prescale and postscale
           factors (folded into the request: a change of factor is a change of call),
           Max, a default name: each right as numpy says (the first call of a
           change takes the full path); op=True, Adasum and an unregistered process set
           still raise as before.
functional mpi_kvstore.allreduce_ of 10 tensors (sum and mean), 3 steps: right as numpy
           says, every call prepared from step 2.
mismatch   A burst of prepared calls whose last differs in shape on the ranks fails on
           every rank, naming both shapes; the prepared calls go on summing right.
"""
import mxnet as mx
import numpy as np

import mpi_kvstore
import mpi_kvstore.horovod as hvd
from mpi_kvstore import debug

from common import RANK, SIZE, close, design_arg, done, report

DESIGN = design_arg()
FACTOR = SIZE * (SIZE + 1) // 2      # sum over ranks of (rank + 1)
DTYPES = ('float32', 'float64', 'int32')
hvd.init(design=DESIGN, autotune='0')


def counted(fn):
    before = debug.snapshot()
    fn()
    hvd.store().wait()
    return debug.since(before, 'fastpath')


def burst():
    """[(hits, misses)] of steps 2-4, each step's values checked."""
    arrays = [mx.nd.zeros((4096 // (2 if DTYPES[i % 3] == 'float64' else 1),),
                          dtype=DTYPES[i % 3]) for i in range(20)]
    seen = []
    for step in range(4):
        for op in (hvd.Sum, hvd.Average):
            for i, x in enumerate(arrays):
                x[:] = (RANK + 1) * (np.arange(x.shape[0]) % 7 + i + step)

            def issue(op=op):
                for i, x in enumerate(arrays):
                    hvd.allreduce_(x, name='b%d.%d' % (op, i), op=op)
                for x in arrays:
                    x.wait_to_read()
            hits = counted(issue)
            for i, x in enumerate(arrays):
                total = FACTOR * (np.arange(x.shape[0]) % 7 + i + step)
                want = total if op == hvd.Sum else total / SIZE
                if x.dtype == np.int32 and op == hvd.Average:
                    want = (total.astype('float64') / SIZE).astype('int32')
                close(x.asnumpy(), want, 'step %d op %d tensor %d' % (step, op, i))
            if step:
                seen.append([hits.get('hit', 0), hits.get('miss', 0)])
    return seen


def switches():
    """{case: fastpath counters}, each value checked against numpy."""
    found = {}
    t = mx.nd.zeros((256,))
    base = np.arange(256) % 5 + 1.0

    def call(case, want, **kwargs):
        t[:] = (RANK + 1) * base
        found[case] = counted(lambda: hvd.allreduce_(t, **kwargs))
        close(t.asnumpy(), want, case)
    call('sum', FACTOR * base, name='s', op=hvd.Sum)
    call('sum again', FACTOR * base, name='s', op=hvd.Sum)
    call('average', FACTOR * base / SIZE, name='s')
    call('average again', FACTOR * base / SIZE, name='s', op=hvd.Average)
    call('sum after average', FACTOR * base, name='s', op=hvd.Sum)
    call('prescale', 2 * FACTOR * base, name='s', op=hvd.Sum, prescale_factor=2.0)
    call('postscale', 3 * FACTOR * base, name='s', op=hvd.Sum, postscale_factor=3.0)
    call('postscale again', 3 * FACTOR * base, name='s', op=hvd.Sum, postscale_factor=3.0)
    call('sum after postscale', FACTOR * base, name='s', op=hvd.Sum)
    call('max', SIZE * base, name='s', op=hvd.Max)
    call('default name', FACTOR * base / SIZE)
    call('default name again', FACTOR * base / SIZE)
    raised = {}
    for case, kwargs in (('op True', {'op': True}), ('adasum', {'op': hvd.Adasum}),
                         ('unregistered set', {'process_set': hvd.ProcessSet([0])}),
                         ('average and op', {'op': hvd.Sum, 'average': True})):
        try:
            hvd.allreduce_(t, name='s', **kwargs)
            raised[case] = None
        except (ValueError, NotImplementedError) as err:
            raised[case] = type(err).__name__
    call('sum after the refused calls', FACTOR * base, name='s', op=hvd.Sum)
    return found, raised


def mismatch():
    """A burst of prepared calls whose last differs on the ranks -> (what was raised, hits)."""
    xs = [mx.nd.zeros((4,)) for _ in range(4)]

    def issue(value, odd):
        for i, x in enumerate(xs):
            x[:] = (RANK + 1) * (value + i)
        for i, x in enumerate(xs[:3]):
            hvd.allreduce_(x, name='m%d' % i, op=hvd.Sum)
        if not odd or RANK == 0:
            hvd.allreduce_(xs[3], name='m3', op=hvd.Sum)
        else:
            hvd.allreduce_(mx.nd.ones((4 + RANK,)), name='m3', op=hvd.Sum)
    for value in range(3):
        issue(value, False)
        hvd.store().wait()
    said = None
    before = debug.snapshot()
    try:
        issue(5, True)
        for x in xs[:3]:
            x.wait_to_read()
        hvd.store().wait()
    except mpi_kvstore.RankMismatchError as err:
        said = str(err)
    hits = debug.since(before, 'fastpath')
    for i, x in enumerate(xs[:3]):
        close(x.asnumpy(), FACTOR * (5 + i), 'burst call %d beside the mismatch' % i)
    for i, x in enumerate(xs[:3]):
        x[:] = (RANK + 1) * (7 + i)
        hvd.allreduce_(x, name='m%d' % i, op=hvd.Sum)
    hvd.store().wait()
    for i, x in enumerate(xs[:3]):
        close(x.asnumpy(), FACTOR * (7 + i), 'prepared call %d after the mismatch' % i)
    return said, hits


def functional():
    """mpi_kvstore.allreduce_ of 10 tensors back to back, 3 steps: [(hits, misses)] of
    steps 2-3, each sum and mean checked."""
    arrays = [mx.nd.zeros((1024,), dtype=DTYPES[i % 3]) for i in range(10)]
    seen = []
    for step in range(3):
        for average in (False, True):
            for i, x in enumerate(arrays):
                x[:] = (RANK + 1) * (i + step + 1)

            def issue(average=average):
                for i, x in enumerate(arrays):
                    mpi_kvstore.allreduce_(x, average=average, name='f%d.%d' % (average, i),
                                           store=hvd.store())
                for x in arrays:
                    x.wait_to_read()
            hits = counted(issue)
            for i, x in enumerate(arrays):
                total = np.full(1024, FACTOR * (i + step + 1), dtype='float64')
                want = total / SIZE if average else total
                close(x.asnumpy(), want.astype(x.dtype), 'functional step %d average %s '
                      'tensor %d' % (step, average, i))
            if step:
                seen.append([hits.get('hit', 0), hits.get('miss', 0)])
    return seen


steps = burst()
functional_steps = functional()
found, raised = switches()
said, mismatch_hits = mismatch()
report('burst_hvd_info', steps=steps, functional=functional_steps, switches=found, raised=raised, mismatch=said,
       mismatch_hits=mismatch_hits)
done('burst_hvd[%s]' % DESIGN)
hvd.shutdown()
