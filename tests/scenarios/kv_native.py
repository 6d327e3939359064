"""No Python on MXNet's engine threads: funneled and concurrent mark collectives ready
with a compiled op (numba), chained runs them in one, so neither the ctypes
trampoline nor a native op's Python path is entered; with native_ops=0 (the
control) the trampoline is entered once per call. The sums are right either way,
also fused, averaged and broadcast. An MKLDNN-layout array on one rank still fails
loudly there, and the other ranks get RankMismatchError instead of a sum without
its part.

usage: kv_native.py DESIGN (0|1: native ops)
"""
import sys

import mxnet as mx
from mxnet import gluon

import mpi_kvstore
from mpi_kvstore import debug
from mpi_kvstore.engine import layout

from common import RANK, SIZE, close, design_arg, done, expect_raises

DESIGN = design_arg()
NATIVE = sys.argv[2] == '1'
CALLS = 200


def pushpulls(kv):
    """CALLS calls, half with data still being computed (the op queues on an engine
    worker), half with data ready (the op runs inline on this thread)."""
    grads = [mx.nd.ones((256,)) for _ in range(4)]
    for step in range(CALLS // 2):
        for _i, grad in enumerate(grads):   # written by an op just pushed: not ready yet
            mx.nd.ones((256,), out=grad)
        kv.pushpull(list(range(4)), grads)
        kv.wait()
        ready = mx.nd.ones((64,)) * (RANK + 1)
        ready.wait_to_read()
        kv.pushpull('ready', ready)
        close(ready.asnumpy(), SIZE * (SIZE + 1) / 2, 'ready pushpull %d' % step)
    close(grads[0].asnumpy(), SIZE, 'queued pushpull')


def other_forms(kv):
    """Fused (several keys of a call), averaged and broadcast collectives, on data ready
    and not ready, as numpy computes them."""
    for step in range(CALLS // 20):
        ints = [mx.nd.full((5 + i,), RANK + step, dtype='int32') for i in range(3)]
        doubles = [mx.nd.full((9,), 2.0 * (RANK + 1), dtype='float64') for _ in range(2)]
        kv.pushpull(['i%d' % i for i in range(3)], ints)
        kv.pushpull(['d%d' % i for i in range(2)], doubles)
        root_value = mx.nd.full((6,), 10.0 * RANK + step)
        out = mx.nd.zeros((6,))
        kv.broadcast('b%d' % step, root_value, out=out)
        ints_sum = sum(r + step for r in range(SIZE))
        for _i, arr in enumerate(ints):
            close(arr.asnumpy(), ints_sum, 'fused int32 pushpull %d' % step)
        for arr in doubles:
            close(arr.asnumpy(), SIZE * (SIZE + 1), 'fused float64 pushpull %d' % step)
        close(out.asnumpy(), step, 'broadcast %d' % step)
    avg = mpi_kvstore.create('dist_mpi', design=DESIGN, native_ops=NATIVE, average=True)
    for dtype, expected in (('float32', (SIZE + 1) / 2.0), ('int64', (SIZE + 1) // 2)):
        vals = [mx.nd.full((4 + i,), RANK + 1, dtype=dtype) for i in range(3)]
        avg.pushpull(['%s%d' % (dtype, i) for i in range(3)], vals)
        one = mx.nd.full((7,), RANK + 1, dtype=dtype)
        avg.pushpull(dtype, one)
        for arr in vals + [one]:
            close(arr.asnumpy(), expected, 'averaged %s pushpull' % dtype)
    avg.close()


def inline_when_ready():
    """chained: a call of at most inline_max_bytes whose data is ready runs on this thread
    (its op is done when pushpull returns); a larger one, or any with inline_max_bytes=0,
    goes to the worker. The sums are the same either way, on ready and unready data."""
    for limit in (1 << 20, 0):
        kv = mpi_kvstore.create('dist_mpi', design=DESIGN, native_ops=NATIVE,
                                inline_max_bytes=limit)
        for nbytes in (4 << 10, 2 << 20):
            value = mx.nd.full((nbytes // 4,), RANK + 1)
            value.wait_to_read()
            kv.pushpull('inline%d' % nbytes, value)
            if DESIGN == 'chained' and NATIVE and SIZE > 1:
                op = kv._job.design._inflight[-1]
                offered = bool(op.record[layout.PUSHER])   # pushed to run inline if ready
                assert offered == (nbytes <= limit) and (op.done or not offered), (
                    'rank %d: %d bytes with inline_max_bytes=%d: offered inline %s, done '
                    'when pushpull returned %s' % (RANK, nbytes, limit, offered, op.done))
            close(value.asnumpy(), SIZE * (SIZE + 1) / 2, 'ready %d bytes' % nbytes)
            busy = mx.nd.full((nbytes // 4,), RANK + 1) * 1   # still being computed
            kv.pushpull('inline%d' % nbytes, busy)
            close(busy.asnumpy(), SIZE * (SIZE + 1) / 2, 'unready %d bytes' % nbytes)
        kv.close()
    if DESIGN == 'chained' and NATIVE and SIZE > 1:
        lone_then_burst()


def lone_then_burst():
    """chained, inline_max_bytes: a lone call runs inline, the calls made right after it (a
    burst, by the design's clock, here held still) queue so that they fuse, and a call made
    after a pause runs inline again; the sums are numpy's."""
    from mpi_kvstore.designs import chained
    from mpi_kvstore.engine import core
    now, inline, real_clock, real_push = [1.0], [], chained._clock, core.push_native

    def push_native(*args, **kwargs):
        inline.append(kwargs.get('inline_when_ready', False))
        return real_push(*args, **kwargs)
    chained._clock, core.push_native = (lambda: now[0]), push_native
    try:
        kv = mpi_kvstore.create('dist_mpi', design=DESIGN, native_ops=NATIVE,
                                inline_max_bytes=1 << 20)
        values = [mx.nd.full((1024,), RANK + 1 + i) for i in range(8)]
        for value in values:
            value.wait_to_read()
        for rounds in range(2):
            now[0] += 1.0                     # a pause: the first call is lone
            del inline[:]
            for i, value in enumerate(values):
                kv.pushpull('burst%d' % i, value)
            kv.wait()
            assert inline == [True], 'rank %d round %d: offered inline %s' % (RANK, rounds, inline)
            for i, value in enumerate(values):   # round 1 sums round 0's sums
                expected = (SIZE * (SIZE + 1) / 2 + SIZE * i) * SIZE ** rounds
                close(value.asnumpy(), expected, 'burst call %d round %d' % (i, rounds))
        kv.close()
    finally:
        chained._clock, core.push_native = real_clock, real_push


def mkldnn_weight_fails_loudly(kv):
    """A conv weight after an inference-mode forward sits in an MKLDNN layout: on rank 0
    it is pushed, the others push a plain array of the same shape."""
    net = gluon.nn.Conv2D(8, 3, in_channels=3)
    net.initialize(mx.init.One())
    net(mx.nd.ones((1, 3, 8, 8))).wait_to_read()
    weight = net.weight.data() if RANK == 0 else mx.nd.ones(net.weight.shape)
    expect_raises(mpi_kvstore.MPIKVStoreError, lambda: kv.pushpull('w', weight) or kv.wait(),
                  contains='cannot be read in place' if RANK == 0 or SIZE == 1
                  else 'ranks disagree')
    after = mx.nd.ones((3,))
    kv.pushpull('after', after)
    close(after.asnumpy(), SIZE, 'the pushpull after the failed one')


def main():
    kv = mpi_kvstore.create('dist_mpi', design=DESIGN, native_ops=NATIVE)
    kv.pushpull('warm', mx.nd.ones((4,)))
    kv.wait()
    before = debug.snapshot()
    pushpulls(kv)
    other_forms(kv)
    entered = debug.since(before, 'engine_python').get('', 0)
    if NATIVE:
        assert entered == 0, 'rank %d: %d engine ops ran Python code' % (RANK, entered)
    else:  # the control: the same calls through the Python op do enter it
        assert entered >= CALLS, 'rank %d: only %d trampoline entries' % (RANK, entered)
    inline_when_ready()
    mkldnn_weight_fails_loudly(kv)
    print('rank %d: %d trampoline entries for %d calls' % (RANK, entered, CALLS), flush=True)
    done('kv_native[%s, native=%d]' % (DESIGN, NATIVE), entered=entered, calls=CALLS)


main()
