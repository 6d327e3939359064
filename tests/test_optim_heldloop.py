"""The held loop's one-function path (store/heldloop.HeldLoop.again) declines a call whose
keys the full path would aim elsewhere, and then has changed nothing: keys.KeyTable.aimed
answers where aim would put a key's work without aiming it, and it is where aim puts it,
for a direct key (gluon.Trainer's loop: the gradient itself) and any other (the staging
buffer). One process, no MPI."""
import sys
import types

import mxnet as mx
import numpy as np
import pytest

from mpi_kvstore import config as cfg
from mpi_kvstore.store.contract import normalize
from mpi_kvstore.store.keys import KeyTable, same_array
from mpi_kvstore.store.optimizer import StoreOptimizer

pytestmark = pytest.mark.unit


def _table():
    """A key table with the store's optimizer, key 0 initialised to ``weights`` and planned
    for a pushpull of ``grad`` into ``weights`` (as gluon.Trainer's loop calls it)."""
    config = cfg.Config(environ={})
    keys = KeyTable(config)
    optimizer = StoreOptimizer(keys, config, 0, 1, job=None, run=None)
    optimizer.set(mx.optimizer.SGD(learning_rate=0.5))
    weights, grad = mx.nd.array([1.0, 2.0, 3.0]), mx.nd.array([0.5, 0.5, 0.5])
    keys.register(normalize(0, weights)[0]).stored()[:] = weights
    plan = keys.plan(normalize(0, grad, weights)[0], True)
    return keys, optimizer, plan, weights, grad


def _same(now, before):
    return all(a is b for a, b in zip(now, before))


@pytest.mark.parametrize('direct', [True, False])
def test_aimed_is_where_aim_puts_the_work_and_changes_nothing(direct):
    keys, _, plan, weights, grad = _table()
    state = plan.state
    before = (state.value, plan.work, plan.views, state._staging)
    found = keys.aimed(plan, direct)
    assert _same((state.value, plan.work, plan.views, state._staging), before)
    assert found is (grad if direct else state._staging) is not None
    keys.aim(plan, direct)
    assert plan.work is (grad if direct else state._staging) is not None
    assert keys.aimed(plan, direct) is plan.work
    # a direct key's value is then the Trainer's weights themselves
    assert same_array(state.value, weights) == direct


def _loop(optimizer, entry):
    """Stands for gluon.Trainer's loop: again's caller's caller's caller (Exchange.again,
    MPIKVStore.pushpull), the frame the optimizer holds."""
    optimizer._frame = _loop_frame()
    return _exchange(optimizer, entry)


def _loop_frame():
    return sys._getframe(1)


def _exchange(optimizer, entry):
    return _pushpull(optimizer, entry)


def _pushpull(optimizer, entry):
    return optimizer.again(entry, 0)


def test_again_declines_a_key_aimed_elsewhere_and_changes_nothing():
    keys, optimizer, plan, _, grad = _table()
    keys.aim(plan, False)          # prepared outside the Trainer's loop: the staging buffer
    state = plan.state
    before = (state.value, plan.work, plan.in_place, plan.views, state._staging)
    # an entry prepared on the gradient itself: the full path must prepare it anew
    entry = types.SimpleNamespace(plans=[plan], works=[grad], sharded=False, models=[],
                                  staged=[])
    optimizer._frame_last = 1      # the loop's last key is another
    assert _loop(optimizer, entry) is False
    assert _same((state.value, plan.work, plan.in_place, plan.views, state._staging), before)
    assert not optimizer.gate.holding and not optimizer.gate.reqs
    np.testing.assert_array_equal(state.value.asnumpy(), [1.0, 2.0, 3.0])
