"""The DistributedTrainers update with the store's updater (optim.batched.Updater): the very
weights of a gluon.Trainer running MXNet's own Updater on the same gradients, bitwise, step
after step (momentum, weight decay, a learning-rate schedule and multipliers, parameters
initialised again in new arrays), with MXNet's groups run up to 60 keys an operator (130 keys: 3
operators where MXNet pushes 33). Horovod's DistributedTrainer makes its step's pushpulls
once and reuses them while the gradient arrays are the same (DistributedTrainer._runs),
and makes them again when they are not. One process: a Horovod world of one."""
import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, gluon

import mpi_kvstore.horovod as hvd
from mpi_kvstore.optim import batched

pytestmark = pytest.mark.unit

LAYERS = 65   # 130 keys


@pytest.fixture
def world():
    hvd.init(design='chained', autotune='0')
    try:
        yield
    finally:
        hvd.shutdown()


def make_net():
    mx.random.seed(3)
    net = gluon.nn.HybridSequential()
    for _ in range(LAYERS):
        net.add(gluon.nn.Dense(6, in_units=6, activation='tanh'))
    net.initialize(mx.init.Xavier())
    return net


def options():
    return {'learning_rate': 0.05, 'momentum': 0.9, 'wd': 1e-3,
            'lr_scheduler': mx.lr_scheduler.FactorScheduler(step=2, factor=0.5)}


def step(net, trainer, seed):
    data = mx.nd.array(np.random.RandomState(seed).uniform(-1, 1, (4, 6)))
    with autograd.record():
        loss = (net(data) ** 2).mean()
    loss.backward()
    trainer.step(4)


def test_trainer_updates_bitwise_as_gluon_with_mxnets_updater(world):
    ours, theirs = make_net(), make_net()
    trainer = hvd.DistributedTrainer(ours.collect_params(), 'sgd', options())
    reference = gluon.Trainer(theirs.collect_params(), 'sgd', options(), kvstore=None)
    assert isinstance(trainer._updaters[0], batched.Updater)
    assert type(reference._updaters[0]) is mx.optimizer.Updater
    for net in (ours, theirs):   # a multiplier on one parameter
        list(net.collect_params().values())[3].lr_mult = 0.25
    for seed in range(6):
        if seed == 4:            # new arrays: the groups are made again, still bitwise
            for net in (ours, theirs):
                mx.random.seed(4)
                net.initialize(mx.init.Xavier(), force_reinit=True)
        for net, t in ((ours, trainer), (theirs, reference)):
            step(net, t, seed)
        for (name, a), b in zip(ours.collect_params().items(), theirs.collect_params().values()):
            assert np.array_equal(a.data().asnumpy(), b.data().asnumpy()), \
                'step %d: %s differs' % (seed, name)
    updater = trainer._updaters[0]
    # the first step makes the states (MXNet's Updater); the others are planned
    assert updater.planned == 5
    plan = updater._plan
    assert [len(group.indices) for group in plan.groups] == [60, 60, 10]
    assert [len(part) for part in plan.parts] == [4] * 32 + [2]


class Recorder:
    """A stand-in store: records the pushpulls, sums nothing (one process)."""

    num_workers = 1

    def __init__(self):
        self.calls = []

    def pushpull(self, keys, grads, priority=0):
        self.calls.append((keys, grads, priority))


@pytest.mark.parametrize('num_groups', [0, 3])
def test_the_steps_pushpulls_are_made_once_and_again_on_change(world, num_groups):
    net = make_net()
    trainer = hvd.DistributedTrainer(net.collect_params(), 'sgd', options(),
                                     num_groups=num_groups)
    store = trainer._kvstore = trainer._hvd_store = Recorder()
    params = trainer._params   # the trainer's order, its keys

    def expected():
        entries = [(i, p.list_grad()) for i, p in enumerate(params) if p.grad_req != 'null']
        runs = ([[entries[j] for j in run] for run in np.array_split(np.arange(len(entries)),
                                                                     num_groups)]
                if num_groups else [entries[::-1]])   # 130 small gradients: one 4 MB group
        return [([k for k, _ in run], [g for _, g in run], -min(k for k, _ in run))
                for run in runs]

    def same(got, want):   # keys and priorities equal, the very gradient arrays
        return len(got) == len(want) and all(
            a[0] == b[0] and a[2] == b[2] and len(a[1]) == len(b[1])
            and all(x is y for xs, ys in zip(a[1], b[1]) for x, y in zip(xs, ys))
            for a, b in zip(got, want))

    def calls():
        del store.calls[:]
        trainer._allreduce_grads()
        return list(store.calls)

    first = calls()
    assert same(first, expected())
    again = calls()
    assert same(again, expected())
    assert all(a[0] is b[0] and a[1] is b[1] for a, b in zip(first, again))   # reused
    params[5].grad_req = 'null'    # another set of keys
    changed = calls()
    assert same(changed, expected()) and 5 not in changed[0][0]
    params[5].grad_req = 'write'
    net.cast('float64')            # new gradient arrays
    cast = calls()
    assert same(cast, expected())
    assert all(g[0].dtype == np.float64 for _, grads, _ in cast for g in grads)
