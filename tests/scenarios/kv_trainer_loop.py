"""The store's optimizer holds the collectives of MXNet's per-key loops (gluon.Trainer with
update_on_kvstore, Module) and sends them with the loop's last key as one submit
(store/heldloop.LoopGate): the 'loop' debug counter says how many calls waited and how
many submits went; the weights after every step are bitwise those of the Trainer's own
updates (update_on_kvstore=False) and, to float32 tolerance, those of one process on the
whole batch. The Trainer's own updates' loop of pushpulls is held likewise once its calls
are prepared (Exchange.again, from the third step), with weights bitwise those of the same
loop in a Trainer subclass (never held) and one submit a step instead of one a key. With a group bound smaller than the
model, the loop's collectives go in groups. A loop that raises before its last key leaves
its collectives held: the next store call (wait) sends them and delivers their updates, so
those keys' weights are bitwise a whole step's and the last key's are untouched. A user's
own loop of pushpulls is never held.

usage: kv_trainer_loop.py DESIGN
"""
import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import mpi_kvstore
from mpi_kvstore import debug
from mpi_kvstore.store import heldloop

from common import RANK, SIZE, close, design_arg, done, same_on_all_ranks

DESIGN = design_arg()
PER_RANK, STEPS, LAYERS, UNITS = 2, 4, 6, 16
KEYS = 2 * LAYERS
AGAIN = (STEPS - 2) * (KEYS - 2)   # the loop's calls in one function (HeldLoop.again)
KEY_BYTES = (UNITS * UNITS + UNITS) * 4   # a layer's weight and bias, float32
COUNTS = {}
OPTIMIZERS = {'sgd': ('sgd', {'learning_rate': 0.1, 'momentum': 0.9, 'wd': 1e-3}),
              'adam': ('adam', {'learning_rate': 0.01})}


def make_net():
    net = gluon.nn.HybridSequential(prefix='net_')
    with net.name_scope():
        for i in range(LAYERS):
            net.add(gluon.nn.Dense(UNITS, in_units=UNITS, activation='tanh',
                                   prefix='d%02d_' % i))
    mx.random.seed(11)
    net.initialize(mx.init.Xavier())
    return net


def batch(step, shard):
    rng = np.random.RandomState(70 + step)
    data = rng.uniform(-1, 1, (PER_RANK * SIZE, UNITS)).astype(np.float32)
    label = rng.uniform(-1, 1, (PER_RANK * SIZE, UNITS)).astype(np.float32)
    if shard:
        data, label = (a[RANK * PER_RANK:(RANK + 1) * PER_RANK] for a in (data, label))
    return mx.nd.array(data), mx.nd.array(label)


class OwnLoop(gluon.Trainer):
    """gluon.Trainer whose loop of pushpulls (update_on_kvstore=False, dense gradients) is
    this scenario's own code, as MXNet's: never held."""

    def _allreduce_grads(self):
        for i, param in enumerate(self._params):
            if param.grad_req != 'null':
                self._kvstore.pushpull(i, param.list_grad(), priority=-i)


def count_submits(kv):
    """Count the store's submits (one engine op each) in SUBMITS[kv]: Job.submit's, and a
    repeated call's that the design takes in one function (Design.again, from Job.again,
    or the same function the store calls straight, Job.again_direct)."""
    job = kv._job
    submit, design_again, direct = job.submit, job.design.again, job.again_direct
    SUBMITS[kv] = 0

    def counted(reqs, priority):
        SUBMITS[kv] += 1
        return submit(reqs, priority)

    def counted_again(prepared, models, priority, pending):
        taken = design_again(prepared, models, priority, pending)
        SUBMITS[kv] += bool(taken)
        return taken

    def counted_direct(prepared, models, priority, pending):
        taken = direct(prepared, models, priority, pending)
        SUBMITS[kv] += bool(taken)
        return taken

    job.submit = counted
    job.design.again = counted_again
    if direct is not None:
        job.again_direct = counted_direct
    return kv


SUBMITS = {}


def train(opt, kv=None, steps=STEPS, trainer=gluon.Trainer, **trainer_kw):
    """(weights after each step, 'loop' counts, the net, the trainer)."""
    net = make_net()
    name, params = OPTIMIZERS[opt]
    trainer = trainer(net.collect_params(), name, dict(params), kvstore=kv, **trainer_kw)
    loss_fn = gluon.loss.L2Loss()
    ordered = [p for _, p in sorted(net.collect_params().items())]
    before = debug.snapshot()
    weights = []
    for step in range(steps):
        data, label = batch(step, kv is not None)
        with autograd.record():
            loss = loss_fn(net(data), label)
        loss.backward()
        trainer.step(PER_RANK * SIZE)
        weights.append([p.data().asnumpy() for p in ordered])
    return weights, debug.since(before, 'loop'), net, trainer


def check_trainer(opt):
    ref, _, _, _ = train(opt)
    held, counts, _, _ = train(opt, mpi_kvstore.create('dist_mpi', design=DESIGN))
    # every call but the loop's last waits; one submit a step sends them all; from the third
    # step each call but the loop's first and last is one function (HeldLoop.again)
    want = {'held': STEPS * (KEYS - 1), 'submit': STEPS, 'again': AGAIN}
    assert counts == want, '%s: loop counts %s, expected %s' % (opt, counts, want)
    COUNTS['gluon ' + opt] = counts
    # the Trainer's own updates: its pushpulls are held too once prepared (from the third
    # step: the first checks, the second prepares); a loop of the same calls of its own is not
    gated = count_submits(mpi_kvstore.create('dist_mpi', design=DESIGN))
    own, counts, _, _ = train(opt, gated, update_on_kvstore=False)
    want = {'held': (STEPS - 2) * (KEYS - 1), 'submit': STEPS - 2}
    assert counts == want, '%s: own updates: loop counts %s, expected %s' % (opt, counts, want)
    COUNTS['gluon %s, own updates' % opt] = counts
    plain = count_submits(mpi_kvstore.create('dist_mpi', design=DESIGN))
    ungated, counts, _, _ = train(opt, plain, trainer=OwnLoop, update_on_kvstore=False)
    assert counts == {}, counts
    # a step's submits after the broadcasts (one a key a step, one engine op each)
    COUNTS['gluon %s, own updates, submits' % opt] = [SUBMITS[gated], SUBMITS[plain]]
    for step in range(STEPS):
        for i, value in enumerate(ungated[step]):
            if not np.array_equal(own[step][i], value):
                raise AssertionError('rank %d: %s step %d parameter %d: held own updates '
                                     'differ from the unheld loop\'s' % (RANK, opt, step, i))
        for i, value in enumerate(held[step]):
            what = 'gluon %s step %d parameter %d' % (opt, step, i)
            same_on_all_ranks(value, what)
            close(value, ref[step][i], what + ' vs one process', rtol=1e-4, atol=1e-5)
            if not np.array_equal(value, own[step][i]):
                raise AssertionError('rank %d: %s: held loop differs from the Trainer\'s own '
                                     'updates (max %g)' % (RANK, what,
                                                           np.abs(value - own[step][i]).max()))


def check_groups():
    """A group bound of 3 keys' bytes: the loop's collectives go in groups of 3 keys."""
    bound = heldloop.LOOP_GROUP_BYTES
    heldloop.LOOP_GROUP_BYTES = 3 * KEY_BYTES
    try:
        grouped, counts, _, _ = train('sgd', mpi_kvstore.create('dist_mpi', design=DESIGN))
    finally:
        heldloop.LOOP_GROUP_BYTES = bound
    # keys alternate a bias (UNITS floats) and a weight (UNITS**2): a group closes at its
    # third weight, on the sixth key, then on the twelfth (the last)
    assert counts == {'held': STEPS * (KEYS - 2), 'submit': STEPS * 2, 'again': AGAIN}, counts
    COUNTS['gluon sgd, groups'] = counts
    whole, _, _, _ = train('sgd', mpi_kvstore.create('dist_mpi', design=DESIGN))
    for step in range(STEPS):
        for i, value in enumerate(grouped[step]):
            if not np.array_equal(value, whole[step][i]):
                raise AssertionError('rank %d: groups: step %d parameter %d differs from one '
                                     'submit' % (RANK, step, i))


def check_interrupted():
    """The loop raises at its last key (as a bad call would): the held keys' collectives go
    at the next store call, with their updates."""
    full, _, _, _ = train('sgd', mpi_kvstore.create('dist_mpi', design=DESIGN), steps=1)
    kv = mpi_kvstore.create('dist_mpi', design=DESIGN)
    net = make_net()
    trainer = gluon.Trainer(net.collect_params(), 'sgd', dict(OPTIMIZERS['sgd'][1]), kvstore=kv)
    ordered = [p for _, p in sorted(net.collect_params().items())]
    start = [p.data().asnumpy() for p in ordered]
    data, label = batch(0, True)
    with autograd.record():
        loss = gluon.loss.L2Loss()(net(data), label)
    loss.backward()
    pushpull = kv.pushpull
    last = len(ordered) - 1

    def failing(key, *args, **kwargs):
        if key == last:
            raise RuntimeError('stop before the last key')
        return pushpull(key, *args, **kwargs)

    kv.pushpull = failing
    before = debug.snapshot()
    try:
        trainer.step(PER_RANK * SIZE)
    except RuntimeError:
        pass
    else:
        raise AssertionError('the loop did not raise')
    finally:
        del kv.pushpull
    assert debug.since(before, 'loop') == {'held': KEYS - 1}, debug.since(before, 'loop')
    kv.wait()
    counts = debug.since(before, 'loop')
    assert counts == {'held': KEYS - 1, 'submit': 1}, counts
    COUNTS['interrupted'] = counts
    for i, param in enumerate(ordered):
        value = param.data().asnumpy()
        expected = start[i] if i == last else full[0][i]
        if not np.array_equal(value, expected):
            raise AssertionError('rank %d: interrupted loop: parameter %d is not %s'
                                 % (RANK, i, 'untouched' if i == last else 'a whole step\'s'))


def check_own_loop():
    kv = mpi_kvstore.create('dist_mpi', design=DESIGN)
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.5))
    weights = [mx.nd.full((4,), float(k + 1)) for k in range(3)]
    for k, w in enumerate(weights):
        kv.broadcast(k, w, out=w)
    before = debug.snapshot()
    for k, w in enumerate(weights):
        kv.pushpull(k, mx.nd.full((4,), float(RANK + 1)), out=w)
        close(w.asnumpy(), k + 1 - 0.5 * SIZE * (SIZE + 1) / 2, 'own loop key %d' % k)
    assert debug.since(before, 'loop') == {}, debug.since(before, 'loop')


def main():
    for opt in OPTIMIZERS:
        check_trainer(opt)
    check_groups()
    check_interrupted()
    check_own_loop()
    done('kv_trainer_loop[%s]' % DESIGN, counts=COUNTS)


main()
