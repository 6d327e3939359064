"""A Horovod allreduce that the store rejects leaves its tensors as they were, prescale
factor or not (horovod.ops._allreduce_inplace: where a prescale stays an engine op, the call
is checked before that op changes a tensor). Rejected: a list with something that is no
NDArray, and a call made while an earlier collective's error waits to be raised. The
tensors then sum (scaled once) right on the next call. One process, so the sum is the value
itself times the factors, as numpy has it; at one rank every prescale is an op (_fold)."""
import mxnet as mx
import numpy as np
import pytest

import mpi_kvstore.horovod as hvd
from mpi_kvstore.errors import MPIKVStoreError

pytestmark = pytest.mark.unit

VALUES = [1, 2, 3]


@pytest.mark.parametrize('dtype', ['float32', 'int32', 'float16'])
def test_a_list_with_no_ndarray_leaves_the_tensors_unscaled(hvd_chained, dtype):
    a, b = mx.nd.array(VALUES, dtype=dtype), mx.nd.array(VALUES, dtype=dtype)
    with pytest.raises(TypeError, match='tensor 2 of 3'):
        hvd.grouped_allreduce_([a, b, np.ones(3)], prescale_factor=2.0, op=hvd.Sum)
    for t in (a, b):
        np.testing.assert_array_equal(t.asnumpy(), np.array(VALUES, dtype=dtype))
    hvd.grouped_allreduce_([a, b], prescale_factor=2.0, op=hvd.Sum)
    for t in (a, b):
        np.testing.assert_array_equal(t.asnumpy(), np.array(VALUES, dtype=dtype) * 2)


@pytest.mark.parametrize('dtype', ['float32', 'int32'])
def test_a_call_that_raises_an_earlier_error_leaves_its_tensor_unscaled(hvd_chained, dtype):
    a = mx.nd.array(VALUES, dtype=dtype)
    # an earlier collective's failure, waiting for the user's thread (as a design records it)
    hvd_chained._job.errors.record_error('an earlier allreduce', RuntimeError('failed earlier'))
    with pytest.raises(MPIKVStoreError, match='failed earlier'):
        hvd.allreduce_(a, name='a', prescale_factor=3.0, op=hvd.Sum)
    np.testing.assert_array_equal(a.asnumpy(), np.array(VALUES, dtype=dtype))
    hvd.allreduce_(a, name='a', prescale_factor=3.0, op=hvd.Sum)
    np.testing.assert_array_equal(a.asnumpy(), np.array(VALUES, dtype=dtype) * 3)
