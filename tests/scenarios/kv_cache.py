"""Repeated calls skip their checks (keys.CallCache), and give the same sums and the same
errors as the full path: every result is compared with numpy, and every change that makes
a remembered call stale (a new array, a reshape, another dtype, another out, a list
instead of a bare array, an optimizer set afterwards) either takes the full path and its
checks again, or is refused with the error a first call gets.

usage: kv_cache.py DESIGN
"""
import mxnet as mx

import mpi_kvstore
from mpi_kvstore import debug

from common import RANK, SIZE, close, design_arg, done, expect_raises

DESIGN = design_arg()
RANK_SUM = SIZE * (SIZE + 1) / 2      # sum over ranks of (rank + 1)


def hits(before):
    return debug.since(before, 'call_cache').get('hit', 0)


def repeated_calls_hit_and_sum(kv):
    grad = mx.nd.zeros((7, 3))
    before = debug.snapshot()
    for step in range(20):
        grad[:] = (RANK + 1) * (step + 1)
        kv.pushpull('g', grad)
        close(grad.asnumpy(), RANK_SUM * (step + 1), 'repeated pushpull, step %d' % step)
    assert hits(before) == 19, debug.since(before, 'call_cache')
    # a list of keys, per-device values and separate outs: one entry for the whole call
    values = [[mx.nd.full((5,), RANK + 1), mx.nd.full((5,), 1.0, ctx=mx.cpu(1))],
              mx.nd.full((2, 2), 2.0 * (RANK + 1))]
    outs = [mx.nd.zeros((5,)), mx.nd.zeros((2, 2))]
    before = debug.snapshot()
    for step in range(5):
        kv.pushpull(['l0', 'l1'], values, out=outs, priority=-step)
        close(outs[0].asnumpy(), RANK_SUM + SIZE, 'key list, per-device values, step %d' % step)
        close(outs[1].asnumpy(), 2 * RANK_SUM, 'key list, second key, step %d' % step)
        outs[0][:] = 0
    assert hits(before) == 4, debug.since(before, 'call_cache')


def stale_calls_take_the_full_path(kv):
    grad = mx.nd.ones((4, 6))
    kv.pushpull('s', grad)
    kv.pushpull('s', grad)
    # a new array of the same shape: the sum lands in it, the old one is untouched
    fresh = mx.nd.full((4, 6), RANK + 1)
    before = debug.snapshot()
    kv.pushpull('s', fresh)
    assert hits(before) == 0
    close(fresh.asnumpy(), RANK_SUM, 'a new array for a known key')
    close(grad.asnumpy(), SIZE * SIZE, 'the array of the earlier calls (two sums) after a new one')
    # a reshape of the same memory, another dtype: refused as on a first call
    expect_raises(ValueError, kv.pushpull, 's', fresh.reshape((6, 4)),
                  contains='the key has shape (4, 6)')
    expect_raises(ValueError, kv.pushpull, 's', fresh.astype('float64'),
                  contains='float64')
    # the same array in a list instead of bare, then with an out: still right
    fresh[:] = RANK + 1
    kv.pushpull('s', [fresh])
    close(fresh.asnumpy(), RANK_SUM, 'the same array in a list')
    out_a, out_b = mx.nd.zeros((4, 6)), mx.nd.zeros((4, 6))
    fresh[:] = 1
    kv.pushpull('s', fresh, out=out_a)
    fresh[:] = 2
    kv.pushpull('s', fresh, out=out_b)
    close(out_a.asnumpy(), SIZE, 'the first out')
    close(out_b.asnumpy(), 2 * SIZE, 'another out for the same value')
    close(fresh.asnumpy(), 2, 'the value, not written with an out')
    # the same array as the out of another key in one call: refused, as without the cache
    other = mx.nd.ones((4, 6))
    kv.pushpull(['s', 's2'], [fresh, other])
    kv.pushpull(['s', 's2'], [fresh, other])
    close(other.asnumpy(), SIZE * SIZE, 'a key list, twice')
    expect_raises(ValueError, kv.pushpull, ['s', 's2'], [fresh, other],
                  out=[out_a, out_a], contains='output of keys')


def push_after_init_only(kv):
    """push needs init (MXNet's contract), also once a call of the same shape ran."""
    value = mx.nd.full((3,), RANK + 1)
    expect_raises(mpi_kvstore.UnknownKeyError, kv.push, 'p', value,
                  contains="push: key 'p' has no value")
    kv.pushpull('p', value)           # an allreduce: registers the key, stores nothing
    value[:] = RANK + 1
    expect_raises(mpi_kvstore.UnknownKeyError, kv.push, 'p', value, contains="push: key 'p'")
    kv.init('p', mx.nd.zeros((3,)))
    got = mx.nd.zeros((3,))
    for step in range(3):
        value[:] = (RANK + 1) * (step + 1)
        kv.push('p', value)
        kv.pull('p', out=got)
        close(got.asnumpy(), RANK_SUM * (step + 1), 'push then pull, step %d' % step)
        close(value.asnumpy(), (RANK + 1) * (step + 1), 'push leaves its value as it was')


def optimizer_set_later():
    """set_optimizer after in-place calls: the next call runs the optimizer, and needs
    weights, as a first call would."""
    kv = mpi_kvstore.create('dist_mpi', design=DESIGN)
    grad, weight = mx.nd.ones((4,)), mx.nd.ones((4,))
    kv.pushpull('w', grad, out=weight)
    kv.pushpull('w', grad, out=weight)
    close(weight.asnumpy(), SIZE, 'plain pushpull with an out')
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.5, rescale_grad=1.0))
    expect_raises(mpi_kvstore.UnknownKeyError, kv.pushpull, 'w', grad, out=weight,
                  contains='has no weights in the store')
    weight[:] = 1
    kv.init('w', weight)
    for step in range(3):
        kv.pushpull('w', grad, out=weight)
        close(weight.asnumpy(), 1 - 0.5 * SIZE * (step + 1), 'SGD in the store, step %d' % step)
    kv.close()


def main():
    kv = mpi_kvstore.create('dist_mpi', design=DESIGN)
    repeated_calls_hit_and_sum(kv)
    stale_calls_take_the_full_path(kv)
    push_after_init_only(kv)
    kv.wait()
    kv.close()
    optimizer_set_later()
    done('kv_cache[%s]' % DESIGN)


if __name__ == '__main__':
    main()
