"""The one-function path of repeated calls: scenarios/kv_again.py on every design at 2 ranks.
kv.pushpull (in place, out omitted, into another array, a list of keys), kv.push then
kv.pull (one function too: MPIKVStore.pull), and hvd.grouped_allreduce_ (Sum, Average) sum
as numpy does over 4 steps on the same arrays; the 'again' debug counter shows the
one-function path taken from the third call of a key (the second prepares it) and from the
second of a group or a pull; another array, a context, a priority, compression, a pull into
another array or a list, and a group whose tensors changed or share storage fall back to the
full path and sum right; a new shape for a key raises ValueError. scenarios/kv_copy.py: the
same for the out-of-place allreduces (hvd.allreduce, mpi_kvstore.allreduce).
"""
import pytest

from mpi_kvstore.designs import NAMES

from mpi_harness import result, run_designs

PREPARED = {'pushpull': 10, 'push': 3, 'group': 2, 'pull': 3}   # calls a step, once prepared


@pytest.mark.parametrize('design', NAMES)
def test_repeated_calls_are_one_function_and_sum_right(design, designs):
    out = run_designs(2, 'kv_again.py', design, designs, timeout=240)
    name = 'kv_again[%s]' % design
    assert '%s: OK at 2 ranks' % name in out, out[-3000:]
    for rank in result(out, name)['ranks']:
        assert rank['counts'] == [{}, {'group': 2, 'pull': 3}, PREPARED, PREPARED], \
            rank['counts']
        fell = rank['fallback']
        assert fell.pop('same') == {'pushpull': 1}
        assert fell.pop('again') == {'pushpull': 1}
        assert fell.pop('pull 0') == {}
        # from its second call into the same array, a pull is one function
        assert fell.pop('pull 1') == fell.pop('pull 2') == {'pull': 1}
        assert fell == {k: {} for k in fell} and len(fell) == 10, fell
        assert rank['raised'] == ['ValueError']
        checked, expected = rank['checked'], rank['expected']
        assert len(checked) >= 4 * 20
        for what, (shape, total) in checked.items():
            assert shape == expected[what][0], what
            assert total == pytest.approx(expected[what][1], rel=1e-6), what


COPY = [{}, {'copy': 1}, {'copy': 1}]   # a name's first call, then its one-function path


@pytest.mark.parametrize('design', NAMES)
def test_out_of_place_allreduce_again_is_one_function_and_sums_right(design, designs):
    """scenarios/kv_copy.py: hvd.allreduce and mpi_kvstore.allreduce called again on the
    very same input take Collectives.again_copy from their second call; another input, shape,
    dtype, context or op falls back to the full path and is taken again from its second
    call, as do an integer average and a scale factor (folded into the reduction, the record
    keyed by them: horovod.ops._fold); every result (a new
    array each call) equals numpy's sum and the input is left as it was. A repeated call
    meeting another shape fails on every rank naming both shapes, and the name goes on."""
    out = run_designs(2, 'kv_copy.py', design, designs, timeout=240)
    name = 'kv_copy[%s]' % design
    assert '%s: OK at 2 ranks' % name in out, out[-3000:]
    for rank, seen in enumerate(result(out, name)['ranks']):
        assert seen['fallback'] == {
            'sum': COPY, 'average': COPY, 'array': COPY, 'back': [{}], 'shape': COPY,
            'dtype': COPY, 'context': COPY, 'int average': COPY, 'postscale': COPY,
            'functional': COPY, 'functional mean': COPY}, (rank, seen['fallback'])
        said = seen['mismatch']
        assert 'rank 0 has shape (16,) float32' in said, said
        assert 'rank 1 has shape (17,) float32' in said, said
        assert seen['raised'] == ['RankMismatchError']
        # rank 0 repeated its call; rank 1's other array took the full path. Where the
        # call itself raises (blocking: the agreement runs in the call), the rejected call
        # leaves the name's record as it was (5495b77), so rank 1's next call on the first
        # array is a repeat; elsewhere the call was submitted and its array became the
        # record, so that next call takes the full path again
        assert seen['mismatch_again'] == ({'copy': 1} if rank == 0 else {})
        kept = rank == 0 or design == 'blocking'
        assert seen['after'] == ([{'copy': 1}] * 2 if kept else [{}, {'copy': 1}])
        assert len(seen['checked']) >= 60
        for what, got in seen['checked'].items():
            shape, total = seen['expected'][what]
            assert got[0] == shape, what
            assert got[1] == pytest.approx(total, rel=1e-6), what
