"""The GPU-like workload trains to the weights numpy computes from the same gradients.

Every rank trains benchmarks.gpu_like's model of MODEL (the zoo net's parameter shapes, the
compute scaled down to a few ms a step) for STEPS steps of SGD without momentum through an
mpi_kvstore store: gluon.Trainer (update_on_kvstore False and True),
mpi_kvstore.DistributedTrainer, and Module on gpu_like_symbol. numpy recomputes each
parameter from its known initial value and the deterministic gradients (grad_unit(j) times
the scale each rank gave the step, summed over ranks, divided by the global batch); where the
update runs on the rank, the gradients left after the last step must be that step's sum. The
same gradients written by ordinary CPU ops through a plain gluon.Trainer reach the same
weights as the GPU-like run, partitioned (partition_bytes, credit_bytes) or not.

usage: gpu_like_train.py [MODEL] [DESIGN]
"""
import sys

import mxnet as mx
import numpy as np
from mxnet import gluon

import mpi_kvstore
from benchmarks import gpu_like

from common import RANK, SIZE, close, done, same_on_all_ranks

MODEL = sys.argv[1] if len(sys.argv) > 1 else 'resnet50_v1'
DESIGN = sys.argv[2] if len(sys.argv) > 2 else None
STEPS, BATCH, LR = 2, 4, 0.5
PLAN = gpu_like.plan(MODEL, images_per_s=BATCH / 0.01, batch=BATCH)     # 10 ms a step
TRAINED = {}            # {trainer: each parameter's first element after training}, reported


def expected_params(scales):
    """{index: value of every element} after SGD on steps whose per-rank scales are
    scales[step][rank]; in float32, step by step, as the trainer computes."""
    values = {}
    for index, spec in enumerate(PLAN.params):
        w = np.float32(gpu_like.initial_value(index))
        if spec.grad_req != 'null':
            for step_scales in scales:
                summed = np.float32(sum(np.float32(gpu_like.grad_unit(index) * s)
                                        for s in step_scales))
                w = np.float32(w - np.float32(LR) * summed / np.float32(BATCH * SIZE))
        values[index] = w
    return values


def check(arrays, scales, what, grads=None):
    """arrays: one numpy array per parameter, in PLAN.params order; grads: the gradients
    after the last step, where they are left summed (None where the store updates)."""
    expected = expected_params(scales)
    assert len(arrays) == len(PLAN.params), (len(arrays), len(PLAN.params))
    for index, (spec, array) in enumerate(zip(PLAN.params, arrays)):
        assert array.shape == spec.shape, (what, spec.name, array.shape, spec.shape)
        close(array, expected[index], f'{what}: {spec.name}', rtol=1e-5, atol=1e-7)
        if grads is not None and spec.grad_req != 'null':
            summed = sum(gpu_like.grad_unit(index) * s for s in scales[-1])
            close(grads[index], summed, f'{what}: gradient of {spec.name}', rtol=0, atol=0)
    same_on_all_ranks(np.concatenate([a.ravel()[:4] for a in arrays]), what)
    TRAINED[what] = first_elements(arrays)


def first_elements(arrays):
    """Each parameter's first element: every element of a parameter is alike (close()
    checked them), so the test can recompute each one from numpy."""
    return [float(a.ravel()[0]) for a in arrays]


def train_gluon(kind, kv):
    model = gpu_like.GPULikeModel(PLAN)
    model.initialize()
    params = model.collect_params()
    if RANK:    # rank-dependent weights: the trainer's broadcast must give rank 0's
        for p in params.values():
            p.set_data(p.data() + 1)
    optimizer = ('sgd', {'learning_rate': LR})
    if kind == 'distributed':
        trainer = mpi_kvstore.DistributedTrainer(params, *optimizer, store=kv)
    else:
        mpi_kvstore.broadcast_parameters(params, store=kv)
        trainer = gluon.Trainer(params, *optimizer, kvstore=kv,
                                update_on_kvstore=kind == 'gluon_uok')
    scales = []
    for step in range(STEPS):
        model(gpu_like.step_scale(step, RANK))
        model.backward()
        trainer.step(BATCH * SIZE)
        scales.append([gpu_like.step_scale(step, r) for r in range(SIZE)])
    mx.nd.waitall()
    arrays = [p.data().asnumpy() for p in params.values()]
    grads = None
    if kind != 'gluon_uok':
        grads = [p.grad().asnumpy() if p.grad_req != 'null' else None for p in params.values()]
    check(arrays, scales, kind, grads)
    return arrays


def train_cpu(kv):
    """The same model's parameters and the same gradients, written by ordinary CPU ops
    (no GPU-like layer ops), through a plain gluon.Trainer: the weights the GPU-like
    workload must reach."""
    model = gpu_like.GPULikeModel(PLAN)
    model.initialize()
    params = list(model.collect_params().values())
    mpi_kvstore.broadcast_parameters(model.collect_params(), store=kv)
    trainer = gluon.Trainer(model.collect_params(), 'sgd', {'learning_rate': LR}, kvstore=kv)
    for step in range(STEPS):
        scale = np.float32(gpu_like.step_scale(step, RANK))
        for index, p in enumerate(params):
            if p.grad_req != 'null':
                p.grad()[:] = np.float32(gpu_like.grad_unit(index)) * scale
                gpu_like._set_grad_state(p.data().handle, 1)   # as backward marks them
        trainer.step(BATCH * SIZE)
    mx.nd.waitall()
    return [p.data().asnumpy() for p in params]


def train_module(kv):
    """Module binds each op once, so every step has the scale the symbol was built with."""
    fixed = gpu_like.fixed_param_names(PLAN)
    mod = mx.mod.Module(gpu_like.gpu_like_symbol(PLAN, scale=RANK + 1), data_names=['data'],
                        label_names=None, fixed_param_names=fixed, context=mx.cpu())
    mod.bind(data_shapes=[('data', (1,))])
    mod.init_params(arg_params=gpu_like.module_arg_params(PLAN), allow_missing=False)
    mod.init_optimizer(kvstore=kv, optimizer='sgd',
                       optimizer_params={'learning_rate': LR, 'rescale_grad': 1 / (BATCH * SIZE)})
    batch = mx.io.DataBatch([mx.nd.zeros((1,))], [])
    for _ in range(STEPS):
        mod.forward_backward(batch)
        mod.update()
    mx.nd.waitall()
    args, _ = mod.get_params()
    check([args[spec.name].asnumpy() for spec in PLAN.params],
          [[r + 1 for r in range(SIZE)]] * STEPS, 'module')


def main():
    # A store per trainer: one that updates on the store keeps its optimizer.
    options = {'design': DESIGN} if DESIGN else {}
    trained = {kind: train_gluon(kind, mpi_kvstore.create('dist_mpi', **options))
               for kind in ('gluon', 'gluon_uok', 'distributed')}
    # The GPU-like run reaches the CPU run's weights, also with its large gradients cut
    # into pieces and scheduled by priority (schedule.py).
    cpu = train_cpu(mpi_kvstore.create('dist_mpi', **options))
    cut = train_gluon('gluon', mpi_kvstore.create('dist_mpi', partition_bytes='256K',
                                                  credit_bytes='1M', **options))
    for kind, arrays in [('gluon', trained['gluon']), ('gluon, partitioned', cut)]:
        for spec, mine, theirs in zip(PLAN.params, arrays, cpu):
            close(mine, theirs, f'{kind} against CPU compute: {spec.name}', rtol=1e-6, atol=0)
    TRAINED.update({'cpu': first_elements(cpu), 'gluon, partitioned': first_elements(cut)})
    train_module(mpi_kvstore.create('dist_mpi', **options))
    done(f'gpu_like_train[{MODEL}, {DESIGN or "default design"}]', trained=TRAINED)


main()
