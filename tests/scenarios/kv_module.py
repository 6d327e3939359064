"""Module.fit through the store equals one process fitting the whole batch.

usage: kv_module.py DESIGN UPDATE_ON_KVSTORE(0|1) [clip]

clip: both fits clip each step's gradient by its global norm, the store's through
mpi_kvstore.clip_global_norm(module, ...), one process by gluon.utils.clip_global_norm on
its gradients before each update; most steps clip.
"""
import os
import sys

import mxnet as mx
import numpy as np
from mxnet import gluon

import mpi_kvstore

from common import (
    RANK,
    SIZE,
    check_state_shares,
    close,
    design_arg,
    done,
    same_on_all_ranks,
    summary,
)

DESIGN = design_arg()
UPDATE_ON_KV = sys.argv[2] if len(sys.argv) > 2 else '1'
PER_RANK, BATCHES = 4, 3
CLIP = 0.2 if sys.argv[3:] == ['clip'] else None   # below most steps' norms
CLIPPED = []                                       # one process: did each step clip?


def symbol():
    data = mx.sym.Variable('data')
    net = mx.sym.Convolution(data, num_filter=6, kernel=(3, 3), pad=(1, 1), name='conv1')
    net = mx.sym.Activation(net, act_type='relu')
    net = mx.sym.Pooling(net, kernel=(2, 2), stride=(2, 2), pool_type='max')
    net = mx.sym.FullyConnected(mx.sym.Flatten(net), num_hidden=5, name='fc')
    return mx.sym.SoftmaxOutput(net, name='softmax')


def dataset():
    rng = np.random.RandomState(7)
    n = PER_RANK * SIZE * BATCHES
    return (rng.uniform(-1, 1, (n, 3, 8, 8)).astype(np.float32),
            rng.randint(0, 5, (n,)).astype(np.float32))


def shard(data, label):
    """Rank r's part of every global batch, in batch order."""
    rows = np.concatenate([np.arange(b * PER_RANK * SIZE + RANK * PER_RANK,
                                     b * PER_RANK * SIZE + (RANK + 1) * PER_RANK)
                           for b in range(BATCHES)])
    return data[rows], label[rows]


def clip_in_one_process(mod):
    """One process clips its gradient, scaled by rescale_grad as the optimizer applies it,
    before each update: the reference for the store's clipping."""
    update = mod.update

    def clipped():
        grads = [g[0] for g in mod._exec_group.grad_arrays if g and g[0] is not None]
        bound = CLIP / mod._optimizer.rescale_grad
        CLIPPED.append(gluon.utils.clip_global_norm(grads, bound) > bound)
        update()
    mod.update = clipped


def fit(data, label, batch, kvstore):
    mx.random.seed(11)
    mod = mx.mod.Module(symbol(), context=mx.cpu())
    if CLIP is not None:
        if kvstore is None:
            clip_in_one_process(mod)
        else:
            mpi_kvstore.clip_global_norm(mod, CLIP)
    it = mx.io.NDArrayIter(data, label, batch_size=batch, shuffle=False)
    mod.fit(it, num_epoch=2, kvstore=kvstore, optimizer='sgd',
            optimizer_params={'learning_rate': 0.2, 'momentum': 0.9},
            initializer=mx.init.Xavier(), eval_metric='acc')
    args, _ = mod.get_params()
    return {k: v.asnumpy() for k, v in args.items()}


def main():
    data, label = dataset()
    ref = fit(data, label, PER_RANK * SIZE, None)
    kv = mpi_kvstore.create('dist_mpi', design=DESIGN)
    got = fit(*shard(data, label), PER_RANK, kv)
    kv.wait()
    assert (kv._updater is not None) == (UPDATE_ON_KV == '1'), 'update_on_kvstore not honoured'
    if kv._updater is not None:
        assert check_state_shares(kv) == len(ref), 'optimizer states of %s' % sorted(ref)
    if CLIP is not None:
        steps = 2 * BATCHES
        assert len(CLIPPED) == steps and sum(CLIPPED) > steps // 2, CLIPPED
        assert kv._optimizer.clip is None, 'every clipped step finished'
    for name in sorted(ref):
        same_on_all_ranks(got[name], name)
        close(got[name], ref[name], '%s vs single process' % name, rtol=1e-4, atol=1e-5)
    done('kv_module[%s, MXNET_UPDATE_ON_KVSTORE=%s%s]' % (DESIGN, os.environ.get(
        'MXNET_UPDATE_ON_KVSTORE', '1'), ', clipped' if CLIP is not None else ''),
         reference={name: summary(value) for name, value in ref.items()}, clipped=CLIPPED)


main()
