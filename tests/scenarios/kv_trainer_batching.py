"""The store's optimizer batches the updates of gluon.Trainer's and Module's per-key loops
(one updater call a step: MXNet's multi-tensor updates, aggregate_num keys an operator), with
the very same weights after every step as one key at a time, as the Trainer's own updates
(update_on_kvstore=False), and, to float32 tolerance, as one process trained on the whole
batch. In the Trainer's loop the gradients are reduced in place (they hold the sums, as with
update_on_kvstore=False) and the weights updated where they are; a user's own pushpull
leaves its input as it was.

usage: kv_trainer_batching.py DESIGN
"""
import os

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import mpi_kvstore
from mpi_kvstore import debug

from common import RANK, SIZE, close, design_arg, done, same_on_all_ranks

DESIGN = design_arg()
PER_RANK, STEPS, LAYERS = 3, 3, 12
FROZEN = 5   # this layer's parameters sort last (prefix zz_) and are not trained
# the Trainer loop's calls that take the store optimizer's one function: from the third step
# on (the second prepares them), all but the loop's first key and its last
AGAIN = (STEPS - 2) * (2 * LAYERS - 2 - 2)
COUNTS = {}   # what the optimizer's debug counters saw, by run
OPTIMIZERS = {
    'sgd': ('sgd', {'learning_rate': 0.1, 'momentum': 0.9}),
    'sgd_wd': ('sgd', {'learning_rate': 0.1, 'momentum': 0.9, 'wd': 1e-3}),
    'adam': ('adam', {'learning_rate': 0.01}),
    'adam_wd': ('adam', {'learning_rate': 0.01, 'wd': 1e-3}),
}


def aggregation(size):
    """MXNet's SGD reads MXNET_OPTIMIZER_AGGREGATION_SIZE when it is made (None: unset)."""
    if size is None:
        os.environ.pop('MXNET_OPTIMIZER_AGGREGATION_SIZE', None)
    else:
        os.environ['MXNET_OPTIMIZER_AGGREGATION_SIZE'] = str(size)


def make_net():
    # fixed names: every net sorts its parameters (the Trainer's keys) the same way
    net = gluon.nn.HybridSequential(prefix='net_')
    with net.name_scope():
        for i in range(LAYERS):
            net.add(gluon.nn.Dense(8, in_units=8, activation='tanh',
                                   prefix='zz_' if i == FROZEN else 'd%02d_' % i))
    mx.random.seed(5)
    net.initialize(mx.init.Xavier())
    # the Trainer's last two keys (params sorted by name) are frozen: its loop pushes its
    # last key two keys before its end, and that key's batch is short
    net[FROZEN].collect_params().setattr('grad_req', 'null')
    return net


def batch(step, shard):
    rng = np.random.RandomState(40 + step)
    data = rng.uniform(-1, 1, (PER_RANK * SIZE, 8)).astype(np.float32)
    label = rng.uniform(-1, 1, (PER_RANK * SIZE, 8)).astype(np.float32)
    if shard:
        data, label = (a[RANK * PER_RANK:(RANK + 1) * PER_RANK] for a in (data, label))
    return mx.nd.array(data), mx.nd.array(label)


def gluon_run(opt, kv=None, **trainer_kw):
    net = make_net()
    name, params = OPTIMIZERS[opt]
    trainer = gluon.Trainer(net.collect_params(), name, dict(params), kvstore=kv,
                            **trainer_kw)
    loss_fn = gluon.loss.L2Loss()
    before = debug.snapshot()
    params = [p for _, p in sorted(net.collect_params().items())]
    weights, grads = [], []   # after each step: the Trainer's weights, the trained gradients
    for step in range(STEPS):
        data, label = batch(step, kv is not None)
        with autograd.record():
            loss = loss_fn(net(data), label)
        loss.backward()
        trainer.step(PER_RANK * SIZE)
        weights.append([p.data().asnumpy() for p in params])
        grads.append([p.grad().asnumpy() for p in params if p.grad_req != 'null'])
    counts = debug.since(before, 'optimizer')
    fast = debug.since(before, 'fastpath')
    fast['loop again'] = debug.since(before, 'loop').get('again', 0)
    if kv is not None and trainer._update_on_kvstore:
        own_pushpull(kv, trainer, params)
    return (weights, grads), counts, fast


def own_pushpull(kv, trainer, params):
    """The user's own kv.pushpull on the Trainer's very arrays, after the Trainer's steps
    (whose loop reduced the gradients in place): its input is left as it was, and the
    update reaches the Trainer's weights, which are the store's value."""
    key = len(params) - 1
    while params[key].grad_req == 'null':
        key -= 1
    param = params[key]
    idx = trainer._param2idx[param.name]
    grad, weight = param.grad(), param.data()
    grad[:] = float(RANK + 1)
    before = weight.asnumpy()
    kv.pushpull(idx, grad, out=weight)
    if not np.array_equal(grad.asnumpy(), np.full(grad.shape, RANK + 1, np.float32)):
        raise AssertionError('rank %d: the user\'s own pushpull changed its input' % RANK)
    pulled = mx.nd.zeros(weight.shape)
    kv.pull(idx, out=pulled)
    same_on_all_ranks(weight.asnumpy(), 'own pushpull on the Trainer\'s weights')
    if np.array_equal(weight.asnumpy(), before) or not np.array_equal(weight.asnumpy(),
                                                                       pulled.asnumpy()):
        raise AssertionError('rank %d: the own pushpull\'s update is not in the Trainer\'s '
                             'weights and the store\'s value' % RANK)


def check_gluon(opt):
    trainable = 2 * LAYERS - 2
    ref, _, _ = gluon_run(opt)
    kv = mpi_kvstore.create('dist_mpi', design=DESIGN)
    batched, counts, fast = gluon_run(opt, kv)
    if opt.startswith('sgd'):   # one updater call a step, of every key
        want = {'batch': STEPS}
    else:
        want = {'key': STEPS * trainable}
    assert counts == want, '%s: updates %s, expected %s' % (opt, counts, want)
    COUNTS['gluon ' + opt] = counts
    # SGD's batches from the second step on (the first makes the states): from the groups
    # the store's updater keeps (optim.batched)
    COUNTS['planned gluon ' + opt] = kv._updater.planned
    assert kv._updater.planned == (STEPS - 1 if opt.startswith('sgd') else 0), opt
    # from the second step on, every pushpull of the Trainer's loop takes the prepared path
    # (the store's optimizer set: namecache.Replay, exchange.Exchange.replay), and from the
    # third on, each but the loop's first and last key its one function
    # (heldloop.HeldLoop.again)
    assert fast == {'hit': (STEPS - 1) * trainable, 'loop again': AGAIN}, fast
    COUNTS['fastpath gluon ' + opt] = fast
    aggregation(1)    # SGD with aggregate_num 1: one key an update, as before batching
    try:
        kv = mpi_kvstore.create('dist_mpi', design=DESIGN)
        one_by_one, counts, fast = gluon_run(opt, kv)
    finally:
        aggregation(None)
    assert counts == {'key': STEPS * trainable}, counts
    assert kv._updater.planned == 0, kv._updater.planned
    COUNTS['gluon %s, aggregate_num 1' % opt] = counts
    assert fast == {'hit': (STEPS - 1) * trainable, 'loop again': AGAIN}, fast
    local, counts, fast = gluon_run(opt, mpi_kvstore.create('dist_mpi', design=DESIGN),
                                    update_on_kvstore=False)
    assert counts == {}, counts
    assert fast == {'hit': (STEPS - 1) * trainable, 'loop again': 0}, fast
    for step in range(STEPS):
        for i, value in enumerate(batched[0][step]):
            what = 'gluon %s step %d parameter %d' % (opt, step, i)
            same_on_all_ranks(value, what)
            close(value, ref[0][step][i], what + ' vs one process', rtol=1e-4, atol=1e-5)
            for other, how in ((one_by_one, 'one key an update'), (local, 'the Trainer\'s')):
                if not np.array_equal(value, other[0][step][i]):
                    raise AssertionError(
                        'rank %d: %s: batched updates differ from %s (max %g)'
                        % (RANK, what, how, np.abs(value - other[0][step][i]).max()))
        # the store's updates reduced the gradients in place: the sums over the ranks, as
        # the Trainer's own updates leave them
        for i, grad in enumerate(batched[1][step]):
            for other in (one_by_one, local):
                if not np.array_equal(grad, other[1][step][i]):
                    raise AssertionError('rank %d: gluon %s step %d: gradient %d is not the '
                                         'sum over the ranks' % (RANK, opt, step, i))


def module_symbol():
    net = mx.sym.Variable('data')
    for i in range(6):
        net = mx.sym.FullyConnected(net, num_hidden=8, name='fc%d' % i)
        net = mx.sym.Activation(net, act_type='tanh')
    return mx.sym.LinearRegressionOutput(net, name='out')


def module_fit(kv, aggregate=None):
    rng = np.random.RandomState(9)
    n = PER_RANK * SIZE * STEPS
    data = rng.uniform(-1, 1, (n, 8)).astype(np.float32)
    label = rng.uniform(-1, 1, (n, 8)).astype(np.float32)
    if kv is not None:
        rows = np.concatenate([np.arange(b * PER_RANK * SIZE + RANK * PER_RANK,
                                         b * PER_RANK * SIZE + (RANK + 1) * PER_RANK)
                               for b in range(STEPS)])
        data, label = data[rows], label[rows]
    it = mx.io.NDArrayIter(data, label, batch_size=len(data) // STEPS, shuffle=False,
                           label_name='out_label')
    mx.random.seed(3)
    mod = mx.mod.Module(module_symbol(), context=mx.cpu(), label_names=['out_label'])
    aggregation(aggregate)
    before = debug.snapshot()
    try:
        mod.fit(it, num_epoch=1, kvstore=kv, optimizer='sgd', eval_metric='mse',
                optimizer_params={'learning_rate': 0.1, 'momentum': 0.9, 'wd': 1e-3},
                initializer=mx.init.Xavier())
    finally:
        aggregation(None)
    args, _ = mod.get_params()
    return {k: v.asnumpy() for k, v in args.items()}, debug.since(before, 'optimizer')


def check_module():
    ref, _ = module_fit(None)
    batched, counts = module_fit(mpi_kvstore.create('dist_mpi', design=DESIGN))
    assert counts == {'batch': STEPS}, counts
    COUNTS['module sgd'] = counts
    one_by_one, counts = module_fit(mpi_kvstore.create('dist_mpi', design=DESIGN), 1)
    assert counts == {'key': STEPS * 12}, counts
    COUNTS['module sgd, aggregate_num 1'] = counts
    for name in sorted(ref):
        same_on_all_ranks(batched[name], 'module ' + name)
        close(batched[name], ref[name], 'module %s vs one process' % name, rtol=1e-4,
              atol=1e-5)
        if not np.array_equal(batched[name], one_by_one[name]):
            raise AssertionError('rank %d: module %s: batched updates differ from one key '
                                 'an update' % (RANK, name))


def check_own_loop():
    """kv.pushpull from the user's own loop: each call's weights are there at once."""
    kv = mpi_kvstore.create('dist_mpi', design=DESIGN)
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.5, momentum=0.9))
    weights = [mx.nd.full((4,), float(k + 1)) for k in range(3)]
    for k, w in enumerate(weights):
        kv.broadcast(k, w, out=w)
    before = debug.snapshot()
    for k, w in enumerate(weights):
        grad = mx.nd.full((4,), float(RANK + 1))
        kv.pushpull(k, grad, out=w)
        # lr 0.5, first step: w - 0.5 * (sum over ranks of rank + 1)
        close(w.asnumpy(), k + 1 - 0.5 * SIZE * (SIZE + 1) / 2, 'own loop key %d' % k)
        if not np.array_equal(grad.asnumpy(), np.full((4,), RANK + 1, np.float32)):
            raise AssertionError('rank %d: own loop key %d: the input was changed' % (RANK, k))
    COUNTS['own loop'] = debug.since(before, 'optimizer')
    assert COUNTS['own loop'] == {'key': 3}, COUNTS['own loop']


def main():
    for opt in OPTIMIZERS:
        check_gluon(opt)
    check_module()
    check_own_loop()
    done('kv_trainer_batching[%s]' % DESIGN, counts=COUNTS)


main()
