"""The prepared path of repeated calls (store/exchange.Exchange.replay, the named allreduce's
in store/collectives.py, engine/records.Prepared): in one process, a record taken again only
once its op is done and cleared of what that op wrote, storage ids that tell views apart, a
call of lists of arrays (gluon.Trainer's) matched only on the very arrays in its form; and
scenarios/kv_fastpath.py on every design at 2 and 3 ranks: bursts of mixed sizes, dtypes,
priorities and APIs, repeated on the same arrays, sum as numpy does and take the prepared path
from their second call; another array, dtype, shape, context or priority falls back; a
mismatch beside prepared calls fails on every rank naming both shapes; an array and its view
in one pushpull raise ValueError at once instead of hanging.
"""
import pytest

from mpi_kvstore.designs import NAMES

from mpi_harness import result, run_designs


class _Req:
    def __init__(self, done):
        self.done = done


def test_a_prepared_record_is_taken_again_only_once_its_op_is_done_and_cleared():
    import mxnet as mx

    from mpi_kvstore.engine import layout as L
    from mpi_kvstore.engine.records import Prepared

    arrays = [mx.nd.ones((4,)), mx.nd.ones((3,))]
    owner = object()
    prepared = Prepared(arrays, owner)
    assert prepared.handles.count == 2 and prepared.owner is owner
    first = prepared.op([_Req(False)], eventfd=7)
    rec = first.record
    assert list(rec[L.HEADER + L.A_HANDLE::L.SLOT]) == [a.handle.value for a in arrays]
    rec[L.STATE], rec[L.HEADER + L.A_MANAGED], rec[L.HEADER + L.SLOT + L.A_MANAGED] = L.READY, 5, 6
    # its request is not done: a new record, the old one untouched
    second = prepared.op([_Req(True)], eventfd=7)
    assert second is not first and rec[L.STATE] == L.READY
    second.record[L.STATE] = L.DONE
    second.record[L.HEADER + L.A_MANAGED] = 9
    third_reqs = [_Req(False)]
    third = prepared.op(third_reqs, eventfd=7)   # done: the same record, cleared
    assert third is second and third.reqs is third_reqs
    assert third.record[L.STATE] == L.PENDING and third.record[L.HEADER + L.A_MANAGED] == 0
    assert third.address == third.record.ctypes.data
    third_reqs[0].done = True
    assert prepared.op([_Req(False)], eventfd=8) is not third   # another eventfd: a new one


def test_storage_ids_tell_views_from_other_arrays():
    import mxnet as mx

    from mpi_kvstore.engine.arrays import storage_of

    x, y = mx.nd.zeros((8,)), mx.nd.zeros((8,))
    ids = {storage_of(a) for a in (x, x[2:4], x.reshape((2, 4)), x.detach())}
    assert len(ids) == 1 and None not in ids
    assert storage_of(y) not in ids


def test_a_call_of_lists_of_arrays_matches_only_the_very_arrays_in_the_same_form():
    import mxnet as mx

    from mpi_kvstore.store.namecache import CallCache

    calls = CallCache()
    grad, other, weight = mx.nd.ones((3,)), mx.nd.ones((3,)), mx.nd.ones((3,))
    # gluon.Trainer's form: pushpull(i, param.list_grad(), out=param.list_data())
    calls.remember('pushpull', 1, [grad], [weight], ['plan'])
    found = calls.find('pushpull', 1, [grad], [weight])
    assert found is not None and found.plans == ['plan']
    assert calls.find('pushpull', 1, (grad,), (weight,)) is found   # a tuple is the same form
    for value, out in (([other], [weight]), ([grad], None), ([grad, grad], [weight]),
                       ([grad], [[weight]]), ([grad], [weight, weight]), (grad, [weight]),
                       ([grad], [other])):
        assert calls.find('pushpull', 1, value, out) is None, (value, out)
    calls.remember('pushpull', 2, [grad, other], None, ['two'])
    assert calls.find('pushpull', 2, [grad, other], None).plans == ['two']
    assert calls.find('pushpull', 2, [other, grad], None) is None
    assert calls.find('pushpull', 2, [grad, other], [weight, weight]) is None
    calls.remember('pushpull', 3, [[grad, other]], [weight], ['nested'])
    assert calls.find('pushpull', 3, [[grad, other]], [weight]).plans == ['nested']
    assert calls.find('pushpull', 3, [grad, other], [weight]) is None


def check(out, design, nprocs):
    assert 'kv_fastpath[%s]: OK at %d ranks' % (design, nprocs) in out, out[-3000:]
    sums = result(out, 'kv_fastpath[%s]' % design)['ranks']
    for rank, seen in enumerate(sums):
        steps = [what for what in seen['checked'] if what.startswith('step')]
        assert len(steps) >= 40, (rank, len(steps))
        for what, got in seen['checked'].items():
            assert got == seen['expected'][what], (rank, what, got, seen['expected'][what])
    info = result(out, 'kv_fastpath_info')['ranks']
    hit, miss = {'hit': 1}, {'miss': 1}
    fallback = {'kv 0': {}, 'kv 1': hit, 'kv 2': hit, 'kv priority': miss,
                'kv priority again': hit, 'kv array': {}, 'kv array again': hit, 'kv back': {},
                'kv context': {}, 'kv context again': hit, 'hvd 0': miss, 'hvd 1': hit,
                'hvd 2': hit, 'hvd shape': miss, 'hvd shape again': hit, 'hvd dtype': miss,
                'hvd dtype again': hit, 'hvd context': miss, 'hvd context again': hit,
                'hvd average': miss, 'hvd average again': hit, 'hvd copy': miss,
                'hvd copy again': hit}
    shapes = ["rank 0 has key 'm3' shape (4,) float32"] + [
        "rank %d has key 'm_odd' shape (%d,) float32" % (r, 4 + r) for r in range(1, nprocs)]
    for rank, said in enumerate(info):
        assert len(said['hits']) >= 3, said['hits']
        for hits, misses, expected in said['hits']:   # steps 2-4: every call prepared
            assert (hits, misses) == (expected, 0), said['hits']
        assert said['fallback'] == fallback, (rank, said['fallback'])
        assert said['mismatch'] is not None and 'ranks disagree on' in said['mismatch']
        for words in shapes:
            assert words in said['mismatch'], (rank, words, said['mismatch'])
        assert said['mismatch_hits'] == {'hit': 4 if rank == 0 else 3}, said
        assert said['views'] is not None and 'share memory' in said['views'], said
        assert "'v1' and 'v2'" in said['views'], said


@pytest.mark.parametrize('design', NAMES)
def test_repeated_calls_take_the_prepared_path_and_sum_right(design, designs):
    out = run_designs(2, 'kv_fastpath.py', design, designs, '8', timeout=240)
    check(out, design, 2)


@pytest.mark.parametrize('design', NAMES)
def test_prepared_calls_at_three_ranks(design, designs):
    out = run_designs(3, 'kv_fastpath.py', design, designs, '4', timeout=300)
    check(out, design, 3)
