"""benchmarks/gpu_like.py, the library overlap trains: the zoo's parameters, FLOP-proportional
times, a step that takes its stated wall time with little CPU, and training through the store
to numpy's weights.

References are independent of the module: the model zoo net itself (initialised by a forward
on one image), FLOPs computed by hand from layer shapes, a clock, and numpy (in the scenario).
"""
import re
import threading
import time

import mxnet as mx
import numpy as np
import pytest
from mxnet.gluon.model_zoo import vision

from benchmarks import gpu_like, overlap

from mpi_harness import result, run_mpi

BATCH = 32


def zoo_net(name):
    """The model zoo net with its parameters made by a forward on one 224x224 image."""
    net = vision.get_model(name)
    net.initialize(mx.init.Zero())      # values do not matter; zeros are quick
    net(mx.nd.zeros((1, 3, 224, 224))).wait_to_read()
    return net


@pytest.mark.parametrize('name, trainable', [('resnet50_v1', 25575912), ('vgg16', 138357544)])
def test_parameters_are_the_zoo_nets(name, trainable):
    net = zoo_net(name)
    zoo = [(key[len(net.prefix):], p.shape, p.grad_req) for key, p in net.collect_params().items()]
    model = gpu_like.GPULikeModel(gpu_like.plan(name))      # shapes are known before init
    mine = [(key[len(model.prefix):], p.shape, p.grad_req)
            for key, p in model.collect_params().items()]
    assert mine == zoo
    # The count of trainable parameters (batch norm's running statistics are not).
    assert sum(int(np.prod(s)) for _, s, req in zoo if req != 'null') == trainable
    assert gpu_like.plan(name).grad_bytes == 4 * trainable
    nulls = [key for key, _, req in mine if req == 'null']
    assert all(re.search(r'running_(mean|var)$', key) for key in nulls)
    assert len(nulls) == (2 * 53 if name == 'resnet50_v1' else 0)


def conv_flops(cout, cin, k, hout, wout):
    return 2 * cout * cin * k * k * hout * wout


def test_times_follow_flops():
    plan = gpu_like.plan('resnet50_v1', images_per_s=125, batch=BATCH)
    step = BATCH / 125
    total = sum(layer.forward_s + layer.backward_s for layer in plan.layers)
    assert total == pytest.approx(step, rel=0.01)
    assert plan.compute_s == step
    assert len(plan.layers) == 54                 # 53 convolutions and the dense layer
    first, stage1, dense = plan.layers[0], plan.layers[1], plan.layers[-1]
    # conv0: 7x7/2, 3 -> 64 channels, 224x224 -> 112x112; stage1's first: 1x1, 64 -> 64 at
    # 56x56 (after the 3x3/2 max pooling); the classifier: 2048 -> 1000.
    assert first.flops == conv_flops(64, 3, 7, 112, 112) == 236027904
    assert stage1.flops == conv_flops(64, 64, 1, 56, 56)
    assert dense.flops == 2 * 2048 * 1000
    assert [p.name for p in first.params] == [
        'conv0_weight', 'batchnorm0_gamma', 'batchnorm0_beta', 'batchnorm0_running_mean',
        'batchnorm0_running_var']
    assert [p.name for p in dense.params] == ['dense0_weight', 'dense0_bias']
    flops = sum(layer.flops for layer in plan.layers)
    for layer in (first, stage1, dense):
        share = step * layer.flops / flops
        assert layer.forward_s == pytest.approx(share / 3, rel=1e-9)
        assert layer.backward_s == pytest.approx(2 * share / 3, rel=1e-9)
    # Every layer gets the same seconds per FLOP.
    per_flop = {round((layer.forward_s + layer.backward_s) / layer.flops * 1e21) for layer in plan.layers}
    assert len(per_flop) == 1


def test_vgg16_at_the_flop_rule():
    vgg = gpu_like.plan('vgg16', batch=BATCH)
    assert vgg.layers[0].flops == conv_flops(64, 3, 3, 224, 224)
    assert vgg.layers[13].flops == 2 * 512 * 7 * 7 * 4096          # fc6 on the 7x7x512 map
    assert len(vgg.layers) == 16
    # About 15.5 G multiply-adds for VGG-16 against 3.9 G for ResNet-50.
    vgg_flops = sum(layer.flops for layer in vgg.layers)
    resnet_flops = sum(layer.flops for layer in gpu_like.plan('resnet50_v1').layers)
    assert 30.5e9 < vgg_flops < 31.5e9 and 7.6e9 < resnet_flops < 7.8e9
    assert vgg.images_per_s == pytest.approx(125 * resnet_flops / vgg_flops)
    assert vgg.compute_s == pytest.approx(BATCH / vgg.images_per_s)


@pytest.fixture(scope='module')
def resnet50():
    """ResNet-50's layers at a speed where a step's compute is 0.3 s."""
    model = gpu_like.GPULikeModel(gpu_like.plan('resnet50_v1', images_per_s=BATCH / 0.3))
    model.initialize()
    return model


def test_step_takes_its_time_without_cpu(resnet50):
    result = gpu_like.measure_compute(resnet50, steps=3, warmups=1)
    median = sorted(result['wall_s'])[1]
    # Each layer sleeps until its share of 0.3 s is up: never shorter. Longer only by the
    # wake-ups and what else runs on the cores, which a shared machine does not bound.
    assert 0.95 * 0.3 < median < 3 * 0.3, result
    # 102 MB of gradients are written every step; the rest of the process sleeps. A step
    # computed on the CPU would show a share near 1; the writes alone take about 5% on an idle
    # machine and more when CI shares its cores (5.4% there once), so the bound is 0.25.
    assert result['cpu_share'] < 0.25, result
    assert result['cpu_share'] == pytest.approx(sum(result['cpu_s']) / sum(result['wall_s']))


def test_values_and_gradients(resnet50):
    params = list(resnet50.collect_params().values())
    specs = resnet50.plan.params
    out = resnet50(3.0)
    resnet50.backward()
    weights = [i for i, spec in enumerate(specs) if spec.flops]
    expected_out = 3.0 + sum(gpu_like.initial_value(i) for i in weights)
    assert out.asnumpy()[0] == pytest.approx(expected_out, rel=1e-6)
    for index in (0, 1, len(params) - 2, len(params) - 1):
        grad = params[index].grad().asnumpy()
        assert grad.shape == specs[index].shape
        assert np.all(grad == np.float32(gpu_like.grad_unit(index) * 3.0)), index
    assert params[3].grad_req == 'null' and specs[3].name == 'batchnorm0_running_mean'
    # A write pushed before the next forward is what that forward reads.
    params[0].set_data(mx.nd.full(specs[0].shape, 2.0))
    out = resnet50(1.0)
    resnet50.backward()
    assert out.asnumpy()[0] == pytest.approx(expected_out - 3.0 + 1.0 + 2.0 - 0.01, rel=1e-6)
    resnet50.initialize(force_reinit=True)
    mx.nd.waitall()


def test_compute_leaves_the_engine_free(resnet50):
    """While the emulated GPU runs a step, MXNet's compute worker runs other ops at once, and
    the last layer's gradients are ready long before the first layer's (backward order)."""
    params = list(resnet50.collect_params().values())
    mx.nd.waitall()
    start = time.perf_counter()
    resnet50(1.0)
    resnet50.backward()
    (mx.nd.ones((1000,)) * 2).wait_to_read()
    other = time.perf_counter() - start
    params[-1].grad().wait_to_read()
    last_layer = time.perf_counter() - start
    params[0].grad().wait_to_read()
    first_layer = time.perf_counter() - start
    forward_s = sum(layer.forward_s for layer in resnet50.plan.layers)
    # A blocked engine would run the other op after the whole 0.3 s step; the bounds leave
    # room for a loaded CI machine.
    assert other < 0.1, other
    assert forward_s * 0.95 < last_layer < forward_s + 0.1, (last_layer, forward_s)
    assert first_layer > 0.95 * 0.3, first_layer
    mx.nd.waitall()


def test_gpu_like_sgd_trains_to_numpys_weights():
    """GPULikeSGD, the update as an op on the emulated GPU's stream, gives every element of
    every weight SGD's value from the (constant) gradients, step after step, with learning
    rate and rescale_grad as gluon.Trainer passes them; the gradients are left as written."""
    from mxnet import gluon
    plan_ = gpu_like.plan('resnet18_v1', images_per_s=BATCH / 0.02)
    model = gpu_like.GPULikeModel(plan_)
    model.initialize()
    trainer = gluon.Trainer(model.collect_params(), 'gpulikesgd', {'learning_rate': 0.5},
                            kvstore=None)
    assert isinstance(trainer._optimizer, gpu_like.GPULikeSGD)
    scales = [1.5, -2.0, 0.25]
    for scale in scales:
        model(scale)
        model.backward()
        trainer.step(8)
    mx.nd.waitall()
    for index, (spec, param) in enumerate(zip(plan_.params, model.collect_params().values())):
        w = np.float32(gpu_like.initial_value(index))
        if spec.grad_req != 'null':
            for scale in scales:
                grad = np.float32(gpu_like.grad_unit(index) * scale)
                w = np.float32(w - np.float32(0.5 / 8) * grad)
            assert np.all(param.grad().asnumpy() == np.float32(gpu_like.grad_unit(index)
                                                                * scales[-1])), spec.name
        got = param.data().asnumpy()
        assert got.shape == spec.shape
        np.testing.assert_allclose(got, w, rtol=1e-6, err_msg=spec.name)


@pytest.mark.parametrize('fraction', [0.2, 0.6])
def test_host_load_runs_its_share_of_cpu_each_period(fraction):
    """Each 10 ms cycle the load thread spends fraction x 10 ms of CPU (the process's CPU,
    read from outside: the main thread sleeps), and never starts cycles faster than the
    period. Where other work shares the cores a cycle may run late, so only the CPU per
    cycle is held to the fraction, and the thread's own share to what the process used."""
    period = gpu_like.HOST_LOAD_PERIOD_S
    wall, cpu = time.perf_counter(), time.process_time()
    with gpu_like.HostLoad(fraction) as load:
        time.sleep(0.4)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    assert 4 <= load.cycles <= wall / period + 1, (load.cycles, wall)
    assert cpu / load.cycles == pytest.approx(fraction * period, rel=0.25), (cpu, load.cycles)
    assert load.busy_share == pytest.approx(cpu / wall, rel=0.25, abs=0.01)


def test_host_load_zero_starts_nothing_and_bad_shares_are_refused(capsys):
    before = threading.active_count()
    with gpu_like.HostLoad(0) as load:
        assert threading.active_count() == before
    assert load.cycles == 0 and load.busy_share == 0
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match='--host-load'):
            gpu_like.HostLoad(bad)
        with pytest.raises(SystemExit):
            overlap.parse_args(['--host-load', str(bad)])
        assert f'--host-load {bad}: a share of the time, in [0, 1]' in capsys.readouterr().err
    assert overlap.parse_args(['--host-load', '0.3', '--layers', 'custom']).host_load == 0.3


def test_custom_layers_train_as_the_compiled_ones_and_numpy():
    """--layers custom: the layers as Python CustomOps under autograd give, step after step,
    the compiled model's output and gradients, both numpy's, and gluon.Trainer's SGD (MXNet's
    update on the CPU) takes both to numpy's weights."""
    from mxnet import gluon
    plan_ = gpu_like.plan('resnet18_v1', images_per_s=BATCH / 0.02)
    models = {mode: gpu_like.make_model(plan_, mode) for mode in ('compiled', 'custom')}
    assert isinstance(models['custom'], gpu_like.CustomLayersModel)
    trainers = {}
    for mode, model in models.items():
        model.initialize()
        trainers[mode] = gluon.Trainer(model.collect_params(), 'sgd', {'learning_rate': 0.5},
                                       kvstore=None)
    specs = plan_.params
    weights = [i for i, spec in enumerate(specs) if spec.flops]
    expected = np.array([gpu_like.initial_value(i) for i in range(len(specs))], np.float32)
    for scale in (1.5, -2.0, 0.25):
        outs = {}
        for mode, model in models.items():
            outs[mode] = model(scale).asnumpy()[0]
            model.backward()
            trainers[mode].step(8)
        # The output: scale plus every layer's first weight element, as the weights were.
        assert outs['custom'] == outs['compiled'] == pytest.approx(
            scale + expected[weights].sum(dtype=np.float64), rel=1e-5), (scale, outs)
        params = {mode: list(m.collect_params().values()) for mode, m in models.items()}
        for index, spec in enumerate(specs):
            if spec.grad_req == 'null':
                continue
            grad = np.float32(gpu_like.grad_unit(index) * scale)
            for mode in models:
                assert np.all(params[mode][index].grad().asnumpy() == grad), (mode, spec.name)
            expected[index] = np.float32(expected[index] - np.float32(0.5 / 8) * grad)
    for index, spec in enumerate(specs):
        for mode in models:
            got = params[mode][index].data().asnumpy()
            np.testing.assert_allclose(got, expected[index], rtol=1e-6, err_msg=f'{mode} {spec.name}')
    with pytest.raises(ValueError, match='--layers'):
        gpu_like.make_model(plan_, 'cuda')
    mx.nd.waitall()


def _trained(plan, scales, lr=0.5, batch=4):
    """Each parameter's value (all its elements alike) after SGD steps whose per-rank
    gradient scales are scales[step], in float32 as the trainers compute it."""
    values = []
    for index, spec in enumerate(plan.params):
        w = np.float32(gpu_like.initial_value(index))
        for ranks in scales if spec.grad_req != 'null' else []:
            summed = np.float32(sum(np.float32(gpu_like.grad_unit(index) * s) for s in ranks))
            w = np.float32(w - np.float32(lr) * summed / np.float32(batch * len(ranks)))
        values.append(float(w))
    return values


def test_training_under_mpi_equals_numpy(mpi_available):
    """Two steps of resnet50_v1's GPU-like model at 2 ranks: every trainer (gluon.Trainer
    updating on the rank and on the store, DistributedTrainer, Module, the same gradients
    through plain CPU ops, partitioned) reaches numpy's value of each of its parameters; the
    scenario's own checks of weights and gradients saw numpy's shapes and sums."""
    out = run_mpi(2, 'gpu_like_train.py', 'resnet50_v1', timeout=180)
    plan = gpu_like.plan('resnet50_v1', images_per_s=4 / 0.01, batch=4)
    by_step = _trained(plan, [[gpu_like.step_scale(step, r) for r in range(2)] for step in range(2)])
    want = {kind: by_step for kind in ('gluon', 'gluon_uok', 'distributed', 'cpu',
                                       'gluon, partitioned')}
    want['module'] = _trained(plan, [[1, 2]] * 2)      # Module's symbol: rank r scales by r + 1
    ranks = result(out, 'gpu_like_train[resnet50_v1, default design]')['ranks']
    assert len(ranks) == 2
    for rank in ranks:
        assert set(rank['trained']) == set(want)
        for kind, values in rank['trained'].items():
            np.testing.assert_allclose(values, want[kind], rtol=1e-5, atol=1e-7, err_msg=kind)
        assert len(rank['checked']) == 400 and rank['raised'] == []     # the first 400 checks
        for what, (shape, total) in rank['checked'].items():
            want_shape, want_total = rank['expected'][what]
            assert shape == want_shape and total == pytest.approx(want_total, rel=1e-5, abs=1e-3), what
