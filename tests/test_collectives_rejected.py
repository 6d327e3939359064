"""A grouped allreduce rejected partway (a tensor of the list is no NDArray) leaves the
store as it was: no record (_Again, _Copy, a group's) of the call that never ran, so the
names' next, good call takes the path a first call takes (every tensor a miss, no group
hit) and sums right; the error names the tensor and what it is. Records are kept only once
every request is submitted (a submit that raises partway keeps none). One process, so
every sum is the value itself, as numpy has it."""
import mxnet as mx
import numpy as np
import pytest

import mpi_kvstore
import mpi_kvstore.horovod as hvd
from mpi_kvstore import debug

pytestmark = pytest.mark.unit

N = 16


def _arrays(seed, count=3):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(N).astype(np.float32) for _ in range(count)]


@pytest.fixture
def world():
    hvd.init()
    try:
        yield hvd.global_process_set._store
    finally:
        hvd.shutdown()


@pytest.mark.parametrize('bad, what', [(np.ones(N, np.float32), 'ndarray'),
                                       (None, 'NoneType'), ([1.0] * N, 'list')])
@pytest.mark.parametrize('op', [hvd.Sum, hvd.Average])
def test_a_rejected_grouped_allreduce_leaves_no_record(world, bad, what, op):
    first, middle, last = _arrays(1)
    tensors = [mx.nd.array(first), bad, mx.nd.array(last)]
    with pytest.raises(TypeError, match=r"tensor 1 of 3 \(name 'g\.1'\) is a %s, not an "
                                        r"MXNet NDArray" % what):
        hvd.grouped_allreduce_(tensors, op=op, name='g')
    kept = world.collectives
    assert [n for n in kept._again._entries if n.startswith('g')] == []
    assert 'g' not in kept._groups._entries

    good = [tensors[0], mx.nd.array(middle), tensors[2]]
    before = debug.snapshot()
    hvd.grouped_allreduce_(good, op=op, name='g')
    for got, want in zip(good, (first, middle, last)):
        np.testing.assert_allclose(got.asnumpy(), np.sum([want], axis=0), rtol=1e-6)
    # as a first call: three misses, no repeat of the record a rejected call would have left
    assert debug.since(before, 'fastpath') == {'miss': 3}
    assert 'group' not in debug.since(before, 'again')

    values = [t.asnumpy() for t in good]   # and the next call is the repeat, whole
    before = debug.snapshot()
    hvd.grouped_allreduce_(good, op=op, name='g')
    for got, want in zip(good, values):
        np.testing.assert_allclose(got.asnumpy(), want, rtol=1e-6)
    assert debug.since(before, 'again') == {'group': 1}


# A list without a group goes as one op a tensor: the second submit fails partway. A group
# of distinct dense tensors goes as one op (allreduce's one_op): its one submit fails.
@pytest.mark.parametrize('group, fails_at', [(None, 2), ('s', 1)])
def test_a_submit_that_raises_partway_keeps_no_record(monkeypatch, group, fails_at):
    kv = mpi_kvstore.create('dist_mpi', autotune='0')
    try:
        values = _arrays(2)
        tensors = [mx.nd.array(v) for v in values]
        submit, calls = kv._job.submit, []

        def failing(reqs, priority):
            calls.append(len(reqs))
            if len(calls) == fails_at:
                raise RuntimeError('submit refused: injected')
            return submit(reqs, priority)

        monkeypatch.setattr(kv._job, 'submit', failing)
        names = ['s.%d' % i for i in range(3)]
        with pytest.raises(RuntimeError, match='injected'):
            kv.collectives.allreduce(names, tensors, group=group)
        assert calls == [1] * fails_at if group is None else calls == [3]
        monkeypatch.undo()
        kv._job.wait()
        assert not any(n in kv.collectives._again._entries for n in names)
        assert 's' not in kv.collectives._groups._entries
        before = debug.snapshot()
        kv.collectives.allreduce(names, tensors, group=group)
        for got, want in zip(tensors, values):
            np.testing.assert_allclose(got.asnumpy(), want, rtol=1e-6)
        assert debug.since(before, 'fastpath') == {'miss': 3}
    finally:
        kv.close()
