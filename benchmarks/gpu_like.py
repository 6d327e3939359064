"""A GPU-like workload: a model zoo net's parameters, with compute that takes wall time but no CPU.

benchmarks.overlap (and grid through it) trains this model with every trainer it compares;
main() times DistributedTrainer alone, however launched (mpiexec or run --elastic). Every
layer's forward and backward is an engine op that sleeps, as a GPU leaves the CPU to the
exchange: CPU ranks measure how the exchange is scheduled, not how it fights the model.

The model (:class:`GPULikeModel`, a gluon Block): one emulated layer per convolution or dense
layer of the zoo's ``get_model(name)``, owning that layer's weight and the parameters after
it up to the next weight, each with the zoo's name, shape, order and grad_req.

Times: a step's compute is batch / images_per_s, split over the layers by forward FLOPs (for
one 224x224 image), a third forward, two thirds backward. ResNet-50 v1: 125 images/s per GPU
at batch 32 (or 400); other models at its FLOP throughput (a stated rule).

The emulated GPU: every layer op is compiled code (numba, no GIL) on the engine's one worker
thread of cpu(1), as a GPU's stream; it does its small real work, then sleeps in
clock_nanosleep. Engine dependencies are the real model's, so layer i's gradients can be
exchanged while the layers below are still in backward. Needs ThreadedEnginePerDevice.

Gradients are deterministic: ``model(scale)`` (step_scale per (step, rank)) makes parameter
j's gradient ``grad_unit(j) * scale`` everywhere, recomputed in numpy by the checks; filling
them is the compute's only CPU work. GPULikeSGD runs each SGD update on the emulated GPU.
gpu_like_symbol builds the same layers as Python CustomOps for Module (results, not timings).

Host load: ``--layers custom`` (CustomLayersModel) runs every layer as that CustomOp under
autograd; ``--host-load F`` (HostLoad) a thread holding the GIL a share F of the time.
"""
import argparse
import collections
import ctypes
import functools
import json
import threading
import time

import mxnet as mx
import numba
import numpy as np
from mxnet import autograd, gluon
from mxnet.base import _LIB
from numba import types
from numba.extending import intrinsic

from benchmarks import harness
from mpi_kvstore.config import Config, ConfigError
from mpi_kvstore.engine.arrays import array_pointer, host_view

# mobilenet0.25 (1.9 MB of gradients) is there for smoke tests: a run in seconds.
MODELS = ('mobilenet0.25', 'resnet18_v1', 'resnet50_v1', 'vgg11', 'vgg16')
IMAGE = (1, 3, 224, 224)                # one ImageNet image: the zoo nets' input
RESNET50_IMAGES_PER_S = (125.0, 400.0)  # per GPU at batch 32: the slow and the fast GPU
BATCH = 32
FORWARD_SHARE = 1 / 3                   # backward = 2 x forward
COMPUTE_DEVICE = 1                      # cpu(1)'s engine worker is the emulated GPU's stream
_SHAPE_OPS = {'Convolution', 'FullyConnected'}


class ParamSpec(collections.namedtuple('ParamSpec', 'name shape grad_req flops')):
    """One zoo parameter: name without the net's prefix, shape, grad_req, and the forward
    FLOPs per image of the layer whose weight it is (0 for every other parameter)."""

    @property
    def size(self):
        return int(np.prod(self.shape))


class Layer(collections.namedtuple('Layer', 'index params flops forward_s backward_s')):
    """One emulated layer: its parameters (ParamSpecs, the weight first), forward FLOPs per
    image, and seconds of forward and of backward per step."""


class Plan(collections.namedtuple('Plan', 'model images_per_s batch compute_s layers')):
    """A model's emulated layers at a speed: compute_s = batch / images_per_s a step."""

    @property
    def params(self):
        return [p for layer in self.layers for p in layer.params]

    @property
    def grad_bytes(self):
        """Bytes of float32 gradients a step writes (what the exchange carries)."""
        return 4 * sum(p.size for p in self.params if p.grad_req != 'null')


# ---------------------------------------------------------------- shapes and FLOPs

@functools.cache
def zoo_params(model):
    """The ParamSpecs of model zoo net `model` (1000 classes), in its collect_params order.

    Shapes, and each convolution's output shape, come from shape inference on the net's
    symbol for one 224x224 image: nothing is allocated or computed."""
    if model not in MODELS:
        raise ValueError(f'unknown model {model!r}: use one of {", ".join(MODELS)}')
    from mxnet.gluon.model_zoo import vision  # the zoo is needed only here
    net = vision.get_model(model)
    out = net(mx.sym.var('data'))
    internals = out.get_internals()
    arg_shapes, out_shapes, aux_shapes = internals.infer_shape(data=IMAGE)
    shapes = dict(zip(internals.list_arguments(), arg_shapes))
    shapes.update(zip(internals.list_auxiliary_states(), aux_shapes))
    flops = _weight_flops(json.loads(out.tojson())['nodes'], shapes,
                          dict(zip(internals.list_outputs(), out_shapes)))
    prefix = net.prefix
    return tuple(ParamSpec(name[len(prefix):] if name.startswith(prefix) else name,
                           tuple(int(d) for d in shapes[name]), param.grad_req, flops.get(name, 0))
                 for name, param in net.collect_params().items())


def _weight_flops(nodes, shapes, outputs):
    """{weight name: forward FLOPs per image} of every convolution and dense layer."""
    flops = {}
    for node in nodes:
        if node['op'] not in _SHAPE_OPS:
            continue
        weight = nodes[node['inputs'][1][0]]['name']
        macs = int(np.prod(shapes[weight]))       # Cout * Cin/groups * kh * kw, or out * in
        if node['op'] == 'Convolution':
            macs *= int(np.prod(outputs[node['name'] + '_output'][2:]))    # Hout * Wout
        flops[weight] = 2 * macs
    return flops


def total_flops(model):
    """Forward FLOPs per image of the convolution and dense layers."""
    return sum(p.flops for p in zoo_params(model))


def default_images_per_s(model, resnet50_images_per_s=RESNET50_IMAGES_PER_S[0]):
    """The FLOP-proportional rule: `model` at the FLOP throughput that ResNet-50 v1 has at
    resnet50_images_per_s."""
    return resnet50_images_per_s * total_flops('resnet50_v1') / total_flops(model)


def _groups(params):
    """ParamSpecs in layers: a new layer starts at every convolution or dense weight."""
    groups = []
    for p in params:
        if p.flops or not groups:
            groups.append([])
        groups[-1].append(p)
    return groups


def plan(model, images_per_s=None, batch=BATCH):
    """The emulated layers of `model` at images_per_s (default: default_images_per_s)."""
    images_per_s = images_per_s or default_images_per_s(model)
    if images_per_s <= 0 or batch <= 0:
        raise ValueError('images_per_s and batch must be positive')
    compute_s = batch / images_per_s
    total = total_flops(model)
    layers = []
    for i, group in enumerate(_groups(zoo_params(model))):
        flops = sum(p.flops for p in group)
        share = compute_s * flops / total
        layers.append(Layer(i, tuple(group), flops, share * FORWARD_SHARE,
                            share * (1 - FORWARD_SHARE)))
    return Plan(model, images_per_s, batch, compute_s, tuple(layers))


# ---------------------------------------------------------------- deterministic values

def grad_unit(index):
    """Gradient of parameter `index` (its place in Plan.params) at scale 1: k/8, exact in
    float32, so that sums over ranks are exact too."""
    return (index % 8 + 1) / 8


def step_scale(step, rank):
    """The scale (the model's input) of rank `rank` at step `step`, in main() and the tests."""
    return float((rank + 1) * (step % 3 + 1))


def initial_value(index):
    """Parameter `index`'s every element after GPULikeModel.initialize() (default init)."""
    return (index % 5 + 1) / 100


# ---------------------------------------------------------------- the compiled layer op

@intrinsic
def _void_at(typingctx, address):
    """An int64 address as a void pointer (numba.carray reads it with a dtype)."""
    sig = types.voidptr(types.int64)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))
    return sig, codegen


_LIBC = ctypes.CDLL(None)
_clock_gettime = _LIBC.clock_gettime
_clock_gettime.argtypes, _clock_gettime.restype = [ctypes.c_int, ctypes.c_void_p], ctypes.c_int
_clock_nanosleep = _LIBC.clock_nanosleep
_clock_nanosleep.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
_clock_nanosleep.restype = ctypes.c_int
_wmemset = _LIBC.wmemset        # wchar_t is 4 bytes: a float32 fill with glibc's vector code
_wmemset.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_size_t]
_wmemset.restype = ctypes.c_void_p
_prctl = _LIBC.prctl
_prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
_prctl.restype = ctypes.c_int
CLOCK_MONOTONIC, TIMER_ABSTIME, PR_SET_TIMERSLACK = 1, 1, 29

# Every op's record starts with, in int64 words: its own address, its duration in ns and a
# timespec. A layer op's then holds the float32 addresses it reads (SRC; ADD, 0: none), writes
# (DST) and scales by (SCALE), the number of gradients it fills; then per gradient its
# address, element count and unit (float64 bits).
SELF, DURATION, TS, SRC, ADD, DST, SCALE, NFILL = 0, 1, 2, 4, 5, 6, 7, 8
HEADER, FILL = 10, 3


@numba.njit
def _float32_at(address):
    """The float32 at an int64 address, as a one-element array."""
    return numba.carray(_void_at(address), 1, np.float32)


@numba.njit
def _start(head):
    """Now + the op's duration, in ns: when the op must end. Leaves now in the timespec."""
    # The kernel may wake a sleeper up to its timer slack late (50 us by default): over
    # a hundred layers a step, several ms the model would not take. 1 ns: on time.
    _prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0)
    _clock_gettime(CLOCK_MONOTONIC, _void_at(head[SELF] + 8 * TS))
    return head[TS] * 1000000000 + head[TS + 1] + head[DURATION]


@numba.njit
def _end(head, deadline):
    """Sleep until the deadline (ns, from _start)."""
    head[TS] = deadline // 1000000000
    head[TS + 1] = deadline % 1000000000
    _clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, _void_at(head[SELF] + 8 * TS), _void_at(0))


def _layer_op(run_ctx, param):
    """The engine calls this for one layer's forward or backward: DST = SRC (+ ADD), every
    gradient = unit * SCALE, then sleep until the layer's duration since the start is up."""
    head = numba.carray(param, HEADER, dtype=np.int64)
    deadline = _start(head)
    value = _float32_at(head[SRC])[0]
    if head[ADD] != 0:
        value += _float32_at(head[ADD])[0]
    _float32_at(head[DST])[0] = value
    count = head[NFILL]
    if count > 0:
        scale = _float32_at(head[SCALE])[0]
        words = numba.carray(param, HEADER + FILL * count, dtype=np.int64)
        units = numba.carray(param, HEADER + FILL * count, dtype=np.float64)
        for k in range(count):
            at = HEADER + FILL * k
            bits = np.array([units[at + 2] * scale], np.float32).view(np.int32)[0]
            _wmemset(_void_at(words[at]), bits, words[at + 1])
    _end(head, deadline)


_SYNC_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)


class _Context(ctypes.Structure):
    _fields_ = [('dev_type', ctypes.c_int32), ('dev_id', ctypes.c_int32)]


_MX = ctypes.CDLL(_LIB._name)           # a handle of our own: argtypes set here stay here
_push_sync = _MX.MXEnginePushSyncND
_push_sync.restype = ctypes.c_int
_push_sync.argtypes = [_SYNC_FN, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                       ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_void_p,
                       ctypes.c_int, ctypes.c_char_p]
_set_grad_state = _MX.MXNDArraySetGradState
_set_grad_state.restype, _set_grad_state.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_int]
_COMPUTE_CONTEXT = _Context(1, COMPUTE_DEVICE)


@functools.cache
def _compiled():
    """The layer op as a C function (numba, about half a second once per process; not cached
    on disk, as the libc addresses it calls change from process to process)."""
    fn = numba.cfunc(types.void(types.voidptr, types.voidptr))(_layer_op)
    return fn, _SYNC_FN(fn.address)


class _Op:
    """One layer op, ready to push again and again: its record and its arrays' handles."""

    def __init__(self, name, seconds, src, dst, add=None, scale=None, fills=(), const=()):
        self.name = name.encode()
        self.record = np.zeros(HEADER + FILL * len(fills), np.int64)
        rec = self.record
        rec[SELF], rec[DURATION] = rec.ctypes.data, round(seconds * 1e9)
        rec[SRC], rec[DST] = _address(src), _address(dst)
        rec[ADD] = _address(add) if add is not None else 0
        rec[SCALE] = _address(scale) if scale is not None else 0
        rec[NFILL] = len(fills)
        for k, (grad, unit) in enumerate(fills):
            at = HEADER + FILL * k
            rec[at], rec[at + 1] = _address(grad), grad.size
            rec[at + 2:at + 3].view(np.float64)[0] = unit
        reads = [src] + ([add] if add is not None else []) + ([scale] if scale is not None else [])
        self.const = _handles(reads + list(const))
        self.mutable = _handles([dst] + [grad for grad, _ in fills])

    def push(self):
        _push(_compiled()[1], self)


def _push(fn, op):
    """Push op (its record, const and mutable handles, name) to the emulated GPU's stream."""
    if _push_sync(fn, op.record.ctypes.data, None, ctypes.addressof(_COMPUTE_CONTEXT), op.const,
                  len(op.const), op.mutable, len(op.mutable), None, 0, op.name) != 0:
        raise RuntimeError('MXEnginePushSyncND failed: ' + _LIB.MXGetLastError().decode())


def _handles(arrays):
    return (ctypes.c_void_p * len(arrays))(*[a.handle.value for a in arrays])


def _address(array):
    """The address of a float32 host NDArray's data (read in place by the layer op)."""
    address, dev_type, _ = array_pointer(array)
    if not address or dev_type != 1 or array.dtype != np.float32:
        raise ValueError(f'gpu_like needs allocated float32 host arrays, not {array.dtype} '
                         f'on device type {dev_type}')
    return address


# ---------------------------------------------------------------- the optimizer on the GPU

# An update op's record after SELF, DURATION, TS: the weight's (written) and gradient's
# addresses, the element count, the coefficient (float64 bits: lr x rescale_grad).
U_WEIGHT, U_GRAD, U_COUNT, U_COEF, U_HEADER = 4, 5, 6, 7, 8
GPU_BYTES_PER_S = 700e9    # the emulated GPU's memory (a P100's 732 GB/s): SGD moves 3 x 4 B


def _update_op(run_ctx, param):
    """SGD of one weight on the emulated GPU: every element = weight[0] - coef * grad[0] (the
    gradients are constant per parameter; check_gradients checks the rest), then sleep."""
    head = numba.carray(param, U_HEADER, dtype=np.int64)
    deadline = _start(head)
    coef = numba.carray(param, U_HEADER, dtype=np.float64)[U_COEF]
    weight = _float32_at(head[U_WEIGHT])
    grad = _float32_at(head[U_GRAD])
    value = np.float32(weight[0] - np.float32(coef) * grad[0])
    bits = np.array([value], np.float32).view(np.int32)[0]
    _wmemset(_void_at(head[U_WEIGHT]), bits, head[U_COUNT])
    _end(head, deadline)


@functools.cache
def _compiled_update():
    fn = numba.cfunc(types.void(types.voidptr, types.voidptr))(_update_op)
    return fn, _SYNC_FN(fn.address)


@mx.optimizer.register
class GPULikeSGD(mx.optimizer.Optimizer):
    """Plain SGD whose update of each weight is an op on the emulated GPU's stream: about 1 ms
    for ResNet-50's 102 MB, not the CPU's ~70 ms no GPU node pays ('gpulikesgd')."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.aggregate_num = 0        # one op per weight: the updater must not group them
        self._ops = {}

    def create_state(self, index, weight):
        return None

    def update(self, index, weight, grad, state):
        self._update_count(index)
        key = (weight.handle.value, grad.handle.value)
        op = self._ops.get(key)
        if op is None:
            op = self._ops[key] = _UpdateOp(weight, grad)
        op.push(self._get_lr(index) * self.rescale_grad)

    def update_multi_precision(self, index, weight, grad, state):
        self.update(index, weight, grad, state)


class _UpdateOp:
    """One weight's update op: its record and its arrays' handles."""

    def __init__(self, weight, grad):
        self.record = np.zeros(U_HEADER, np.int64)
        rec = self.record
        rec[SELF] = rec.ctypes.data
        rec[DURATION] = round(3 * 4 * weight.size / GPU_BYTES_PER_S * 1e9)
        rec[U_WEIGHT], rec[U_GRAD], rec[U_COUNT] = _address(weight), _address(grad), weight.size
        self.const, self.mutable = _handles([grad]), _handles([weight])
        self.name = b'gpu_like_update'

    def push(self, coef):
        self.record[U_COEF:U_COEF + 1].view(np.float64)[0] = coef
        _push(_compiled_update()[1], self)


# ---------------------------------------------------------------- the gluon model

class GPULikeModel(gluon.Block):
    """`plan_`'s layers as a gluon Block with the zoo net's parameters (named as there). A step:
    ``out = model(scale)``, ``model.backward()`` (gradient j: grad_unit(j) * scale), then
    ``trainer.step(batch)``; nothing waits. `out`: scale + every layer's first weight element."""

    def __init__(self, plan_, prefix=None, params=None):
        super().__init__(prefix=prefix or f'{plan_.model}_gpulike_', params=params)
        self.plan = plan_
        self._owned = []
        for layer in plan_.layers:
            self._owned.append([self.params.get(p.name, shape=p.shape, grad_req=p.grad_req,
                                                dtype='float32') for p in layer.params])
        # The input and the activations live on the emulated GPU: the step's first op, which
        # writes the input, runs on its stream, not behind the updates on MXNet's worker.
        gpu = mx.cpu(COMPUTE_DEVICE)
        self._input = mx.nd.zeros((1,), ctx=gpu)
        self._acts = [mx.nd.zeros((1,), ctx=gpu) for _ in plan_.layers]       # forward outputs
        self._act_grads = [mx.nd.zeros((1,), ctx=gpu) for _ in plan_.layers]  # backward outputs
        self._bound = None           # the arrays the ops were built on, and the ops

    def initialize(self, init=None, ctx=None, verbose=False, force_reinit=False):
        """The default init is initial_value(j) for parameter j: known to a test, and cheap
        (a random init of ResNet-50 takes seconds)."""
        if init is not None:
            return super().initialize(init, ctx, verbose, force_reinit)
        for index, param in enumerate(self.collect_params().values()):
            param.initialize(mx.init.Constant(initial_value(index)), ctx, force_reinit=force_reinit)
        return None

    def _ops(self):
        """(forward ops, backward ops, trainable data arrays), rebuilt when a parameter's
        arrays changed (the first step, a re-initialisation): records hold addresses."""
        arrays = [(p.data(), p.grad() if p.grad_req != 'null' else None)
                  for owned in self._owned for p in owned]
        if self._bound is not None and all(
                a is b and g is h for (a, g), (b, h) in zip(arrays, self._bound[0])):
            return self._bound[1]
        mx.nd.waitall()              # no op still runs on the old records
        forward, backward, index = [], [], 0
        for i, (layer, owned) in enumerate(zip(self.plan.layers, self._owned)):
            data = [p.data() for p in owned]
            fills = []
            for p in owned:
                if p.grad_req not in ('write', 'null'):
                    raise ValueError(f'{p.name}: grad_req {p.grad_req!r}; gpu_like writes '
                                     "gradients ('write') or none ('null')")
                if p.grad_req == 'write':
                    fills.append((p.grad(), grad_unit(index)))
                index += 1
            previous = self._input if i == 0 else self._acts[i - 1]
            forward.append(_Op('gpu_like_forward', layer.forward_s, previous, self._acts[i],
                               add=data[0], const=data[1:]))
            above = self._acts[-1] if i == len(self._owned) - 1 else self._act_grads[i + 1]
            backward.append(_Op('gpu_like_backward', layer.backward_s, above,
                                self._act_grads[i], scale=self._input, fills=fills))
        trained = [p.data().handle for owned in self._owned for p in owned
                   if p.grad_req != 'null']
        self._bound = (arrays, (forward, backward[::-1], trained))
        return self._bound[1]

    def forward(self, scale=1.0):
        forward, _, _ = self._ops()
        self._input[:] = scale       # an engine op: after the last step's backward read it
        for op in forward:
            op.push()
        return self._acts[-1]

    def backward(self):
        """Push the backward of the last forward, and mark the gradients fresh as autograd
        does (gluon.Trainer refuses stale ones)."""
        _, backward, trained = self._bound[1] if self._bound else self._ops()
        for op in backward:
            op.push()
        for handle in trained:
            _set_grad_state(handle, 1)


def compute(model, steps, rank=0, first=0):
    """`steps` steps of forward and backward alone (no trainer), each waited for."""
    for step in range(first, first + steps):
        model(step_scale(step, rank))
        model.backward()
        mx.nd.waitall()


def measure_compute(model, steps, warmups=1, rank=0):
    """compute() of `model`, `steps` times after `warmups`, on this process alone: {'wall_s',
    'cpu_s': [a figure a step], 'cpu_share' (CPU over wall), 'compute_s' (the stated time)}."""
    from mpi4py import MPI  # a communicator of this process alone: nothing waits on others
    compute(model, warmups, rank)
    samples = [harness.timed_run(functools.partial(compute, model, 1, rank, warmups + i), MPI.COMM_SELF)[1]
               for i in range(steps)]
    walls, cpus = [s['wall_s'] for s in samples], [s['cpu_s'] for s in samples]
    return {'wall_s': walls, 'cpu_s': cpus, 'cpu_share': sum(cpus) / sum(walls),
            'compute_s': model.plan.compute_s}


def train(model, trainer, steps, batch, rank):
    """`steps` steps of forward, backward and trainer.step(batch), one waitall at the end: the
    next forward of layer i waits only for weight i (engine dependencies)."""
    for step in range(steps):
        model(step_scale(step, rank))
        model.backward()
        trainer.step(batch)
    mx.nd.waitall()


# ---------------------------------------------------------------- a GIL load

HOST_LOAD_PERIOD_S = 0.01     # one busy-then-sleep cycle: a data pipeline's batch-sized bites
_SPIN = 200                   # pure-Python loop turns between two reads of the thread's clock


def _spin(cpu_s):
    """Pure Python (nothing that releases the GIL) until this thread has used cpu_s more
    seconds of CPU."""
    end = time.thread_time() + cpu_s
    while time.thread_time() < end:
        for _ in range(_SPIN):
            pass


class HostLoad:
    """A thread holding the GIL `fraction` of the time, as a data pipeline: every period_s,
    fraction * period_s CPU seconds of pure Python, then sleep. A context manager (0: no
    thread); after exit `cycles` and `busy_share` (CPU over wall; `fraction` when idle)."""

    def __init__(self, fraction, period_s=HOST_LOAD_PERIOD_S):
        if not 0 <= fraction <= 1:
            raise ValueError(f'--host-load: {fraction!r} is not a share of the time in [0, 1]')
        if period_s <= 0:
            raise ValueError(f'HostLoad period_s: {period_s!r} is not a positive number of seconds')
        self.fraction, self.period_s = float(fraction), period_s
        self.busy_share, self.cycles = 0.0, 0
        self._stop = threading.Event()
        self._thread = None

    def _run(self):
        wall, cpu = time.perf_counter(), time.thread_time()
        start = wall
        while not self._stop.is_set():
            _spin(self.fraction * self.period_s)
            self.cycles += 1
            start += self.period_s
            # Event.wait releases the GIL; a late cycle is not paid back: the next starts now
            self._stop.wait(max(0.0, start - time.perf_counter()))
            start = max(start, time.perf_counter())
        self.busy_share = (time.thread_time() - cpu) / max(1e-9, time.perf_counter() - wall)

    def __enter__(self):
        if self.fraction > 0:
            self._thread = threading.Thread(target=self._run, name='gpu_like host load',
                                            daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None


# ---------------------------------------------------------------- Module: a symbol of CustomOps

OP_TYPE = 'gpu_like_layer'


def _sleep_until(deadline):
    left = deadline - time.perf_counter()
    if left > 0:
        time.sleep(left)


class _LayerCustomOp(mx.operator.CustomOp):
    """The layer op in Python (Module's symbols): the same values and times."""

    def __init__(self, forward_s, backward_s, grads):
        super().__init__()
        self._forward_s, self._backward_s, self._grads = forward_s, backward_s, grads

    def forward(self, is_train, req, in_data, out_data, aux):
        deadline = time.perf_counter() + self._forward_s
        self.assign(out_data[0], req[0], in_data[0] + in_data[1].reshape((-1,))[:1])
        _sleep_until(deadline)

    def backward(self, req, out_grad, in_data, out_data, in_grad, aux):
        deadline = time.perf_counter() + self._backward_s
        self.assign(in_grad[0], req[0], out_grad[0])
        for grad, r, value in zip(in_grad[1:], req[1:], self._grads):
            if r in ('write', 'inplace'):
                # The op holds the gradient for writing: fill its memory in place (a third of
                # the time of MXNet's fill op, and nothing pushed).
                host_view(array_pointer(grad)[0], grad.size * 4, np.float32).fill(value)
            elif r == 'add':
                grad[:] += value
        _sleep_until(deadline)


@mx.operator.register(OP_TYPE)
class _LayerCustomProp(mx.operator.CustomOpProp):
    """Inputs: the previous activation, the parameters; strings forward_s, backward_s, grads."""

    def __init__(self, forward_s, backward_s, grads):
        super().__init__(need_top_grad=True)
        self._forward_s, self._backward_s = float(forward_s), float(backward_s)
        self._grads = [float(g) for g in grads.split(',')]
        self._arguments = ['data'] + ['param%d' % i for i in range(len(self._grads))]

    def list_arguments(self):
        return self._arguments

    def list_outputs(self):
        return ['output']

    def infer_shape(self, in_shape):
        return in_shape, [in_shape[0]], []

    def infer_type(self, in_type):
        return [np.float32] * len(in_type), [np.float32], []

    def declare_backward_dependency(self, out_grad, in_data, out_data):
        return list(out_grad)

    def create_operator(self, ctx, shapes, dtypes):
        return _LayerCustomOp(self._forward_s, self._backward_s, self._grads)


def gpu_like_symbol(plan_, scale=1.0, prefix=''):
    """`plan_` as a symbol for Module: input 'data' (1,), output a MakeLoss; parameters named
    prefix + zoo name (fixed: fixed_param_names). Gradient j is grad_unit(j) * scale."""
    out = mx.sym.var('data', shape=(1,), dtype='float32')
    index = 0
    for layer in plan_.layers:
        params = [mx.sym.var(prefix + p.name, shape=p.shape, dtype='float32')
                  for p in layer.params]
        grads = ','.join(repr(grad_unit(index + k) * scale) for k in range(len(params)))
        index += len(params)
        out = mx.sym.Custom(out, *params, op_type=OP_TYPE, forward_s=repr(layer.forward_s),
                            backward_s=repr(layer.backward_s), grads=grads)
    return mx.sym.MakeLoss(out, name='loss')


class CustomLayersModel(GPULikeModel):
    """GPULikeModel with every layer a Python CustomOp under autograd, as users' custom layers
    are (the GIL on MXNet's custom-op threads): the same values, gradients and times."""

    def __init__(self, plan_, prefix=None, params=None):
        super().__init__(plan_, prefix=prefix, params=params)
        # Autograd runs an op on its inputs' context: the parameters' cpu(0).
        self._input = mx.nd.zeros((1,))
        self._out = None

    def forward(self, scale=1.0):
        self._input[:] = scale
        out, index = self._input, 0
        with autograd.record():
            for layer, owned in zip(self.plan.layers, self._owned):
                # The gradients are constants of the op: a new op each call carries this
                # step's scale (imperative Custom builds its CustomOpProp per call).
                grads = ','.join(repr(grad_unit(index + k) * scale) for k in range(len(owned)))
                index += len(owned)
                out = mx.nd.Custom(out, *[p.data() for p in owned], op_type=OP_TYPE,
                                   forward_s=repr(layer.forward_s),
                                   backward_s=repr(layer.backward_s), grads=grads)
        self._out = out
        return out

    def backward(self):
        if self._out is None:
            raise RuntimeError('CustomLayersModel.backward() before a forward')
        self._out.backward()
        self._out = None


LAYERS = {'compiled': GPULikeModel, 'custom': CustomLayersModel}


def make_model(plan_, layers='compiled', prefix=None):
    """`plan_` as --layers says: 'compiled' (GPULikeModel) or 'custom' (CustomLayersModel)."""
    if layers not in LAYERS:
        raise ValueError(f'--layers: {layers!r} is not one of {", ".join(LAYERS)}')
    return LAYERS[layers](plan_, prefix=prefix)


def fixed_param_names(plan_, prefix=''):
    """The parameters Module must not train: batch norm's running statistics."""
    return [prefix + p.name for p in plan_.params if p.grad_req == 'null']


def module_arg_params(plan_, prefix=''):
    """Module.init_params's arg_params: GPULikeModel's initial values (Module's initializers
    do not know batch norm's running statistics as arguments)."""
    return {prefix + p.name: mx.nd.full(p.shape, initial_value(index))
            for index, p in enumerate(plan_.params)}


def fixed_options(text):
    """'partition_bytes=4M,credit_bytes=16M' -> {name: value}, checked as the store checks
    them; compression and autotune have options of their own."""
    pairs = [item.split('=', 1) for item in harness.names(text)]
    if any(len(pair) != 2 for pair in pairs):
        raise argparse.ArgumentTypeError(f'{text!r}: use name=value,name=value')
    options = dict(pairs)
    taken = sorted({'compression', 'autotune', 'autotune_steps'} & set(options))
    if taken:
        raise argparse.ArgumentTypeError(f'{text!r}: {", ".join(taken)} is set by --compression '
                                         'or the autotuned column, not here')
    try:
        Config(environ={}, **options)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(f'{text!r}: {exc}') from None
    return options


def check_gradients(model, step, nranks):
    """Every element of every gradient holds step `step`'s sum over ranks (numpy): where the
    trainer leaves the summed gradients (update_on_kvstore off), this checks the exchange in
    full, which GPULikeSGD's weights (element 0 stands for all) do not."""
    total = sum(step_scale(step, r) for r in range(nranks))
    for index, (spec, param) in enumerate(zip(model.plan.params, model.collect_params().values())):
        if spec.grad_req == 'null':
            continue
        got = param.grad().asnumpy()
        expected = np.float32(sum(np.float32(grad_unit(index) * step_scale(step, r))
                                  for r in range(nranks)))
        if not np.allclose(got, expected, rtol=1e-6, atol=0):
            bad = np.flatnonzero(~np.isclose(got.ravel(), expected, rtol=1e-6, atol=0))
            raise RuntimeError(f'{param.name}: gradient after step {step} differs from the sum '
                               f'over ranks {expected} (scale total {total}) at {bad.size} '
                               f'elements, first {bad[0]}: {got.ravel()[bad[0]]}')


def check_trained(model, lr, batch, steps, nranks, what):
    """Every parameter after `steps` steps of SGD at rate lr, `batch` images a rank, on the
    deterministic gradients (numpy): timing a wrong answer is worthless."""
    total = sum(step_scale(s, r) for s in range(steps) for r in range(nranks))
    for index, (spec, param) in enumerate(zip(model.plan.params, model.collect_params().values())):
        expected = initial_value(index)
        if spec.grad_req != 'null':
            expected -= lr * grad_unit(index) * total / (batch * nranks)
        got = param.data().asnumpy()
        if not np.allclose(got, np.float32(expected), rtol=1e-5, atol=1e-6):
            raise RuntimeError(f'{param.name} after {steps} steps of {what}: '
                               f'{got.ravel()[:3]}, expected {expected}')


def main(argv=None):
    """python -m benchmarks.gpu_like: the step of the model under mpi_kvstore.horovod's
    DistributedTrainer (GPULikeSGD), however the job was launched: mpiexec, or python -m
    mpi_kvstore run --elastic (hvd.init forms the elastic world). Rank 0 prints ms a step."""
    parser = harness.parser(main.__doc__)
    parser.add_argument('--model', default='resnet50_v1', choices=MODELS)
    parser.add_argument('--chain', type=int, default=3, help='steps a timed run')
    parser.add_argument('--trials', type=int, default=5, help='timed runs, after one untimed')
    args = parser.parse_args(argv)
    import mpi_kvstore.horovod as hvd
    from mpi_kvstore.horovod.basics import elastic_world
    hvd.init()
    comm = elastic_world().comm if elastic_world() else harness.world()
    model = make_model(plan(args.model))
    model.initialize()
    trainer = hvd.DistributedTrainer(model.collect_params(), GPULikeSGD(learning_rate=0.1))
    ms = []
    for trial in range(args.trials + 1):
        for index, param in enumerate(model.collect_params().values()):
            param.data()[:] = initial_value(index)
        _, sample = harness.timed_run(lambda: train(model, trainer, args.chain, BATCH, comm.rank), comm)
        check_trained(model, 0.1, BATCH, args.chain, comm.size, 'DistributedTrainer')
        ms += [sample['wall_s'] * 1e3 / args.chain] if trial else []
    harness.rank0_print(f'gpu_like {args.model}: {comm.size} ranks, {"elastic" if elastic_world() else "plain"}: '
                        f'ms a step {harness.median(ms):.1f} ({min(ms):.1f}-{max(ms):.1f}), '
                        f'{args.trials} runs of {args.chain}: {" ".join(f"{m:.1f}" for m in ms)}', comm=comm)


if __name__ == '__main__':
    main()
