"""Out-of-place hvd.allreduce keeps no caller's result alive for a name called once
(store/collectives.py _Copy: the prepared call that each repeat moves to its new copy is
made at the name's first repeat, not at its first call). A loop that names its call per
step (hvd.allreduce(x, name='loss%d' % step)) and drops each result frees them, as it did
before the repeats moved their prepared call; a repeated name still sums right, each result
its own array. One process, so every sum is the value itself, as numpy has it."""
import gc
import weakref

import mxnet as mx
import numpy as np
import pytest

import mpi_kvstore.horovod as hvd
from mpi_kvstore import debug

pytestmark = pytest.mark.unit

STEPS = 20


@pytest.fixture(params=['chained', 'funneled'])
def world(request):
    hvd.init(design=request.param, autotune='0')
    try:
        yield
    finally:
        hvd.shutdown()


def test_results_of_names_called_once_are_freed(world):
    x = mx.nd.arange(8)
    refs = []
    for step in range(STEPS):
        out = hvd.allreduce(x, name='loss%d' % step, op=hvd.Sum)
        np.testing.assert_array_equal(out.asnumpy(), np.arange(8))
        refs.append(weakref.ref(out.handle))   # an NDArray takes no weak reference
        del out
    mx.nd.waitall()
    gc.collect()
    # (the last call's result may stay with the design's last op until the next call)
    assert [r() is None for r in refs[:-1]] == [True] * (STEPS - 1)


def test_a_repeated_name_still_sums_right_into_its_own_results(world):
    x = mx.nd.zeros((8,))
    outs = []
    before = debug.snapshot()
    for step in range(6):
        x[:] = np.arange(8) + step
        outs.append(hvd.allreduce(x, name='again', op=hvd.Sum))
    assert debug.since(before, 'again') == {'copy': 5}
    for step, out in enumerate(outs):
        np.testing.assert_array_equal(out.asnumpy(), np.arange(8) + step)
