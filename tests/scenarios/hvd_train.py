"""mpi_kvstore.horovod's trainers average as Horovod's do: a DistributedTrainer step with
step(local batch) equals one process on every rank's batch together, and so does Module.fit
with a DistributedOptimizer; every rank ends with the same weights."""
import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import mpi_kvstore.horovod as hvd

from common import RANK, SIZE, UserFP16, close, done, expect_raises, same_on_all_ranks

LOCAL = 4                  # rows of one rank's batch
STEPS = 3
rng = np.random.RandomState(5)
X = rng.uniform(-1, 1, size=(STEPS, SIZE * LOCAL, 6)).astype('float32')
Y = rng.randint(0, 3, size=(STEPS, SIZE * LOCAL)).astype('float32')


def mine(batch):
    return batch[RANK * LOCAL:(RANK + 1) * LOCAL]


def make_net(seed):
    mx.random.seed(seed)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(5, activation='tanh'), gluon.nn.Dense(3))  # deferred shapes
    net.initialize(mx.init.Xavier())
    return net


def values(net):
    return {name: p.data().asnumpy() for name, p in sorted(net.collect_params().items())}


def train(net, trainer, rows, batch_size):
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    for step in range(STEPS):
        with autograd.record():
            loss = loss_fn(net(mx.nd.array(rows(X[step]))), mx.nd.array(rows(Y[step])))
        loss.backward()
        trainer.step(batch_size)
    return values(net)


hvd.init()
OPT = {'learning_rate': 0.5, 'momentum': 0.9, 'wd': 1e-3}
CASES = [(hvd.Compression.none, 1.0, 0, 1e-5), (hvd.Compression.none, 4.0, 2, 1e-5),
         (hvd.Compression.none, 1.0, 1, 1e-5), (hvd.Compression.fp16, 1.0, 0, 2e-2),
         (hvd.Compression.bf16, 2.0, 0, 1e-1), (UserFP16, 1.0, 0, 2e-2),
         (hvd.Compression.twobit_threshold(0.01), 1.0, 0, None)]
for compression, predivide, groups, tol in CASES:
    what = '%s predivide=%g num_groups=%d' % (getattr(compression, '__name__', compression),
                                              predivide, groups)
    net = make_net(seed=100 + RANK)   # each rank starts elsewhere: the broadcast decides
    hvd.broadcast_parameters(net.collect_params(), root_rank=SIZE - 1)
    net(mx.nd.array(mine(X[0])))      # the deferred parameters are broadcast here
    start = values(net)
    for name, value in start.items():
        same_on_all_ranks(value, 'broadcast %s' % name)
    if groups == 1:   # positional, as Horovod documents the signature
        trainer = hvd.DistributedTrainer(net.collect_params(), 'sgd', OPT, compression,
                                         predivide, 'p', groups)
    else:
        trainer = hvd.DistributedTrainer(net.collect_params(), mx.optimizer.SGD(**OPT),
                                         compression=compression,
                                         gradient_predivide_factor=predivide,
                                         num_groups=groups, prefix='t%d' % groups)
    got = train(net, trainer, mine, LOCAL)
    # the store's batched updater ran every step after the first (which makes the states)
    assert trainer._updaters[0].planned == STEPS - 1, (what, trainer._updaters[0].planned)
    # one process, the whole batch, the same start, a plain gluon.Trainer
    ref = make_net(seed=0)
    ref(mx.nd.array(X[0]))
    for (_, p), value in zip(sorted(ref.collect_params().items()), start.values()):
        p.set_data(mx.nd.array(value))
    want = train(ref, gluon.Trainer(ref.collect_params(), 'sgd', OPT, kvstore=None),
                 lambda batch: batch, SIZE * LOCAL)
    for (name, value), expected in zip(got.items(), want.values()):
        same_on_all_ranks(value, '%s: %s' % (what, name))
        if tol is not None:
            close(value, expected, '%s: %s vs one process' % (what, name), rtol=tol,
                  atol=tol * 0.1)
        assert np.abs(value - start[name]).max() > 0, '%s: %s did not move' % (what, name)

# a DistributedOptimizer given to the trainer is unwrapped, as Horovod does
net = make_net(seed=1)
hvd.broadcast_parameters(net.collect_params())
wrapped = hvd.DistributedOptimizer(mx.optimizer.SGD(learning_rate=0.1))
import warnings  # noqa: E402

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    trainer = hvd.DistributedTrainer(net.collect_params(), wrapped)
assert any('unwrapped' in str(w.message) for w in caught)
expect_raises(ValueError, hvd.DistributedTrainer, net.collect_params(), 'sgd', num_groups=-1,
              contains='num_groups')

# Module.fit with a DistributedOptimizer (kvstore=None, as Horovod's examples do)
data_all = X.reshape(-1, 6)
label_all = Y.reshape(-1)
index = np.concatenate([np.arange(s * SIZE * LOCAL + RANK * LOCAL,
                                  s * SIZE * LOCAL + (RANK + 1) * LOCAL) for s in range(STEPS)])
sym = mx.sym.SoftmaxOutput(mx.sym.FullyConnected(
    mx.sym.Activation(mx.sym.FullyConnected(mx.sym.var('data'), num_hidden=5, name='fc1'),
                      act_type='tanh'), num_hidden=3, name='fc2'), name='softmax')


def fit(rows, batch, optimizer, arg_params):
    it = mx.io.NDArrayIter(data_all[rows], label_all[rows], batch_size=batch,
                           label_name='softmax_label')
    mod = mx.mod.Module(sym, context=mx.cpu())
    mod.fit(it, num_epoch=2, kvstore=None, optimizer=optimizer, arg_params=arg_params,
            aux_params={}, force_init=True)
    return {name: value.asnumpy() for name, value in sorted(mod.get_params()[0].items())}


mod = mx.mod.Module(sym, context=mx.cpu())
mod.bind(data_shapes=[('data', (LOCAL, 6))], label_shapes=[('softmax_label', (LOCAL,))])
mx.random.seed(200 + RANK)
mod.init_params(mx.init.Xavier())
arg_params, aux_params = mod.get_params()       # a dict of NDArrays
hvd.broadcast_parameters(arg_params, root_rank=0, prefix='arg.')
hvd.broadcast_parameters(aux_params, root_rank=0)
start = {name: value.asnumpy() for name, value in arg_params.items()}
for name, value in start.items():
    same_on_all_ranks(value, 'module broadcast %s' % name)
opt = mx.optimizer.create('sgd', learning_rate=0.3, momentum=0.9, rescale_grad=1.0 / LOCAL)
got = fit(index, LOCAL, hvd.DistributedOptimizer(opt, gradient_predivide_factor=2.0),
          {n: mx.nd.array(v) for n, v in start.items()})
ref_opt = mx.optimizer.create('sgd', learning_rate=0.3, momentum=0.9,
                              rescale_grad=1.0 / (SIZE * LOCAL))
want = fit(np.arange(len(data_all)), SIZE * LOCAL, ref_opt,
           {n: mx.nd.array(v) for n, v in start.items()})
for name, value in got.items():
    same_on_all_ranks(value, 'Module.fit %s' % name)
    close(value, want[name], 'Module.fit with DistributedOptimizer: %s' % name, rtol=1e-5)
    assert np.abs(value - start[name]).max() > 0

hvd.shutdown()
done('hvd_train')
