"""The store's updater (optim/batched.py) gives bitwise MXNet's own Updater's weights and
states, step after step, for MXNet's SGD called with lists of keys (a step's batch), and
runs the kept groups from the second such call on (``planned``): plain SGD, momentum, weight
decay, gradient clipping, a learning-rate schedule and multipliers, several dtypes, the
aggregate_num of MXNET_OPTIMIZER_AGGREGATION_SIZE and others; when the arrays, states,
optimizer or aggregate_num change it makes the groups anew, and anything it does not plan
(another optimizer, multi_precision, one key, a key's first update) is MXNet's Updater."""
import pickle

import mxnet as mx
import numpy as np
import pytest

from mpi_kvstore.optim.batched import Updater
from mpi_kvstore.optim.shards import leaves

pytestmark = pytest.mark.unit

SHAPES = [(16, 8), (8,), (4, 4), (3,), (32,), (2, 2, 2)]


def arrays(seed, dtypes=('float32',)):
    rng = np.random.RandomState(seed)
    return [mx.nd.array(rng.uniform(-1, 1, shape), dtype=dtypes[i % len(dtypes)])
            for i, shape in enumerate(SHAPES)]


def pair(make, dtypes=('float32',), keys=None):
    """Two updaters of equal optimizers, theirs (MXNet's) and ours, and each one's weights."""
    keys = list(range(len(SHAPES))) if keys is None else keys
    return [(updater(make()), arrays(0, dtypes)) for updater in (mx.optimizer.Updater,
                                                                   Updater)], keys


def step(updaters, keys, seed, dtypes=('float32',)):
    grads = arrays(seed, dtypes)
    for updater, weights in updaters:
        updater(keys, grads, weights)
    return grads


def assert_same(updaters, what):
    (theirs, w_theirs), (ours, w_ours) = updaters
    for i, (a, b) in enumerate(zip(w_theirs, w_ours)):
        assert a.dtype == b.dtype
        assert np.array_equal(a.asnumpy(), b.asnumpy()), '%s: weight %d differs' % (what, i)
    assert theirs.states.keys() == ours.states.keys()
    for key in theirs.states:
        mine = leaves(ours.states[key])
        assert len(mine) == len(leaves(theirs.states[key]))
        for a, b in zip(leaves(theirs.states[key]), mine):
            assert np.array_equal(a.asnumpy(), b.asnumpy()), '%s: state %r differs' % (what, key)
    assert theirs.optimizer._index_update_count == ours.optimizer._index_update_count
    assert theirs.optimizer.num_update == ours.optimizer.num_update


SGDS = {
    'plain': dict(learning_rate=0.1),
    'momentum_wd': dict(learning_rate=0.1, momentum=0.9, wd=1e-3),
    'clip_rescale': dict(learning_rate=0.05, momentum=0.5, clip_gradient=0.3,
                         rescale_grad=1 / 6),
    'schedule': dict(learning_rate=0.1, momentum=0.9,
                     lr_scheduler=mx.lr_scheduler.FactorScheduler(step=2, factor=0.5)),
}


@pytest.mark.parametrize('aggregate', [None, 1, 3, 60])
@pytest.mark.parametrize('kind', sorted(SGDS))
def test_sgd_batches_equal_mxnet_bitwise(kind, aggregate, monkeypatch):
    if aggregate is None:
        monkeypatch.delenv('MXNET_OPTIMIZER_AGGREGATION_SIZE', raising=False)
    else:
        monkeypatch.setenv('MXNET_OPTIMIZER_AGGREGATION_SIZE', str(aggregate))

    def make():
        params = dict(SGDS[kind])
        if 'lr_scheduler' in params:   # a scheduler each: it keeps its own state
            params['lr_scheduler'] = mx.lr_scheduler.FactorScheduler(step=2, factor=0.5)
        opt = mx.optimizer.SGD(**params)
        opt.set_lr_mult({1: 0.5})
        opt.set_wd_mult({2: 3.0})
        return opt

    updaters, keys = pair(make)
    assert updaters[1][0].optimizer.aggregate_num == (4 if aggregate is None else aggregate)
    for seed in range(1, 6):
        step(updaters, keys, seed)
        assert_same(updaters, '%s step %d' % (kind, seed))
    # the first call makes the states (MXNet's Updater), the others run the kept groups
    assert updaters[1][0].planned == 4


def test_dtypes_group_as_mxnet_groups_them():
    dtypes = ('float32', 'float64', 'float16')
    updaters, keys = pair(lambda: mx.optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=1e-4),
                          dtypes)
    for seed in range(1, 4):
        step(updaters, keys, seed, dtypes)
        assert_same(updaters, 'dtypes step %d' % seed)
    assert updaters[1][0].planned == 2


def test_changes_make_the_groups_anew():
    updaters, keys = pair(lambda: mx.optimizer.SGD(learning_rate=0.1, momentum=0.9))
    ours = updaters[1][0]
    step(updaters, keys, 1)
    step(updaters, keys, 2)
    plan = ours._plan
    # other weight arrays (equal values): new groups
    updaters = [(u, [w.copy() for w in weights]) for u, weights in updaters]
    step(updaters, keys, 3)
    assert ours._plan is not plan
    assert_same(updaters, 'new arrays')
    # aggregate_num and momentum changed between steps
    for updater, _ in updaters:
        updater.optimizer.aggregate_num = 2
    step(updaters, keys, 4)
    # MXNet's groups of 2, run by one operator
    assert [len(part) for part in ours._plan.parts] == [2, 2, 2]
    assert [len(g.indices) for g in ours._plan.groups] == [6]
    assert_same(updaters, 'aggregate_num 2')
    # the states loaded from MXNet's own: a new state table
    saved = updaters[0][0].get_states(dump_optimizer=False)
    for updater, _ in updaters:
        updater.set_states(saved)
    step(updaters, keys, 5)
    assert_same(updaters, 'loaded states')
    # a subset of the keys, then the whole list again
    grads = arrays(6)
    for updater, weights in updaters:
        updater(keys[:3], grads[:3], weights[:3])
    step(updaters, keys, 7)
    assert_same(updaters, 'subset')
    # every call but the first (no states yet) and the one after set_states (MXNet's
    # Updater syncs the loaded states first)
    assert ours.planned == 5


def test_what_is_not_planned_is_mxnets():
    makes = {'adam': lambda: mx.optimizer.Adam(learning_rate=0.01, wd=1e-3),
             'multi_precision': lambda: mx.optimizer.SGD(learning_rate=0.1, momentum=0.9,
                                                         multi_precision=True),
             'nag': lambda: mx.optimizer.NAG(learning_rate=0.1, momentum=0.9)}
    for name, make in makes.items():
        updaters, keys = pair(make)
        for seed in range(1, 4):
            step(updaters, keys, seed)
            assert_same(updaters, name)
        assert updaters[1][0].planned == 0, name
    # one key a call (store.keys.KeyTable.deliver): MXNet's Updater
    updaters, keys = pair(lambda: mx.optimizer.SGD(learning_rate=0.1, momentum=0.9))
    for seed in range(1, 4):
        grads = arrays(seed)
        for updater, weights in updaters:
            for key in keys:
                updater(key, grads[key], weights[key])
        assert_same(updaters, 'one key a call')
    assert updaters[1][0].planned == 0


def test_a_bad_call_raises_as_mxnet_does():
    updaters, keys = pair(lambda: mx.optimizer.SGD(learning_rate=0.1, momentum=0.9))
    step(updaters, keys, 1)
    grads = arrays(2)
    grads[0] = mx.nd.zeros((3, 3))
    for updater, weights in updaters:
        with pytest.raises(mx.base.MXNetError):
            updater(keys, grads, weights)
            mx.nd.waitall()


def test_the_updater_pickles_without_its_groups():
    updaters, keys = pair(lambda: mx.optimizer.SGD(learning_rate=0.1, momentum=0.9))
    step(updaters, keys, 1)
    step(updaters, keys, 2)
    ours = updaters[1][0]
    assert ours._plan is not None
    copy = pickle.loads(pickle.dumps(ours))
    assert copy._plan is None and copy.planned == ours.planned


@pytest.mark.parametrize('aggregate', [4, 7])
def test_many_keys_run_60_an_operator_bitwise(aggregate, monkeypatch):
    """130 keys of two dtypes: each dtype's keys in MXNet's order, 60 an operator (the
    kernel's limit), asked for MXNet's groups' counts and rates (under a schedule): the very
    weights and states of MXNet's Updater, whose operators take aggregate_num keys each."""
    monkeypatch.setenv('MXNET_OPTIMIZER_AGGREGATION_SIZE', str(aggregate))
    rng = np.random.RandomState(0)
    shapes = [(rng.randint(1, 5), rng.randint(1, 5)) for _ in range(130)]
    dtypes = ['float64' if i % 3 == 0 else 'float32' for i in range(130)]

    def weights(seed):
        r = np.random.RandomState(seed)
        return [mx.nd.array(r.uniform(-1, 1, shape), dtype=dtype)
                for shape, dtype in zip(shapes, dtypes)]

    def make():
        return mx.optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=1e-3,
                                lr_scheduler=mx.lr_scheduler.FactorScheduler(step=1, factor=0.7))

    updaters = [(mx.optimizer.Updater(make()), weights(1)), (Updater(make()), weights(1))]
    keys = list(range(130))
    for seed in range(2, 6):
        grads = weights(seed)
        for updater, w in updaters:
            updater(keys, grads, w)
        assert_same(updaters, 'aggregate %d step %d' % (aggregate, seed))
    ours = updaters[1][0]
    assert ours.planned == 3
    # float64 first (key 0): its 44 keys one operator; float32's 86: 60 and 26
    assert [len(group.indices) for group in ours._plan.groups] == [44, 60, 26]
    assert sum(len(part) for part in ours._plan.parts) == 130
