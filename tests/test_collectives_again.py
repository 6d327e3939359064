"""The named collectives' repeated calls (store/collectives.py: again, again_group,
again_copy, the Horovod API's one-function paths) submit requests renewed from models
(Collective.renewed) that are what the full path's first call submitted: every attribute
equal once numbered, the signature too (a group's models are made before the design
numbers its requests). An out-of-place call's record holds its input weakly: the input
dies with the caller's last reference, and the name's next call takes the full path and
sums right. One process, so every sum is the value itself, as numpy has it."""
import gc
import weakref

import mxnet as mx
import numpy as np
import pytest

import mpi_kvstore
from mpi_kvstore import debug

pytestmark = pytest.mark.unit

# what a request is, and its place once numbered (seq grows call by call: not compared)
ATTRS = ('kind', 'key', 'dtype', 'shape', 'nbytes', 'root', 'place', 'fn', 'average',
         'unit', 'codec', 'shard', 'in_place', 'mirror', 'priority', 'sig')
N = 64


@pytest.fixture
def kv():
    store = mpi_kvstore.create('dist_mpi', autotune='0')
    try:
        yield store
    finally:
        store.close()


def _submitted(kv, call):
    """call() made on the full path, and the requests it submitted (Job.submit, each of
    them numbered by the design)."""
    job, found = kv._job, []
    submit = job.submit

    def recorded(reqs, priority):
        found.extend(reqs)
        return submit(reqs, priority)

    job.submit = recorded
    try:
        return call(), found
    finally:
        del job.submit


def _last(kv, count=1):
    """The requests of the call just made: the job enters them last in its pending, by
    Job.submit or Job.again (which may renew them in the design: Design.again)."""
    return list(kv._job.pending)[-count:]


def _same(now, first, array=True):
    for name in ATTRS:
        assert getattr(now, name) == getattr(first, name), name
    assert now.seq > first.seq >= 0
    if array:
        assert now.array is first.array


def _values(step, k=0):
    return np.arange(N, dtype=np.float32) * (step + 1) + k


@pytest.mark.parametrize('mean', [False, True])
def test_again_submits_what_the_first_call_did(kv, mean):
    x = mx.nd.zeros((N,))
    x[:] = _values(0)
    _, (first,) = _submitted(kv, lambda: kv.collectives.allreduce(['a'], [x], average=mean))
    before = debug.snapshot()
    for step in range(1, 4):
        x[:] = _values(step)
        assert kv.collectives.again('a', x, mean)
        np.testing.assert_array_equal(x.asnumpy(), _values(step))
        _same(_last(kv)[0], first)
    assert debug.since(before, 'fastpath') == {'hit': 3}
    assert debug.since(before, 'named') == {'hit': 3}
    for step in range(4, 6):   # the list path's repeat (Collectives._repeat), the same
        x[:] = _values(step)
        kv.collectives.allreduce(['a'], [x], average=mean)
        np.testing.assert_array_equal(x.asnumpy(), _values(step))
        _same(_last(kv)[0], first)
    assert debug.since(before, 'fastpath') == {'hit': 5}
    assert not kv.collectives.again('a', x, not mean)   # another reduction: the full path
    assert not kv.collectives.again('a', mx.nd.zeros((N,)), mean)   # another array


def test_again_group_submits_what_the_first_call_did(kv):
    xs = [mx.nd.zeros((N + k,)) for k in range(3)]
    names = ['g.%d' % k for k in range(3)]
    for k, x in enumerate(xs):
        x[:] = _values(0, k)[:1].repeat(N + k)
    _, firsts = _submitted(kv, lambda: kv.collectives.allreduce(names, xs, group='g'))
    assert len(firsts) == 3
    before = debug.snapshot()
    for step in range(1, 3):
        for k, x in enumerate(xs):
            x[:] = float(step * 10 + k)
        assert kv.collectives.again_group('g', xs, False)
        now = _last(kv, 3)
        for req, first in zip(now, firsts):
            _same(req, first)   # the signature as the first call's: numbered once
        for k, x in enumerate(xs):
            np.testing.assert_array_equal(x.asnumpy(), np.full(N + k, step * 10 + k, np.float32))
    assert debug.since(before, 'again') == {'group': 2}
    assert debug.since(before, 'fastpath') == {'hit': 6}
    assert not kv.collectives.again_group('g', xs[:2], False)


def test_again_copy_submits_what_the_first_call_did_into_a_new_array(kv):
    x = mx.nd.array(_values(0))
    out, (first,) = _submitted(kv, lambda: kv.collectives.allreduce_copy('c', x, True))
    assert first.array is out
    before = debug.snapshot()
    outs = []
    for step in range(1, 4):
        x[:] = _values(step)
        outs.append(kv.collectives.allreduce_copy('c', x, True))
        now, = _last(kv)
        _same(now, first, array=False)
        assert now.array is outs[-1] and outs[-1] is not x
    for step, got in enumerate(outs, 1):   # each call's copy, its own values
        np.testing.assert_array_equal(got.asnumpy(), _values(step))
    np.testing.assert_array_equal(x.asnumpy(), _values(3))   # the input as it was
    assert debug.since(before, 'again') == {'copy': 3}
    assert debug.since(before, 'fastpath') == {'hit': 3}
    # anything but the very input under the name: the full path (None), nothing submitted
    count = len(kv._job.pending)
    for other in (x.copy(), x.asnumpy(), None):
        assert kv.collectives.again_copy('c', other, True) is None
    assert len(kv._job.pending) == count


def test_an_out_of_place_record_keeps_no_input_alive(kv):
    x = mx.nd.array(_values(0))
    for _ in range(2):
        kv.collectives.allreduce_copy('c', x, False).wait_to_read()
    kv._job.wait()
    handle = weakref.ref(x.handle)
    del x
    gc.collect()
    assert handle() is None   # freed: the cache held it weakly
    y = mx.nd.array(_values(5))
    before = debug.snapshot()
    out = kv.collectives.allreduce_copy('c', y, False)
    assert debug.since(before, 'fastpath') == {'miss': 1}   # not the dead input's record
    np.testing.assert_array_equal(out.asnumpy(), _values(5))
    out = kv.collectives.allreduce_copy('c', y, False)   # y's own record now
    assert debug.since(before, 'again') == {'copy': 1}
    np.testing.assert_array_equal(out.asnumpy(), _values(5))


def test_anything_without_a_handle_after_the_input_died_takes_the_full_path(kv):
    """collectives.again_copy (hvd.allreduce repeated) once the input its name's record holds
    weakly (_Copy) has died: the record's reference answers None, and so does getattr(tensor,
    'handle', None) for anything without a handle (a numpy array, None). Such a call must go
    to the full path (None from again_copy, nothing submitted), which says what is wrong, not
    into copy_of with an array it cannot copy. One process."""
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
