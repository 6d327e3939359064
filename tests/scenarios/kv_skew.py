"""Readiness that differs between ranks: no deadlock, and every key gets its own sum.

Each value comes out of a custom operator that sleeps before writing it. On even
ranks early keys are slow, on odd ranks late keys are, so the engine finds the
keys ready in opposite orders. All keys have the same size: a store that took
its order from readiness would deadlock or silently sum different keys.

usage: kv_skew.py DESIGN
"""
import time

import mxnet as mx

import mpi_kvstore

from common import RANK, SIZE, close, design_arg, done

DESIGN = design_arg()
KEYS, ROUNDS = 40, 3


class Delayed(mx.operator.CustomOp):
    def __init__(self, delay, value):
        super().__init__()
        self.delay, self.value = delay, value

    def forward(self, is_train, req, in_data, out_data, aux):
        time.sleep(self.delay)
        self.assign(out_data[0], req[0], in_data[0] * 0 + self.value)

    def backward(self, req, out_grad, in_data, out_data, in_grad, aux):
        raise NotImplementedError


@mx.operator.register('delayed')
class DelayedProp(mx.operator.CustomOpProp):
    def __init__(self, delay, value):
        super().__init__(need_top_grad=False)
        self.delay, self.value = float(delay), float(value)

    def list_arguments(self):
        return ['data']

    def infer_shape(self, in_shape):
        return in_shape, [in_shape[0]], []

    def create_operator(self, ctx, shapes, dtypes):
        return Delayed(self.delay, self.value)


def delay_for(key, rnd):
    slow_first = (RANK + rnd) % 2 == 0
    position = key if slow_first else KEYS - 1 - key
    return 0.004 * (KEYS - position) / KEYS


def main():
    kv = mpi_kvstore.create('dist_mpi', design=DESIGN, fusion_threshold=4096)
    kv.init(list(range(KEYS)), [mx.nd.zeros((256,)) for _ in range(KEYS)])
    seed = mx.nd.zeros((256,))
    for rnd in range(ROUNDS):
        values = []
        for k in range(KEYS):
            value = (RANK + 1) * (k + 1) + rnd
            values.append(mx.nd.Custom(seed, op_type='delayed', delay=delay_for(k, rnd),
                                       value=value))
        for k in range(KEYS):                      # pushed in key order, like Trainer
            kv.pushpull(k, values[k], priority=-k)
        for k in range(KEYS):
            expected = SIZE * (SIZE + 1) / 2 * (k + 1) + SIZE * rnd
            close(values[k].asnumpy(), expected, 'round %d key %d' % (rnd, k))
    kv.wait()
    done('kv_skew[%s]' % DESIGN)


main()
