"""engine.records.CopyNow, the copy an out-of-place repeat makes at its push (store/
collectives.py again_copy): an input nothing writes is copied before copy() returns (True),
the new array holding its values and no op pending on it; an input an engine op still writes
is copied after that write by MXNet's copy (False), and the copy op pushed meanwhile, run
later on an engine worker, writes nothing. Inputs are left as they were. One process."""
import time

import mxnet as mx
import numpy as np
import pytest

from mpi_kvstore.engine import core as engine
from mpi_kvstore.engine.arrays import Blank
from mpi_kvstore.engine.records import CopyNow

pytestmark = pytest.mark.unit


@pytest.mark.parametrize('shape, dtype', [((4096,), 'float32'), ((7, 9), 'float64'),
                                          ((300,), 'int32'), ((5,), 'uint8')])
def test_a_readable_input_is_copied_at_the_push(shape, dtype):
    values = (np.arange(int(np.prod(shape))).reshape(shape) % 11 + 3).astype(dtype)
    x = mx.nd.array(values, dtype=dtype)
    x.wait_to_read()
    blank = Blank(x)
    out = blank.new()
    assert out.shape == shape and np.dtype(out.dtype) == np.dtype(dtype)
    assert CopyNow().copy(x, out, values.nbytes) is True
    np.testing.assert_array_equal(out.asnumpy(), values)
    np.testing.assert_array_equal(x.asnumpy(), values)
    # each copy into an array of its own
    second = blank.new()
    assert second.handle.value != out.handle.value
    x[:] = values + 1
    x.wait_to_read()
    assert CopyNow().copy(x, second, values.nbytes) is True
    np.testing.assert_array_equal(second.asnumpy(), values + 1)
    np.testing.assert_array_equal(out.asnumpy(), values)


def test_an_input_being_written_is_copied_after_the_write():
    values = np.arange(1000, dtype=np.float32)
    x = mx.nd.array(values)
    x.wait_to_read()
    held = []
    # an op that writes x and completes only when told: x is busy at the copy's push
    engine.push(held.append, mutable=[x])
    copier = CopyNow()
    out = Blank(x).new()
    assert copier.copy(x, out, values.nbytes) is False
    # the record is free for the next copy at once, whatever the queued op does later
    y = mx.nd.array(values * 2)
    y.wait_to_read()
    other = Blank(y).new()
    assert copier.copy(y, other, values.nbytes) is True
    deadline = time.monotonic() + 30
    while not held and time.monotonic() < deadline:   # the engine worker runs the holding op
        time.sleep(1e-3)
    assert held, 'the engine never ran the op that writes x'
    held[0].done()
    np.testing.assert_array_equal(out.asnumpy(), values)
    np.testing.assert_array_equal(other.asnumpy(), values * 2)
    np.testing.assert_array_equal(x.asnumpy(), values)
