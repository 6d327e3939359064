"""Every key/value/out form of the contract, checked against sums from (rank, size).

usage: kv_forms.py DESIGN
"""
import mxnet as mx
import numpy as np

import mpi_kvstore

from common import RANK, SIZE, close, design_arg, done

DESIGN = design_arg()
RANKSUM = SIZE * (SIZE + 1) / 2          # sum over ranks of (rank + 1)


def arr(shape, value, dtype='float32', ctx=None):
    return mx.nd.full(shape, value, ctx=ctx or mx.cpu(), dtype=dtype)


def check_single_keys(kv):
    kv.init(3, arr((2, 3), 7 + RANK))               # int key: rank 0's value wins
    kv.init('w', arr((5,), 1 + RANK))               # str key
    out = arr((2, 3), 0)
    kv.pull(3, out=out)
    close(out.asnumpy(), 7, 'init/pull int key')
    val = arr((2, 3), RANK + 1)
    kv.pushpull(3, val)                             # out=None: in place
    close(val.asnumpy(), RANKSUM, 'pushpull in place')
    val = arr((5,), RANK + 1)
    out = arr((5,), -1)
    kv.pushpull('w', val, out=out)
    close(out.asnumpy(), RANKSUM, 'pushpull str key into out')
    close(val.asnumpy(), RANK + 1, 'pushpull leaves value untouched when out is given')


def check_device_lists(kv):
    ctxs = [mx.cpu(0), mx.cpu(1)]
    kv.init(10, arr((4, 4), 0))
    vals = [arr((4, 4), (RANK + 1) * (d + 1), ctx=c) for d, c in enumerate(ctxs)]
    outs = [arr((4, 4), 0, ctx=c) for c in ctxs]
    kv.pushpull(10, vals, out=outs)                 # summed over devices, then ranks
    for o in outs:
        close(o.asnumpy(), 3 * RANKSUM, 'per-device values and outs')
    kv.pushpull(10, vals)                           # in place into every device's array
    for v in vals:
        close(v.asnumpy(), 3 * RANKSUM, 'per-device in place')


def check_key_lists(kv):
    keys = [20, 21, 22]
    shapes = [(3,), (2, 2), (1000,)]
    kv.init(keys, [arr(s, 0) for s in shapes])
    vals = [arr(s, (RANK + 1) * (i + 1)) for i, s in enumerate(shapes)]
    kv.pushpull(keys, vals)
    for i, v in enumerate(vals):
        close(v.asnumpy(), (i + 1) * RANKSUM, 'key list in place, key %d' % keys[i])
    ctxs = [mx.cpu(0), mx.cpu(1)]
    vals = [[arr(s, RANK + 1, ctx=c) for c in ctxs] for s in shapes]
    outs = [[arr(s, 0, ctx=c) for c in ctxs] for s in shapes]
    kv.pushpull(keys, vals, out=outs)               # list of per-device lists
    for per_key in outs:
        for o in per_key:
            close(o.asnumpy(), 2 * RANKSUM, 'key list of per-device lists')


def check_push_pull(kv):
    kv.init('p', arr((6,), 0))
    kv.push('p', [arr((6,), RANK + 1), arr((6,), 1, ctx=mx.cpu(1))])
    out = arr((6,), 0)
    kv.pull('p', out=out)
    close(out.asnumpy(), RANKSUM + SIZE, 'push then pull')
    val = arr((6,), RANK + 1)
    kv.push('p', val)
    close(val.asnumpy(), RANK + 1, 'push does not modify its value')


def check_broadcast(kv):
    outs = [arr((3, 2), -1), arr((3, 2), -1, ctx=mx.cpu(1))]
    kv.broadcast('b', arr((3, 2), 100 + RANK), out=outs)
    for o in outs:
        close(o.asnumpy(), 100, 'broadcast of rank 0 value')
    second = arr((4,), 0)
    kv.broadcast(['b', 'c'], [arr((3, 2), 5 + RANK), arr((4,), 9 + RANK)],
                 out=[outs, second])
    for o in outs:
        close(o.asnumpy(), 5, 'broadcast of a key list, first key')
    close(second.asnumpy(), 9, 'broadcast of a key list, second key')


def check_dtypes(kv):
    for dtype in ('float64', 'int32', 'int64', 'float16', 'uint8', 'int8'):
        key = 'dt_' + dtype
        kv.init(key, arr((17,), 0, dtype))
        val = arr((17,), RANK + 1, dtype)
        kv.pushpull(key, val)
        got = val.asnumpy()
        if got.dtype != np.dtype(dtype):
            raise AssertionError('dtype %s came back as %s' % (dtype, got.dtype))
        close(got, RANKSUM, 'pushpull %s' % dtype)


def check_many_small_keys(kv):
    """More keys than one negotiation window, all small: fusion territory."""
    n = 300
    keys = list(range(1000, 1000 + n))
    for k in keys:
        kv.init(k, arr((33,), 0))
    vals = [arr((33,), (RANK + 1) * (k % 7 + 1)) for k in keys]
    for _step in range(2):
        for i, k in enumerate(keys):
            kv.pushpull(k, vals[i], priority=-i)
    for k, v in zip(keys, vals):
        close(v.asnumpy(), (k % 7 + 1) * RANKSUM * SIZE, 'many keys, key %d' % k)


def check_large(kv):
    n = 3 << 20                                     # 12 MB: larger than a small threshold
    kv.init('big', arr((n,), 0))
    val = mx.nd.arange(n, dtype='float32') * 0 + (RANK + 1)
    kv.pushpull('big', val)
    close(val.asnumpy()[::4099], RANKSUM, 'large array')


def check_average():
    kv = mpi_kvstore.create('dist_mpi', design=DESIGN, average=True)
    kv.init(0, arr((8,), 0))
    val = arr((8,), RANK + 1)
    kv.pushpull(0, val)
    close(val.asnumpy(), RANKSUM / SIZE, 'average=True')
    kv.close()


def main():
    kv = mpi_kvstore.create('dist_mpi', design=DESIGN, fusion_threshold=1 << 20)
    assert kv.design == DESIGN and kv.rank == RANK and kv.num_workers == SIZE
    assert 'dist' in kv.type and '_sync' in kv.type
    for check in (check_single_keys, check_device_lists, check_key_lists, check_push_pull,
                  check_broadcast, check_dtypes, check_many_small_keys, check_large):
        check(kv)
    kv.wait()
    kv._barrier()
    check_average()
    unfused = mpi_kvstore.create('dist_mpi', design=DESIGN, fusion_threshold=0)
    check_many_small_keys(unfused)
    via_mx = mx.kv.create('dist_mpi')
    assert isinstance(via_mx, mpi_kvstore.MPIKVStore)
    done('kv_forms[%s]' % DESIGN)


main()
