"""The one-function path of repeated calls (store/exchange.Exchange.again for kv.pushpull
and kv.push, store/collectives.Collectives.again_group for hvd.grouped_allreduce_; debug
counter 'again'), its sums against numpy, and its fall-backs.

usage: kv_again.py DESIGN

steps     Keys of float32, float64 and int32 reduced 4 steps on the same arrays with new
          values (rank r contributes (r + 1) * base): kv.pushpull in place (out= the value,
          and out omitted), into another array (out=, staged), of a list of two keys,
          kv.push then kv.pull, and hvd.grouped_allreduce_ of three tensors (Sum and the
          default Average). Every result is checked against numpy; 'again' counts the calls
          of steps 3-4 (step 2 prepares them), of the groups' and pulls' steps 2-4.
fallback  After a call took the one-function path: another array object of the same shape,
          a new shape for the key (ValueError, nothing sent), a context (cpu(1)), a priority,
          compression set and unset, a pull into another array or a list, and a group with
          one tensor replaced or two tensors sharing storage: each takes the full path (no 'again'), sums right, and the
          original call's next repeat takes the one-function path again.
"""
import mxnet as mx
import numpy as np

import mpi_kvstore
import mpi_kvstore.horovod as hvd
from mpi_kvstore import debug

from common import RANK, SIZE, close, design_arg, done, expect_raises

DESIGN = design_arg()
FACTOR = SIZE * (SIZE + 1) // 2      # sum over ranks of (rank + 1)
STEPS = 4
DTYPES = ('float32', 'float64', 'int32')

kv = mpi_kvstore.create('dist_mpi', design=DESIGN, autotune='0')
hvd.init(design=DESIGN, autotune='0')


def base(i, count, step):
    return (np.arange(count) + 3 * i + step) % 7


def fill(arr, i, step):
    arr[:] = base(i, arr.size, step).reshape(arr.shape) * (RANK + 1)


def again_since(before):
    return debug.since(before, 'again')


def steps():
    arrays = {}
    for i, dtype in enumerate(DTYPES):
        arrays['inplace', dtype] = mx.nd.zeros((5 + i, 3), dtype=dtype)
        arrays['noout', dtype] = mx.nd.zeros((64 + i,), dtype=dtype)
        arrays['src', dtype] = mx.nd.zeros((9 + i,), dtype=dtype)
        arrays['dst', dtype] = mx.nd.zeros((9 + i,), dtype=dtype)
        arrays['push', dtype] = mx.nd.zeros((11 + i,), dtype=dtype)
        arrays['pulled', dtype] = mx.nd.zeros((11 + i,), dtype=dtype)
        kv.init('push_%s' % dtype, mx.nd.zeros((11 + i,), dtype=dtype))
    pair = [mx.nd.zeros((6,)), mx.nd.zeros((2, 4), dtype='float64')]
    group = [mx.nd.zeros((4,)), mx.nd.zeros((3, 3)), mx.nd.zeros((7,), dtype='float64')]
    mean = [mx.nd.zeros((5,)), mx.nd.zeros((8,), dtype='float64')]
    counts = []
    for step in range(STEPS):
        for (what, dtype), arr in arrays.items():
            fill(arr, DTYPES.index(dtype) + len(what), step)
        for i, arr in enumerate(pair + group + mean):
            fill(arr, 20 + i, step)
        before = debug.snapshot()
        for dtype in DTYPES:
            kv.pushpull('inplace_%s' % dtype, arrays['inplace', dtype],
                        out=arrays['inplace', dtype])
            kv.pushpull('noout_%s' % dtype, arrays['noout', dtype], priority=1)
            kv.pushpull('out_%s' % dtype, arrays['src', dtype], out=arrays['dst', dtype])
            kv.push('push_%s' % dtype, arrays['push', dtype])
        kv.pushpull(['pair_a', 'pair_b'], pair, out=pair)
        hvd.grouped_allreduce_(group, name='group', op=hvd.Sum)
        hvd.grouped_allreduce_(mean, name='mean')
        for dtype in DTYPES:
            kv.pull('push_%s' % dtype, out=arrays['pulled', dtype])
        kv.wait()
        counts.append(again_since(before))
        for dtype in DTYPES:
            i = DTYPES.index(dtype)
            for what in ('inplace', 'noout', 'dst', 'pulled'):
                source = {'dst': 'src', 'pulled': 'push'}.get(what, what)
                arr = arrays[what, dtype]
                want = base(i + len(source), arr.size, step).reshape(arr.shape) * FACTOR
                close(arr.asnumpy(), want, '%s %s step %d' % (what, dtype, step))
            close(arrays['src', dtype].asnumpy(),
                  base(i + 3, arrays['src', dtype].size, step) * (RANK + 1),
                  'src %s step %d (left as it was)' % (dtype, step))
        for i, arr in enumerate(pair + group):
            want = base(20 + i, arr.size, step).reshape(arr.shape) * FACTOR
            close(arr.asnumpy(), want, 'pair/group %d step %d' % (i, step))
        for i, arr in enumerate(mean):
            want = base(25 + i, arr.size, step) * FACTOR / SIZE
            close(arr.asnumpy(), want, 'mean %d step %d' % (i, step))
    return counts


def one(fn, *args, **kwargs):
    before = debug.snapshot()
    fn(*args, **kwargs)
    kv.wait()
    return again_since(before)


def fallback():
    said = {}
    x = mx.nd.ones((16,)) * (RANK + 1)
    for _ in range(3):
        kv.pushpull('fb', x, out=x)
    kv.wait()
    x[:] = RANK + 1
    said['same'] = one(kv.pushpull, 'fb', x, out=x)
    close(x.asnumpy(), FACTOR, 'fb same')
    y = mx.nd.ones((16,)) * (RANK + 1)
    said['another array'] = one(kv.pushpull, 'fb', y, out=y)
    close(y.asnumpy(), FACTOR, 'fb another array')
    z = mx.nd.ones((17,)) * (RANK + 1)
    expect_raises(ValueError, kv.pushpull, 'fb', z, out=z, contains='shape')
    c = mx.nd.ones((16,), ctx=mx.cpu(1)) * (RANK + 1)
    said['context'] = one(kv.pushpull, 'fb', c, out=c)
    close(c.asnumpy(), FACTOR, 'fb context')
    x[:] = RANK + 1
    said['priority'] = one(kv.pushpull, 'fb', x, out=x, priority=3)
    close(x.asnumpy(), FACTOR, 'fb priority')
    kv.set_gradient_compression({'type': '2bit', 'threshold': 0.5})
    x[:] = RANK + 1
    said['compressed'] = one(kv.pushpull, 'fb', x, out=x, priority=3)
    close(x.asnumpy(), 0.5 * SIZE, 'fb compressed (2bit: each rank sends its threshold)')
    kv.set_gradient_compression({'type': 'none'})
    x[:] = RANK + 1
    one(kv.pushpull, 'fb', x, out=x, priority=3)
    x[:] = RANK + 1
    said['again'] = one(kv.pushpull, 'fb', x, out=x, priority=3)
    close(x.asnumpy(), FACTOR, 'fb again')

    kv.init('fb_pull', mx.nd.zeros((6,)))
    p = mx.nd.zeros((6,))
    for step in range(3):
        kv.push('fb_pull', mx.nd.ones((6,)) * (RANK + 1 + step))
        said['pull %d' % step] = one(kv.pull, 'fb_pull', out=p)
        close(p.asnumpy(), FACTOR + SIZE * step, 'fb pull %d' % step)
    q = mx.nd.zeros((6,))
    said['pull another array'] = one(kv.pull, 'fb_pull', out=q)
    close(q.asnumpy(), FACTOR + SIZE * 2, 'fb pull another array')
    said['pull a list'] = one(kv.pull, 'fb_pull', out=[p])
    close(p.asnumpy(), FACTOR + SIZE * 2, 'fb pull a list')

    group = [mx.nd.ones((4,)) * (RANK + 1), mx.nd.ones((5,)) * (RANK + 1)]
    for _ in range(2):
        hvd.grouped_allreduce_(group, name='g2', op=hvd.Sum)
    kv.wait()
    other = [group[0], mx.nd.ones((5,)) * (RANK + 1)]
    group[0][:] = RANK + 1
    said['group replaced'] = one(hvd.grouped_allreduce_, other, name='g2', op=hvd.Sum)
    for i, arr in enumerate(other):
        close(arr.asnumpy(), FACTOR, 'group replaced %d' % i)
    base_arr = mx.nd.ones((8,)) * (RANK + 1)
    views = [base_arr[0:4], base_arr[4:8]]
    for step in range(3):
        base_arr[:] = RANK + 1
        said['views %d' % step] = one(hvd.grouped_allreduce_, views, name='views', op=hvd.Sum)
        close(base_arr.asnumpy(), FACTOR, 'views step %d' % step)
    return said


def main():
    counts = steps()
    said = fallback()
    done('kv_again[%s]' % DESIGN, counts=counts, fallback=said)
    kv.close()


main()
