"""The cost model's formulas: the network, the store, a training step, and the prediction
at scale (docs/cost-model.md says what they model)."""
import argparse
import math

import numpy as np

FUSION_THRESHOLD = 1 << 20          # mpi_kvstore's default fusion_threshold
FUSING_DESIGNS = ('funneled', 'concurrent')     # fuse across gluon.Trainer's per-key calls
IMAGENET_TRAIN = 1281167
GBIT = 1e9 / 8                      # bytes per second in one Gbit/s
AGREEMENT_BYTES = 8     # the small allreduce with which ranks agree before each collective


# ---------------------------------------------------------------- the network

class Link:
    """alpha: seconds per message step; beta: seconds per byte a way (reduction included)."""

    def __init__(self, alpha, beta):
        self.alpha, self.beta = float(alpha), float(beta)

    def __repr__(self):
        bw = 1 / self.beta / 1e9 if self.beta > 0 else float('inf')
        return f'Link(alpha={self.alpha * 1e6:.1f} us, {bw:.3g} GB/s)'

    def as_dict(self):
        return {'alpha_s': self.alpha, 'beta_s_per_byte': self.beta,
                'GBps': 1 / self.beta / 1e9 if self.beta > 0 else None}


class Topology:
    """p ranks, k to a host, and the links between and inside hosts."""

    def __init__(self, ranks, per_host, net, shm):
        if ranks % per_host:
            raise ValueError(f'{ranks} ranks do not fill hosts of {per_host}')
        self.p, self.k, self.h = ranks, per_host, ranks // per_host
        self.net, self.shm = net, shm


def _log2(x):
    return math.log2(x) if x > 1 else 0.0


def allreduce_flat(n, topo):
    """MPICH's reduce-scatter + allgather, hosts' ranks in blocks (docs/cost-model.md)."""
    p, k, h = topo.p, topo.k, topo.h
    if p == 1 or n == 0:
        return 0.0
    net = 2 * _log2(h) * topo.net.alpha + 2 * k * n * (1 - 1 / h) * topo.net.beta if h > 1 else 0.0
    shm = 2 * _log2(k) * topo.shm.alpha + 2 * n * (1 / h - 1 / p) * topo.shm.beta if k > 1 else 0.0
    return net + shm


def allreduce_hier(n, topo):
    """As the store's hierarchical option: reduce-scatter inside each host, the k pieces of
    n/k allreduced across hosts at once (together n over each host's link), allgather inside
    each host."""
    if topo.k == 1 or topo.h == 1:
        return allreduce_flat(n, topo)
    inside = _log2(topo.k) * topo.shm.alpha + n * (topo.k - 1) / topo.k * topo.shm.beta
    across = 2 * _log2(topo.h) * topo.net.alpha + 2 * n * (1 - 1 / topo.h) * topo.net.beta
    return 2 * inside + across


def allreduce_time(n, topo, hierarchical=False):
    return allreduce_hier(n, topo) if hierarchical else allreduce_flat(n, topo)


# ---------------------------------------------------------------- the store

class Store:
    """What a store adds to MPI: sigma once per exchange, kappa per array, per_collective per
    collective, and how it fuses (threshold in bytes; 0: one collective per array). stage:
    seconds per byte to copy a collective's data to and from where MPI reads it (GPU to host
    and back), 0 on the CPU."""

    def __init__(self, sigma, kappa, threshold=FUSION_THRESHOLD, stage=0.0, per_collective=0.0):
        self.sigma, self.kappa, self.threshold, self.stage = sigma, kappa, threshold, stage
        self.per_collective = per_collective


class _Gradient:
    """What mpi_kvstore.comm.fusion.plan reads of a request: a float32 allreduce on the CPU, all of
    one priority, so that it keeps the order given (seq)."""
    kind, priority, dtype, average, factor, place = 'allreduce', 0, 'float32', False, 1.0, 'cpu'

    def __init__(self, index, nbytes, seq):
        self.index, self.nbytes, self.seq = index, nbytes, seq


def buckets(sizes, threshold):
    """[[index, ...], ...] of [(index, bytes), ...] as the store plans them, in the order
    given: an array above the threshold alone, neighbouring smaller ones together up to the
    threshold; threshold 0: each alone."""
    # Imported here: mpi_kvstore's package imports MXNet and starts MPI (seconds), which
    # --help and the report's tables do not need.
    from mpi_kvstore.comm.fusion import plan
    requests = [_Gradient(i, size, seq) for seq, (i, size) in enumerate(sizes)]
    return [[req.index for req in bucket] for bucket in plan(requests, threshold)]


def on(topo, hierarchical=False):
    """The allreduce time of n bytes on a topology, as a function of n."""
    return lambda n: allreduce_time(n, topo, hierarchical)


def collective_time(nbytes, arrays, allreduce, store):
    return (store.per_collective + allreduce(nbytes) + store.kappa * arrays
            + 2 * nbytes * store.stage)


def exchange_time(sizes, allreduce, store):
    """The exchange alone: every array ready, collectives one after another. allreduce(n):
    seconds for n bytes (on(topology), or a line fitted on the test bed)."""
    plan = buckets(list(enumerate(sizes)), store.threshold)
    return store.sigma + sum(collective_time(sum(sizes[i] for i in b), len(b), allreduce, store)
                             for b in plan), len(plan)


def step_time(compute, sizes, allreduce, store, overlap=0.0, fwd_share=1 / 3):
    """A training step: compute plus what of the exchange backward does not hide
    (docs/cost-model.md). Returns (step seconds, exposed communication seconds, collectives)."""
    forward = fwd_share * compute
    backward = compute - forward
    n = len(sizes)
    end_of_backward = forward + backward
    # Backward makes the last array first; array i exists at made(i).
    made = {i: forward + backward * (n - i) / n for i in range(n)}
    ready = {i: made[i] + (1 - overlap) * (end_of_backward - made[i]) for i in range(n)}
    order = sorted(range(n), key=lambda i: (ready[i], -i))
    plan = buckets([(i, sizes[i]) for i in order], store.threshold)
    end = 0.0
    for bucket in plan:
        start = max(end, *(ready[i] for i in bucket))
        end = start + collective_time(sum(sizes[i] for i in bucket), len(bucket), allreduce, store)
    step = max(compute, end + store.sigma)
    return step, step - compute, len(plan)


# ---------------------------------------------------------------- prediction at scale

def resnet50_sizes():
    """Gradient sizes of model-zoo resnet50_v1 (1000 classes), in the Trainer's order: from
    MXNet's shape inference (no compute), else the stored list."""
    try:
        import mxnet as mx
        from mxnet.gluon.model_zoo import vision
        net = vision.resnet50_v1(classes=1000)
        params = net.collect_params()
        sym = net(mx.sym.var('data'))
        shapes = dict(zip(sym.list_arguments(), sym.infer_shape(data=(1, 3, 224, 224))[0]))
        return [int(np.prod(shapes[name])) * 4 for name, p in params.items()
                if p.grad_req != 'null' and name in shapes]
    except Exception as exc:
        raise SystemExit(f'cannot build resnet50_v1 to size its gradients: {exc}') from exc


def cluster_topology(args, gpus):
    per_node = min(args.gpus_per_node, gpus)
    net = Link(args.net_latency_us * 1e-6, 1 / (args.net_gbit * GBIT * args.net_efficiency))
    shm = Link(args.intra_latency_us * 1e-6, 1 / (args.intra_gbytes * 1e9))
    return Topology(gpus, per_node, net, shm)


def cluster_store(args, topo, threshold):
    """On a real node: per collective the store's own cost plus the agreement (one small
    allreduce over all ranks); sigma (once) is the same own cost."""
    agreement = allreduce_flat(8, topo)
    stage = 1 / (args.stage_gbytes * 1e9) if args.stage_gbytes > 0 else 0.0
    return Store(args.sigma_us * 1e-6, args.kappa_us * 1e-6, threshold, stage,
                 per_collective=args.sigma_us * 1e-6 + agreement)


VARIANTS = [
    # name, overlap, fusion threshold, hierarchical
    ('no overlap, no fusion, flat', 0.0, 0, False),
    ('no overlap, fusion, flat', 0.0, FUSION_THRESHOLD, False),
    ('no overlap, fusion, hierarchical', 0.0, FUSION_THRESHOLD, True),
    ('overlap, no fusion, flat', 1.0, 0, False),
    ('overlap, fusion, flat (funneled today)', 1.0, FUSION_THRESHOLD, False),
    ('overlap, no fusion, hierarchical', 1.0, 0, True),
    ('overlap, fusion, hierarchical', 1.0, FUSION_THRESHOLD, True),
]
HEADLINE = 'overlap, fusion, flat (funneled today)'
GPUS_AXIS = (4, 8, 16, 32, 64, 128, 256, 512, 1024)     # the scaling sweep's cluster sizes


def predict(args, sizes, gpus, overlap, threshold, hierarchical, gpu_rate=None, net_gbit=None):
    if net_gbit is not None:
        args = argparse.Namespace(**dict(vars(args), net_gbit=net_gbit))
    rate = gpu_rate or args.gpu_images_per_s
    compute = args.batch_per_gpu / rate
    topo = cluster_topology(args, gpus)
    store = cluster_store(args, topo, threshold)
    step, exposed, collectives = step_time(compute, sizes, on(topo, hierarchical), store, overlap,
                                           args.fwd_share)
    alone, _ = exchange_time(sizes, on(topo, hierarchical), store)
    steps = math.ceil(args.images / (args.batch_per_gpu * gpus))
    return {'gpus': gpus, 'step_ms': step * 1e3, 'compute_ms': compute * 1e3,
            'exposed_ms': exposed * 1e3, 'exchange_alone_ms': alone * 1e3,
            'collectives': collectives, 'images_per_s': args.batch_per_gpu * gpus / step,
            'epoch_s': steps * step, 'epoch_compute_only_s': steps * compute,
            'efficiency': compute / step}


def overlap_step(compute, exchange, h):
    return compute + exchange - h * min(compute, exchange)


def predict_with_overlap(args, sizes, gpus, h):
    """The prediction at scale with the learned overlap: flat allreduce, fusion on."""
    compute = args.batch_per_gpu / args.gpu_images_per_s
    topo = cluster_topology(args, gpus)
    store = cluster_store(args, topo, FUSION_THRESHOLD)
    exchange, _ = exchange_time(sizes, on(topo, False), store)
    step = overlap_step(compute, exchange, h)
    steps = math.ceil(args.images / (args.batch_per_gpu * gpus))
    return {'gpus': gpus, 'h': h, 'step_ms': step * 1e3, 'compute_ms': compute * 1e3,
            'exchange_alone_ms': exchange * 1e3, 'epoch_s': steps * step,
            'images_per_s': args.batch_per_gpu * gpus / step, 'efficiency': compute / step}


