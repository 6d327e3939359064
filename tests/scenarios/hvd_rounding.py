"""Horovod's rounding kept apart from the store's, and a factor never taken from another
call's plan (R2's three doubts of issue 43, each shown wrong on 829eb52, 2 ranks).

usage: hvd_rounding.py DESIGN

- shared: an integer mean under one name on one store, through the functional API
  (average=True: the store's, floor-divided) and through mpi_kvstore.horovod (op=Average:
  Horovod's, truncated), in turns, in place and out of place: each call rounds as its API
  does ([-3] and [0]: -2 and -1). Their records were one (Collectives.again's key was
  True for both), so a repeat took the other API's rounding.
- collide: two postscale factors whose marks in the signature collide on the name's base
  (found here as on any rank: the same search), called in turn on one array: each call
  scales by its own factor. The chained design keyed its plans by the signature alone and
  the second factor took the first one's plan.
- half: float16 sums scaled as Horovod 0.28.1 scales them (checked bitwise against it:
  /work/hvd-venv, 4096 values): prescale each value, and the sum after, in float32 by the
  factor in float32. The factor was rounded to float16 first (1/3: 1 value in 3 an ulp off).
- extremes: Min, Max, Product with factors, scaled in the reduction's numpy copy (no scale
  op; they were engine ops before and after), as numpy's formula has it.
- custom: DistributedTrainer with a Horovod user's compressor prescales the compressed
  tensor as Horovod does (float32: folded, no op; float16: its op), not the gradient before
  it is compressed (an op on every gradient before).
"""
import mxnet as mx
import numpy as np

import mpi_kvstore
import mpi_kvstore.horovod as hvd
from mpi_kvstore import debug
from mpi_kvstore.comm.collective import factor_sig, signature

from common import RANK, SIZE, UserFP16, close, design_arg, done

DESIGN = design_arg()
hvd.init(design=DESIGN, autotune='0')
store = hvd.global_process_set._store
functional = mpi_kvstore.functional


def shared():
    for dtype in ('int32', 'int64'):
        total = np.array([-5, -3, -1, 1, 3, 5, 0, -7])   # rank 0's; the others' are 0
        mine = total * (RANK == 0)
        floor, trunc = total // SIZE, np.trunc(total / SIZE).astype(np.int64)
        for order in (('f', 'h', 'f', 'h'), ('h', 'f', 'h', 'f')):
            x = mx.nd.zeros((8,), dtype=dtype)
            for i, api in enumerate(order):
                what = 'shared %s %s call %d (%s)' % (dtype, ''.join(order), i, api)
                x[:] = mine
                if api == 'f':
                    functional.allreduce_(x, average=True, name='m' + dtype + order[0],
                                          store=store)
                    out = functional.allreduce(x, average=True, name='c' + dtype + order[0],
                                               store=store)
                else:
                    hvd.allreduce_(x, name='m' + dtype + order[0], op=hvd.Average)
                    out = hvd.allreduce(x, name='c' + dtype + order[0], op=hvd.Average)
                want = floor if api == 'f' else trunc
                close(x.asnumpy(), want, what + ' in place', rtol=0, atol=0)
                close(out.asnumpy(), want, what + ' out of place', rtol=0, atol=0)


def colliding(name, shape):
    """Two factors whose marks collide in the signature of an allreduce of ``name``."""
    base, seen = signature('allreduce', name, np.dtype('float32'), shape, 0), {}
    for i in range(1, 1 << 20):
        factor = 1.0 + i / 1024.0
        sig = factor_sig(base, factor, (1.0, factor))
        if sig in seen:
            return seen[sig], factor
        seen[sig] = factor
    raise AssertionError('no collision found')


def collide():
    pair = colliding('x', (8,))
    x = mx.nd.zeros((8,))
    for factor in pair + pair:
        x[:] = np.arange(8) * (RANK + 1)
        hvd.allreduce_(x, name='x', op=hvd.Sum, postscale_factor=factor)
        want = (np.arange(8) * (SIZE * (SIZE + 1) // 2)).astype(np.float32) * np.float32(factor)
        close(x.asnumpy(), want, 'collide %r' % factor, rtol=0, atol=0)
    return list(pair)


def half():
    values = [np.random.RandomState(7 + r).uniform(-60, 60, 4096).astype(np.float16)
              for r in range(SIZE)]

    def f32(a, factor):
        return (a.astype(np.float32) * np.float32(factor)).astype(np.float16)

    def summed(arrays):
        total = arrays[0]
        for a in arrays[1:]:
            total = total + a   # float16 adds, as the reduction's (exact in float32)
        return total

    plain = summed(values)
    cases = {'average': (dict(op=hvd.Average), f32(plain, 1.0 / SIZE)),
             'postscale 1/3': (dict(op=hvd.Sum, postscale_factor=1 / 3), f32(plain, 1 / 3)),
             'prescale 0.1': (dict(op=hvd.Sum, prescale_factor=0.1),
                              summed([f32(v, 0.1) for v in values])),
             'average postscale 0.7': (dict(op=hvd.Average, postscale_factor=0.7),
                                       f32(plain, 0.7 / SIZE))}
    for label, (kwargs, want) in cases.items():
        for step in range(2):   # the full path, then the repeat
            x = mx.nd.array(values[RANK], dtype='float16')
            hvd.allreduce_(x, name='half ' + label, **kwargs)
            got = x.asnumpy()
            close(got, want, 'half %s step %d' % (label, step), rtol=0, atol=0)
            # bitwise: close() compares in float64 within no tolerance, -0.0 == 0.0 aside
            assert np.array_equal(got.view(np.uint16), want.view(np.uint16)), label


def extremes():
    """Min, Max, Product with scale factors: the factors taken by the reduction's numpy copy
    (no scale op), as _scale's ops scaled the tensor before and after: numpy's formula."""
    mine = np.array([-5, -3, -1, 1, 3, 5, 2, -7]) * (RANK + 1)
    reduce = {hvd.Min: np.minimum, hvd.Max: np.maximum, hvd.Product: np.multiply}

    def scaled(a, factor, dtype):
        if np.dtype(dtype).kind != 'f':
            return (a.astype(np.float64) * factor).astype(dtype)
        return (a.astype(dtype).astype(np.float32) * np.float32(factor)).astype(dtype)

    for dtype in ('float32', 'float16', 'int32'):
        for op, fn in reduce.items():
            parts = [scaled((np.array([-5, -3, -1, 1, 3, 5, 2, -7]) * (r + 1)).astype(dtype),
                            0.5, dtype) for r in range(SIZE)]
            total = parts[0]
            for p in parts[1:]:
                total = fn(total, p)
            want = scaled(total, 3.0, dtype)
            x = mx.nd.array(mine, dtype=dtype)
            before = debug.snapshot()
            hvd.allreduce_(x, name='e', op=op, prescale_factor=0.5, postscale_factor=3.0)
            assert debug.since(before, 'hvd').get('scale_op', 0) == 0, debug.since(before, 'hvd')
            close(x.asnumpy(), want, 'extremes %s %s' % (dtype, op), rtol=0, atol=0)


class UserCopy:
    """A Horovod user's compressor that keeps float32 (compress/decompress, no store hint)."""

    @staticmethod
    def compress(tensor):
        return tensor.copy(), None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


def custom():
    """DistributedTrainer with a custom compressor and gradient_predivide_factor 3: the
    compressed gradient summed as Horovod's allreduce_(compressed, prescale_factor=1/3),
    float32 folded into the sum (no op; Horovod's up to rounding), float16 prescaled by its
    op (bitwise Horovod's); the gradient itself never scaled before it is compressed."""
    grads = [np.random.RandomState(20 + r).uniform(-4, 4, 64).astype(np.float32)
             for r in range(SIZE)]
    ops = {}
    for comp in (UserCopy, UserFP16):
        param = mx.gluon.Parameter('w_' + comp.__name__, shape=(64,))
        param.initialize(ctx=mx.cpu())
        trainer = hvd.DistributedTrainer([param], 'sgd', {'learning_rate': 0.1},
                                         compression=comp, gradient_predivide_factor=3.0)
        param.grad()[:] = grads[RANK]
        before = debug.snapshot()
        trainer.allreduce_grads()
        got = param.grad().asnumpy()
        ops[comp.__name__] = debug.since(before, 'hvd').get('scale_op', 0)
        if comp is UserCopy:
            want = sum(g * np.float32(1 / 3) for g in grads)
            close(got, want, 'custom float32', rtol=1e-6, atol=1e-6)
        else:
            parts = [(g.astype(np.float16).astype(np.float32) * np.float32(1 / 3))
                     .astype(np.float16) for g in grads]
            want = parts[0]
            for part in parts[1:]:
                want = want + part
            close(got, want.astype(np.float32), 'custom float16', rtol=0, atol=0)
    return ops


shared()
pair = collide()
half()
extremes()
custom_ops = custom()
done('hvd_rounding[%s]' % DESIGN, pair=pair, custom_ops=custom_ops)
hvd.shutdown()
