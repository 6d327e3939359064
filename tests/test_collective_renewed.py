"""Collective.renewed (a prepared call's request made again, store/exchange.py) is what
the constructor makes from the same arguments: every read-only attribute equal, none of
what happened to the model carried over, and numbered like it (the same signature)."""
import mxnet as mx
import numpy as np
import pytest

from mpi_kvstore.comm.collective import Collective

pytestmark = pytest.mark.unit

ATTRS = ('kind', 'key', 'dtype', 'shape', 'nbytes', 'root', 'place', 'fn', 'average',
         'unit', 'codec', 'shard', 'in_place', 'mirror', 'seq', 'priority', 'sig', 'view',
         'scratch', 'completion', 'waiter', 'result', 'error', 'done')


def _args(array):
    return ('allreduce', 7, np.dtype('float32'), (4, 3), array, 0, None, True, 0, 48, None,
            'cpu', 1, None, False, True)


def test_renewed_is_what_the_constructor_makes():
    array = mx.nd.ones((4, 3))
    model = Collective(*_args(array))
    new, made = model.renewed(), Collective(*_args(array))
    for name in ATTRS:
        assert getattr(new, name) == getattr(made, name), name
    assert new.array is array and new.seq == -1 and not new.done
    new.number(5, -3)
    made.number(5, -3)
    assert (new.seq, new.priority, new.sig) == (5, -3, made.sig)
    assert model.seq == -1 and model.sig == Collective(*_args(array)).sig   # model untouched


def test_renewed_carries_nothing_that_happened():
    model = Collective(*_args(mx.nd.ones((4, 3))))
    used = model.renewed()
    used.number(0, 0)
    used.fail(RuntimeError('x'))
    used.finish()
    again = model.renewed()
    assert (again.error, again.done, again.seq, again.view, again.waiter) == (None, False, -1,
                                                                               None, None)
    assert used.error is not None and used.done


def test_again_is_renewed_numbered_and_waited_on():
    """Collective.again (the chained design's repeat, Chained.again) is renewed(), then
    number() and wait_with(), in one: every attribute equal, the model untouched."""
    array = mx.nd.ones((4, 3))
    model = Collective(*_args(array))

    def waiter(req, timeout):
        return True

    made = model.renewed()
    made.number(9, -4)
    made.wait_with(waiter)
    new = model.again(9, -4, model.numbered_sig(-4), waiter)
    for name in ATTRS:
        assert getattr(new, name) == getattr(made, name), name
    assert new.array is array and new.sig != model.sig and new.waiter is waiter
    assert model.seq == -1 and model.sig == Collective(*_args(array)).sig   # model untouched
    with pytest.raises(RuntimeError, match='already numbered'):
        new.number(10, -4)
