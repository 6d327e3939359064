"""collectives.again_copy (hvd.allreduce repeated) once the input its name's record holds
weakly (_Copy) has died: the record's reference answers None, and so does getattr(tensor,
'handle', None) for anything without a handle (a numpy array, None). Such a call must go
to the full path (None from again_copy, nothing submitted), which says what is wrong, not
into copy_of with an array it cannot copy. One process."""
import gc
import weakref

import mxnet as mx
import numpy as np
import pytest

import mpi_kvstore

pytestmark = pytest.mark.unit

N = 64


@pytest.fixture
def kv():
    store = mpi_kvstore.create('dist_mpi', autotune='0')
    try:
        yield store
    finally:
        store.close()


def test_anything_without_a_handle_after_the_input_died_takes_the_full_path(kv):
    x = mx.nd.array(np.arange(N, dtype=np.float32))
    for _ in range(2):
        kv.collectives.allreduce_copy('c', x, True).wait_to_read()
    kv._job.wait()
    handle = weakref.ref(x.handle)
    del x
    gc.collect()
    assert handle() is None   # the record's input died
    count = len(kv._job.pending)
    for other in (np.arange(N, dtype=np.float32), None):
        assert kv.collectives.again_copy('c', other, True) is None
    assert len(kv._job.pending) == count
    y = mx.nd.array(np.arange(N, dtype=np.float32) + 1)   # and a live array: its own sum
    out = kv.collectives.allreduce_copy('c', y, True)
    np.testing.assert_array_equal(out.asnumpy(), np.arange(N, dtype=np.float32) + 1)
