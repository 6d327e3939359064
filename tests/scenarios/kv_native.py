"""No Python on MXNet's engine threads: funneled and concurrent mark collectives ready
with a compiled op (numba), so the ctypes trampoline is never entered; with
MPI_KVSTORE_NATIVE_OPS=0 (the control) it is entered once per call. An MKLDNN-layout
array still fails loudly, and the sums are right either way.

usage: kv_native.py DESIGN (0|1: native ops)
"""
import sys

import mxnet as mx
from mxnet import gluon

import mpi_kvstore
from mpi_kvstore import engine
from common import RANK, SIZE, close, design_arg, done, expect_raises

DESIGN = design_arg()
NATIVE = sys.argv[2] == '1'
CALLS = 200


def pushpulls(kv):
    """CALLS calls, half with data still being computed (the op queues on an engine
    worker), half with data ready (the op runs inline on this thread)."""
    grads = [mx.nd.ones((256,)) for _ in range(4)]
    for step in range(CALLS // 2):
        for i, grad in enumerate(grads):   # written by an op just pushed: not ready yet
            mx.nd.ones((256,), out=grad)
        kv.pushpull(list(range(4)), grads)
        kv.wait()
        ready = mx.nd.ones((64,)) * (RANK + 1)
        ready.wait_to_read()
        kv.pushpull('ready', ready)
        close(ready.asnumpy(), SIZE * (SIZE + 1) / 2, 'ready pushpull %d' % step)
    close(grads[0].asnumpy(), SIZE, 'queued pushpull')


def mkldnn_weight_fails_loudly(kv):
    """A conv weight after an inference-mode forward sits in an MKLDNN layout."""
    net = gluon.nn.Conv2D(8, 3, in_channels=3)
    net.initialize(mx.init.One())
    net(mx.nd.ones((1, 3, 8, 8))).wait_to_read()
    weight = net.weight.data()
    expect_raises(mpi_kvstore.MPIKVStoreError, lambda: kv.pushpull('w', weight) or kv.wait(),
                  contains='cannot be read in place')


def main():
    kv = mpi_kvstore.create('dist_mpi', design=DESIGN, native_ops=NATIVE)
    kv.pushpull('warm', mx.nd.ones((4,)))
    kv.wait()
    before = engine.trampoline_calls()
    pushpulls(kv)
    entered = engine.trampoline_calls() - before
    if NATIVE:
        assert entered == 0, 'rank %d: %d engine ops ran Python code' % (RANK, entered)
    else:  # the control: the same calls through the Python op do enter it
        assert entered >= CALLS, 'rank %d: only %d trampoline entries' % (RANK, entered)
    mkldnn_weight_fails_loudly(kv)
    print('rank %d: %d trampoline entries for %d calls' % (RANK, entered, CALLS), flush=True)
    done('kv_native[%s, native=%d]' % (DESIGN, NATIVE))


main()
