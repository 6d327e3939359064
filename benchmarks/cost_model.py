"""An alpha-beta model of a data-parallel training step, calibrated on the test bed.

    python -m benchmarks.cost_model                  # seconds: fit, check and predict from the
                                                     # json of benchmarks/testbed_scaling.py
    python -m benchmarks.cost_model --measured FILE [--calibration FILE,...] [--out DIR]
    python -m benchmarks.cost_model --calibrate [--rates 1gbit,3gbit,10gbit] [--ranks 1,2,4]
                                                     # measures first (minutes): allreduce
                                                     # sweeps and a 1-rank job on the test bed
    python -m benchmarks.cost_model --predict-only [--gpus 256 --gpu-images-per-s 125 ...]
    python -m benchmarks.cost_model --overlap A.json,B.json,... [--fit-on A]
                                                     # h per schedule learned on GPU-like runs
                                                     # of benchmarks/overlap.py (see below)

The model (times in seconds, sizes in bytes)
--------------------------------------------
Network. p ranks on H hosts, k = p/H a host, placed in blocks (ranks 0..k-1 on the first
host, as `mpiexec -ppn k` does). MPICH's allreduce of n bytes (power-of-two p) is a
reduce-scatter by recursive halving then an allgather by recursive doubling: in each phase,
step j (j = 1..log2 p) exchanges n/2^j bytes with the rank p/2^j away. The first log2 H steps
cross hosts, and all k ranks of a host send at once over its one link; the last log2 k steps
stay inside a host (shared memory). So, with a (alpha) the latency of one step and b (beta)
the time per byte a way, reduction included:

    T_flat(n) = 2 log2(H) a_net + 2 k n (1 - 1/H) b_net + 2 log2(k) a_shm + 2 n (1/H - 1/p) b_shm

(p = 2, k = 1: 2 a_net + n b_net). Hierarchical, as the store's `hierarchical` option does it
(reduce-scatter inside each host, each rank's piece of n/k allreduced across hosts, the k
pieces of a host at once, allgather inside each host), carries k times fewer bytes over each
link:

    T_hier(n) = 2 [log2(k) a_shm + n (k-1)/k b_shm] + 2 log2(H) a_net + 2 n (1 - 1/H) b_net

Store. The gradients (sizes s_i in the Trainer's order) travel as collectives. With fusion,
neighbouring arrays of at most `threshold` bytes share one collective of at most `threshold`
bytes and bigger ones travel alone (mpi_kvstore.fusion.plan, the store's own planner); without, one collective
per array. funneled and concurrent fuse whatever is pending when they negotiate (gluon.Trainer's
per-parameter calls too); chained and blocking run each call on its own, so they fuse only
inside one grouped call (DistributedTrainer). On top of MPI the store costs sigma once per
exchange, kappa per array and c per collective (the agreement: one small allreduce), plus,
for GPU arrays without a CUDA-aware MPI, a copy to the host and back:

    T_x = sigma + sum over collectives of (c + T_allreduce(bytes) + 2 bytes stage) + kappa arrays

Step. Compute T_c (forward, backward, update) splits into forward (fwd_share) and backward;
backward makes the gradients in reverse order, one array after another at an even pace. A
collective starts once its arrays exist and the previous one has finished (one
communication thread). The overlap fraction h in [0, 1] is how much of backward
communication can run beside: a gradient made at time t counts as ready at
t + (1 - h)(end of backward - t). h = 0: everything starts after backward, T_step = T_c + T_x;
h = 1: wait-free backpropagation. In general T_step = max(T_c, end of the last collective).

The test bed (h = 0: all hosts share the machine's 2 cores and as many ranks as cores
compute, so no core is free to move data beside them; measured 'hidden' is near 0):
- T_allreduce on each test bed (rate, ranks, ranks a host) is a line a + b n fitted to raw
  MPI Allreduce(IN_PLACE) timed on that test bed: a from the sizes <= 64 KB, b the median
  per-byte time of the sizes >= 4 MB (tbf lets a 2 ms burst through at full speed, so 1 MB
  runs faster than the link; an exchange's back-to-back collectives see the sustained rate).
  scaling.py times them inside the training job's exchange-alone rounds (testbed_scaling.py
  passes --raw-allreduce), so under the load the exchanges saw; else a separate
  allreduce.py sweep on the same test bed.
  a_net, b_net per rate follow from the 2-rank line (a = 2 a_net); the 4-rank lines check
  the flat and hierarchical formulas (the "topology" table);
- sigma: each config's exchange alone on 1 rank, where no byte crosses a network (the same
  arrays, calls and fusion), scaled by ranks / cores where ranks outnumber the cores (it is
  CPU time); kappa = 0 (inside sigma); c = the line at 8 bytes;
- T_c: each job's measured step of `none` (the same ranks, exchanging nothing).
The multi-rank training measurements are the check: nothing is fitted to them.

At scale: ResNet-50 (model-zoo resnet50_v1, 1000 classes: 102 MB of float32 gradients in 193
arrays, its bottleneck convolutions having biases) on ImageNet-1k (1,281,167 training
images), with stated assumptions for GPU speed, cluster and network (--help, and the
printed list); an epoch is its steps x T_step, I/O ignored.
"""
import argparse
import json
import math
import os
import sys
import time

import numpy as np

import testbed
from benchmarks import harness

REPO_ROOT = harness.REPO_ROOT
DEFAULT_DIR = os.path.join(harness.DEFAULT_OUT, 'testbed')
DEFAULT_MEASURED = os.path.join(DEFAULT_DIR, 'testbed_scaling.json')
CALIBRATION_DIR = os.path.join(DEFAULT_DIR, 'calibration')
TARGET_ERROR = 0.15
FUSION_THRESHOLD = 1 << 20          # mpi_kvstore's default fusion_threshold
FUSING_DESIGNS = ('funneled', 'concurrent')     # fuse across gluon.Trainer's per-key calls
IMAGENET_TRAIN = 1281167
GBIT = 1e9 / 8                      # bytes per second in one Gbit/s


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
    """MPICH's reduce-scatter + allgather, hosts' ranks in blocks (see the module docstring)."""
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
    """What mpi_kvstore.fusion.plan reads of a request: a float32 allreduce on the CPU, all of
    one priority, so that it keeps the order given (seq)."""
    kind, priority, dtype, average, place = 'allreduce', 0, 'float32', False, 'cpu'

    def __init__(self, index, nbytes, seq):
        self.index, self.nbytes, self.seq = index, nbytes, seq


def buckets(sizes, threshold):
    """[[index, ...], ...] of [(index, bytes), ...] as the store plans them, in the order
    given: an array above the threshold alone, neighbouring smaller ones together up to the
    threshold; threshold 0: each alone."""
    # Imported here: mpi_kvstore's package imports MXNet and starts MPI, which --calibrate
    # would otherwise do before it launches its MPI jobs.
    from mpi_kvstore.fusion import plan
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
    """A training step: compute plus what of the exchange backward does not hide (module
    docstring). Returns (step seconds, exposed communication seconds, collectives)."""
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


# ---------------------------------------------------------------- calibration

def _rows(payload, method, case='allreduce'):
    return {r['bytes']: r['latency_us'] * 1e-6 for r in payload['results']
            if r['method'] == method and r['case'] == case}


def _fit_line(xs, ys):
    """Least squares y = a + b x with a, b >= 0, each point weighted by 1/y (relative error)."""
    xs, ys = np.asarray(xs, float), np.asarray(ys, float)
    if len(xs) == 1:
        return 0.0, max(0.0, ys[0] / xs[0])
    w = 1 / ys
    (a, b), *_ = np.linalg.lstsq(np.stack([w, xs * w], axis=1), np.ones_like(ys), rcond=None)
    if a < 0:
        a, b = 0.0, float(np.sum(xs * ys * w * w) / np.sum(xs * xs * w * w))
    if b < 0:
        a, b = float(np.median(ys)), 0.0
    return float(a), float(b)


def _split_fit(times, small=64 << 10, large=4 << 20):
    """(a, b) of T(n) = a + b n: a from the sizes <= small (latency), b the median over the
    sizes >= large of (T(n) - a) / n (else the largest size). tbf lets a burst of 2 ms at the
    rate through at full speed (250 KB at 1 Gbit/s, 2.5 MB at 10), so 1 MB runs faster than
    the link; back-to-back collectives, as an exchange makes, drain the burst. From 4 MB every
    size is past the burst, and the exchange's own collectives are 1 to 9 MB. The median
    keeps one odd size from tilting the line (on 4 ranks at 2 a host, 43 MB ran slower per
    byte than 4 and 16 MB: two TCP flows share each shaped link and its 20 ms queue)."""
    sizes = sorted(times)
    small_sizes = [n for n in sizes if n <= small]
    intercept = float(np.median([times[n] for n in small_sizes])) if small_sizes else 0.0
    big = [n for n in sizes if n >= large] or sizes[-1:]
    slope = float(np.median([max(0.0, times[n] - intercept) / n for n in big]))
    return max(0.0, intercept), slope


class Line:
    """An allreduce on one test bed: a + b n seconds for n bytes (a fitted alpha-beta line)."""

    def __init__(self, a, b, source, points):
        self.a, self.b, self.source, self.points = a, b, source, points

    def __call__(self, n):
        return self.a + self.b * n


class Calibration:
    """Per test bed (rate, ranks, ranks a host) a fitted allreduce line; per link rate the
    network and shared-memory alpha and beta derived from them; per config the store's
    software cost on one rank."""

    def __init__(self):
        self.lines = {}                             # (rate, ranks, per_host) -> Line
        self.net, self.shm = {}, {}                 # rate -> Link
        self.software = {}                          # (model, config) -> seconds on 1 rank
        self.cores = None                           # the machine's cores, all hosts together

    def allreduce(self, rate, ranks, per_host):
        if ranks == 1:
            return lambda n: 0.0
        line = self.lines.get((rate, ranks, per_host))
        if line is None:
            raise KeyError(f'no raw allreduce measured on {ranks} ranks, {per_host} a host, at {rate}')
        return line

    def cpu_factor(self, ranks):
        """The store's software runs on CPU time: with more ranks than cores (all hosts of the
        test bed share them) each rank gets cores/ranks of one."""
        return max(1.0, ranks / self.cores) if self.cores else 1.0

    def as_dict(self):
        return {'lines': {f'{r}/n{p}/ppn{k}': {'a_s': line.a, 'b_s_per_byte': line.b, 'source': line.source,
                                                'points_s': line.points}
                          for (r, p, k), line in self.lines.items()},
                'net': {r: line.as_dict() for r, line in self.net.items()},
                'shm': {r: line.as_dict() for r, line in self.shm.items()},
                'software_ms': {f'{m}/{c}': t * 1e3 for (m, c), t in self.software.items()},
                'cores': self.cores}


def sweeps_of(combined):
    """{(rate, ranks, per_host): allreduce payload} from a testbed_scaling.py json."""
    out = {}
    for job in combined.get('jobs', []):
        if job.get('allreduce'):
            out[(job['rate'], job['ranks'], job['ppn'])] = job['allreduce']
    return out


def raw_points(job):
    """{bytes: seconds} of raw MPI Allreduce(IN_PLACE) on a job's test bed, and where from:
    timed inside the training job's exchange-alone rounds (same load as what is checked),
    else the separate allreduce.py sweep on the same test bed."""
    payload = job.get('scaling') or {}
    for entry in payload.get('models', {}).values():
        if entry.get('raw_allreduce'):
            return {r['bytes']: r['median_ms'] * 1e-3 for r in entry['raw_allreduce']}, 'interleaved'
    if job.get('allreduce'):
        return _rows(job['allreduce'], 'raw_mpi:in_place'), 'sweep'
    return None, None


def calibrate(files):
    """Fit from testbed_scaling.py jsons (see the module docstring)."""
    cal = Calibration()
    jobs = [job for combined in files for job in combined.get('jobs', [])]
    for job in jobs:
        if job['ranks'] < 2:
            continue
        points, source = raw_points(job)
        if points:
            a, b = _split_fit(points)
            cal.lines[(job['rate'], job['ranks'], job['ppn'])] = Line(a, b, source, points)
    for (rate, ranks, ppn), line in cal.lines.items():
        if ranks == 2 and ppn == 1:             # T = 2 a_net + n b_net
            cal.net[rate] = Link(line.a / 2, line.b)
    for (rate, ranks, ppn), line in cal.lines.items():
        if ranks > 2 and ppn > 1 and rate in cal.net:
            # Read hierarchically (what the topology table supports for MPICH here): what
            # the traffic across hosts (the 2-rank line) leaves is the reduce-scatter and
            # allgather inside each host, 2 [log2(k) a_shm + n (k-1)/k b_shm].
            h = ranks // ppn
            a_rest = line.a - 2 * _log2(h) * cal.net[rate].alpha
            b_rest = line.b - cal.net[rate].beta * 2 * (1 - 1 / h)
            cal.shm[rate] = Link(max(0.0, a_rest) / (2 * _log2(ppn)),
                                 max(0.0, b_rest) / (2 * (ppn - 1) / ppn))
    if not cal.lines:
        raise SystemExit('no raw allreduce timings in the calibration files: run '
                         'testbed_scaling.py (it times them beside the exchange), or '
                         'cost_model.py --calibrate')
    # The store's software: its exchange alone on one rank (no network, same arrays, same calls).
    for job in jobs:
        payload = job.get('scaling')
        if job['ranks'] != 1 or not payload:
            continue
        cal.cores = payload.get('versions', {}).get('cpu_count') or cal.cores
        for model, entry in payload['models'].items():
            for row in entry['rows']:
                if row.get('exchange_alone_ms') is not None:
                    cal.software[(model, row['config'])] = row['exchange_alone_ms'] * 1e-3
    if not cal.software:
        raise SystemExit('no 1-rank training job in the calibration files: run testbed_scaling.py '
                         'with --ranks including 1')
    return cal


def _base(design):
    return design.split('+', 1)[0]


AGREEMENT_BYTES = 8     # the small allreduce with which ranks agree before each collective


def testbed_exchange(cal, model, config, sizes, key):
    """Exchange alone on the test bed: the config's measured 1-rank software cost (scaled by
    the CPU share), then every collective's raw allreduce time and its agreement."""
    kind, design = config.split(':', 1)
    software = cal.software.get((model, config))
    if software is None:
        raise KeyError(f'no 1-rank measurement of {config} ({model})')
    grouped = kind == 'DistributedTrainer'
    threshold = FUSION_THRESHOLD if grouped or _base(design) in FUSING_DESIGNS else 0
    allreduce = cal.allreduce(*key)
    store = Store(software * cal.cpu_factor(key[1]), 0.0, threshold,
                  per_collective=allreduce(AGREEMENT_BYTES) if key[1] > 1 else 0.0)
    alone, collectives = exchange_time(sizes, allreduce, store)
    return store, allreduce, alone, collectives


# ---------------------------------------------------------------- validation

def training_points(measured, cal):
    """Every store config of every multi-rank job of testbed_scaling.py, with the model's
    prediction (1-rank jobs calibrate the software cost, so they are no check)."""
    points = []
    for job in measured.get('jobs', []):
        payload = job.get('scaling')
        if not payload or job['ranks'] == 1:
            continue
        key = (job['rate'], job['ranks'], job['ppn'])
        for model, entry in payload['models'].items():
            sizes = entry['info'].get('gradient_sizes')
            if not sizes:
                raise SystemExit(f'{model}: the scaling json has no gradient_sizes (measured '
                                 'before scaling.py recorded them)')
            rows = {r['config']: r for r in entry['rows']}
            none = rows.get('none')
            if none is None:
                continue
            compute = none['step_ms'] * 1e-3
            for name, row in rows.items():
                if ':' not in name or row.get('exchange_alone_ms') is None:
                    continue
                try:
                    store, allreduce, alone, collectives = testbed_exchange(cal, model, name, sizes, key)
                except KeyError as err:
                    points.append({'job': job['job'], 'config': name, 'skipped': str(err)})
                    continue
                step, _, _ = step_time(compute, sizes, allreduce, store, overlap=0.0)
                points.append({
                    'job': job['job'], 'layout': job['layout'], 'rate': job['rate'],
                    'ranks': job['ranks'], 'ppn': job['ppn'], 'model': model, 'config': name,
                    'collectives': collectives, 'compute_ms': compute * 1e3,
                    'software_ms': store.sigma * 1e3,
                    'alone_ms': row['exchange_alone_ms'], 'alone_model_ms': alone * 1e3,
                    'alone_error': alone * 1e3 / row['exchange_alone_ms'] - 1,
                    'step_ms': row['step_ms'], 'step_model_ms': step * 1e3,
                    'step_error': step * 1e3 / row['step_ms'] - 1,
                    'hidden_measured': row.get('hidden'),
                })
    return points


def topology_check(cal, sizes=(4 << 20, 16 << 20)):
    """The structure of the formulas, checked: from the 2-rank network fit, what N ranks N/2 a
    host take flat (k times the link bytes) and hierarchically (the 2-rank traffic across
    hosts, plus a reduce-scatter and an allgather inside each host), against what they
    measured."""
    out = []
    for (rate, ranks, ppn), line in sorted(cal.lines.items(), key=_bed_order):
        if ppn < 2 or rate not in cal.net:
            continue
        topo = Topology(ranks, ppn, cal.net[rate], Link(0, 0))      # shared memory taken as free
        for n in sizes:
            measured = line.points.get(n, line(n))
            two = cal.lines.get((rate, 2, 1))
            two = two.points.get(n, two(n)) if two else None
            out.append({'rate': rate, 'ranks': ranks, 'ppn': ppn, 'bytes': n,
                        'measured_ms': measured * 1e3, 'two_rank_ms': two and two * 1e3,
                        'ratio': two and measured / two,
                        'flat_ms': allreduce_flat(n, topo) * 1e3,
                        'hierarchical_ms': allreduce_hier(n, topo) * 1e3,
                        'intra_GBps': (2 * (ppn - 1) / ppn * n / (measured - two) / 1e9
                                       if two and measured > two else None)})
    return out


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


def _solve(f, low, high, target, steps=60):
    """x in [low, high] with f(x) = target for a monotonic f, or None when out of range."""
    f_low, f_high = f(low) - target, f(high) - target
    if f_low * f_high > 0:
        return None
    for _ in range(steps):
        mid = (low + high) / 2
        if (f(mid) - target) * f_low > 0:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def what_reads_50s(args, sizes, target=50.0):
    """What the paper's 50 s per epoch means under the model, one assumption at a time."""
    out = []
    by_variant = {name: (h, thr, hier) for name, h, thr, hier in VARIANTS}
    h, thr, hier = by_variant[HEADLINE]
    speed = _solve(lambda g: predict(args, sizes, args.gpus, h, thr, hier, gpu_rate=g)['epoch_s'],
                   10.0, 5000.0, target)
    if speed:
        out.append(f'- with everything else as assumed, {HEADLINE} reads {target:g} s at '
                   f'{speed:.0f} images/s per GPU')
    overlap = _solve(lambda x: predict(args, sizes, args.gpus, x, thr, hier)['epoch_s'], 0.0, 1.0, target)
    out.append(f'- at {args.gpu_images_per_s:g} images/s per GPU, fusion on, flat: '
               + (f'{target:g} s needs an overlap fraction h = {overlap:.2f}' if overlap is not None
                  else f'no overlap fraction in [0, 1] gives {target:g} s'))
    net = _solve(lambda bw: -predict(args, sizes, args.gpus, h, thr, hier, net_gbit=bw)['epoch_s'],
                 0.1, 1000.0, -target)
    if net:
        out.append(f'- {HEADLINE} at {args.gpu_images_per_s:g} images/s per GPU reads {target:g} s '
                   f'with a {net:.1f} Gbit/s network')
    return out


# ---------------------------------------------------------------- overlap learned on GPU-like runs
#
# On the test bed with GPU-like compute (benchmarks/gpu_like.py: layers sleep, the CPU stays
# free) a schedule's overlap can be measured: benchmarks/overlap.py times, in one job, compute
# alone (T_c), each schedule's exchange alone (T_x) and its training step. Its hidden share
#     h = (T_c + T_x - step) / min(T_c, T_x)
# is how much of the shorter of the two the schedule hides: step = T_c + T_x - h min(T_c, T_x).
# h is fitted per schedule (the median over the fitting runs), checked on runs it was not
# fitted on, and used at scale with T_c and T_x from the alpha-beta model above.

OVERLAP_SCHEDULES = ('fifo', 'priority', 'gluon')


def overlap_points(paths):
    """[{file, model, images_per_s, topology, column, compute, exchange, step, h}] of every
    mpi_kvstore column of benchmarks/overlap.py results (seconds, medians)."""
    points = []
    for path in paths:
        payload = _load(path)
        compute = payload['compute_alone']['median']
        for row in payload['columns']:
            if row['column'] not in OVERLAP_SCHEDULES or 'step' not in row:
                continue
            step, exchange = row['step']['median'], row['exchange']['median']
            points.append({'file': os.path.relpath(path, REPO_ROOT), 'model': payload['model'],
                           'images_per_s': payload['images_per_s'],
                           'topology': payload.get('config', {}).get('topology', ''),
                           'column': row['column'], 'compute': compute, 'exchange': exchange,
                           'step': step,
                           'h': (compute + exchange - step) / min(compute, exchange)})
    return points


def overlap_step(compute, exchange, h):
    return compute + exchange - h * min(compute, exchange)


def fit_overlap(points, fit_on):
    """{schedule: h} from the points whose file contains one of ``fit_on``'s names, and every
    point with the step that h predicts and its error."""
    fitting = [p for p in points if any(name in p['file'] for name in fit_on)]
    fitted = {c: float(np.median([p['h'] for p in fitting if p['column'] == c]))
              for c in OVERLAP_SCHEDULES if any(p['column'] == c for p in fitting)}
    for p in points:
        p['fitted'] = p in fitting
        if p['column'] in fitted:
            p['step_model'] = overlap_step(p['compute'], p['exchange'], fitted[p['column']])
            p['step_error'] = p['step_model'] / p['step'] - 1
    return fitted


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


def overlap_tables(points, fitted, predictions):
    lines = ['| run | schedule | compute ms | exchange alone ms | step ms | h measured | '
             'step, model ms | error | |', '|---|---|---:|---:|---:|---:|---:|---:|---|']
    for p in points:
        model = '-' if 'step_model' not in p else f'{p["step_model"] * 1e3:.0f}'
        err = '-' if 'step_error' not in p else _pct(p['step_error'])
        if 'step_error' in p and abs(p['step_error']) > TARGET_ERROR and not p['fitted']:
            err = f'**{err}**'
        lines.append(f'| {p["model"]} {p["images_per_s"]:.0f} img/s, {p["topology"]} | '
                     f'{p["column"]} | {p["compute"] * 1e3:.0f} | {p["exchange"] * 1e3:.0f} | '
                     f'{p["step"] * 1e3:.0f} | {p["h"]:.2f} | {model} | {err} | '
                     f'{"fitted" if p["fitted"] else "check"} |')
    lines += ['', 'h per schedule (median over the fitting runs): ' + ', '.join(
        f'{c} {h:.2f}' for c, h in fitted.items()), '',
        '| schedule | h | step ms | exchange alone ms | images/s | epoch s |',
        '|---|---:|---:|---:|---:|---:|']
    for c, r in predictions.items():
        lines.append(f'| {c} | {r["h"]:.2f} | {r["step_ms"]:.1f} | {r["exchange_alone_ms"]:.1f} | '
                     f'{r["images_per_s"]:.0f} | {r["epoch_s"]:.1f} |')
    return '\n'.join(lines)


# ---------------------------------------------------------------- output

def _pct(x):
    return '-' if x is None else f'{100 * x:+.1f}%'


def calibration_table(cal):
    lines = [('Raw MPI Allreduce(IN_PLACE) on each test bed, fitted a + b n (a from sizes <= 64 KB, '
             'b the median per-byte time of sizes >= 4 MB):'), '',
             '| test bed | timed | a (us) | 1/b (GB/s) | sizes: measured ms (fit ms) |',
             '|---|---|---:|---:|---|']
    for (rate, ranks, ppn), line in sorted(cal.lines.items(), key=_bed_order):
        pts = ', '.join(f'{harness.format_size(n)} {t * 1e3:.2f} ({line(n) * 1e3:.2f})'
                        for n, t in sorted(line.points.items()))
        lines.append(f'| {ranks} ranks, {ppn} a host, {rate} | {line.source} | {line.a * 1e6:.0f} | '
                     f'{_gbps(line.b)} | {pts} |')
    lines += ['', ('Per link (2 ranks, 1 a host: a = 2 a_net, b = b_net). Inside a host: what the '
              '4-rank line leaves once the traffic across hosts is taken off, read hierarchically '
              '(see the topology table):'), '',
              '| link | a_net (us) | b_net (GB/s) | a_shm (us) | b_shm (GB/s) |', '|---|---:|---:|---:|---:|']
    for rate, net in sorted(cal.net.items(), key=lambda kv: _rate_bits(kv[0])):
        shm = cal.shm.get(rate)
        lines.append(f'| {rate} | {net.alpha * 1e6:.0f} | {_gbps(net.beta)} | '
                     f'{"-" if shm is None else f"{shm.alpha * 1e6:.0f}"} | '
                     f'{"-" if shm is None else _gbps(shm.beta)} |')
    lines += ['', (f'Software: exchange alone on 1 rank (no network), scaled by ranks / cores '
              f'({cal.cores} cores) where ranks outnumber them:'), '',
              '| model | config | ms on 1 rank |', '|---|---|---:|']
    for (model, config), seconds in cal.software.items():
        lines.append(f'| {model} | {config} | {seconds * 1e3:.1f} |')
    return '\n'.join(lines)


def topology_table(rows):
    lines = [('| test bed | size | 2 ranks, 1 a host (ms) | N ranks (ms) | ratio | flat: link alone (ms) '
             '| hierarchical: link alone (ms) | inside a host, if hierarchical (GB/s) |'),
             '|---|---:|---:|---:|---:|---:|---:|---:|']
    for r in rows:
        two = '-' if r['two_rank_ms'] is None else f'{r["two_rank_ms"]:.1f}'
        ratio = '-' if r['ratio'] is None else f'{r["ratio"]:.2f}'
        intra = '-' if r['intra_GBps'] is None else f'{r["intra_GBps"]:.2f}'
        lines.append(f'| {r["ranks"]} ranks, {r["ppn"]} a host, {r["rate"]} | '
                     f'{harness.format_size(r["bytes"])} | {two} | '
                     f'{r["measured_ms"]:.1f} | {ratio} | {r["flat_ms"]:.1f} | {r["hierarchical_ms"]:.1f} | '
                     f'{intra} |')
    return '\n'.join(lines)


def _bed_order(item):
    (rate, ranks, _), _ = item
    return ranks, _rate_bits(rate)


def _gbps(beta):
    return 'inf' if beta <= 0 else f'{1 / beta / 1e9:.3f}'


def _rate_bits(rate):
    return testbed.parse_rate(rate) if rate else 0


def validation_table(points):
    lines = [('| test bed | config | arrays -> collectives | compute ms | exchange alone: measured '
             '| model | error '
             '| step: measured | model | error | hidden (measured) |'),
             '|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|']
    for p in points:
        if 'skipped' in p:
            lines.append(f'| {p["job"]} | {p["config"]} | skipped: {p["skipped"]} |' + ' |' * 8)
            continue
        def flag(e):
            return f'**{_pct(e)}**' if abs(e) > TARGET_ERROR else _pct(e)
        lines.append(f'| {p["layout"]}{", " + p["rate"] if p["rate"] else ""} | {p["config"]} | '
                     f'{p["collectives"]} | {p["compute_ms"]:.0f} | {p["alone_ms"]:.0f} | '
                     f'{p["alone_model_ms"]:.0f} | {flag(p["alone_error"])} | {p["step_ms"]:.0f} | '
                     f'{p["step_model_ms"]:.0f} | {flag(p["step_error"])} | '
                     f'{"-" if p["hidden_measured"] is None else format(p["hidden_measured"], "+.2f")} |')
    return '\n'.join(lines)


def validation_summary(points):
    ok = [p for p in points if 'skipped' not in p]
    if not ok:
        return 'no validation points'
    out = []
    for what in ('step', 'alone'):
        errors = np.array([abs(p[f'{what}_error']) for p in ok])
        within = int(np.sum(errors <= TARGET_ERROR))
        out.append(f'{"step time" if what == "step" else "exchange alone"}: {within} of {len(ok)} '
                   f'points within {TARGET_ERROR:.0%}; median |error| {100 * np.median(errors):.1f}%, '
                   f'max {100 * errors.max():.1f}%')
    return '; '.join(out)


def assumptions_text(args, sizes):
    steps = math.ceil(args.images / (args.batch_per_gpu * args.gpus))
    return [
        (f'- model: resnet50_v1 (model zoo, 1000 classes), {len(sizes)} gradient arrays, '
        f'{sum(sizes) / 1e6:.1f} MB float32'),
        (f'- data: {args.images:,} images per epoch, batch {args.batch_per_gpu} per GPU: '
        f'{steps} steps per epoch at {args.gpus} GPUs'),
        (f'- GPU: {args.gpu_images_per_s:g} images/s per GPU for forward+backward+update '
        f'(compute {1e3 * args.batch_per_gpu / args.gpu_images_per_s:.0f} ms a step; '
        f'forward {args.fwd_share:.2f} of it)'),
        (f'- cluster: {args.gpus} GPUs, {args.gpus_per_node} a node '
        f'({args.gpus // args.gpus_per_node} nodes), one NIC a node'),
        (f'- network: {args.net_gbit:g} Gbit/s a node a way at {args.net_efficiency:.0%} efficiency '
        f'({args.net_gbit * GBIT * args.net_efficiency / 1e9:.2f} GB/s), {args.net_latency_us:g} us '
        'a message step'),
        f'- inside a node: {args.intra_gbytes:g} GB/s, {args.intra_latency_us:g} us a step; GPU '
        + (f'buffers staged through host memory at {args.stage_gbytes:g} GB/s each way'
           if args.stage_gbytes > 0 else 'buffers read by a CUDA-aware MPI in place'),
        (f'- store: {args.sigma_us:g} us per collective plus one 8-byte agreement allreduce, '
        f'{args.kappa_us:g} us per array; fusion threshold {FUSION_THRESHOLD >> 20} MB when on; '
        'overlap on = wait-free backpropagation (h = 1)'),
        ('- flat: an MPI Allreduce that is not node-aware (recursive halving and doubling over all '
        'ranks); MPICH 5.0.2 on the test bed reduces inside hosts first (topology table), so with '
        'it read the hierarchical rows'),
    ]


def prediction_table(rows):
    lines = [('| variant | collectives | exchange alone ms | step ms | exposed ms | images/s | '
             'epoch s | efficiency |'), '|---|---:|---:|---:|---:|---:|---:|---:|']
    for name, r in rows:
        lines.append(f'| {name} | {r["collectives"]} | {r["exchange_alone_ms"]:.1f} | '
                     f'{r["step_ms"]:.1f} | {r["exposed_ms"]:.1f} | {r["images_per_s"]:.0f} | '
                     f'{r["epoch_s"]:.1f} | {r["efficiency"]:.2f} |')
    return '\n'.join(lines)


def sensitivity_table(by, key, label, fmt):
    """Epoch seconds (efficiency) of every variant against one swept assumption."""
    names = list(by)
    values = [r[key] for r in by[names[0]]]
    lines = ['| variant | ' + ' | '.join(f'{fmt(v)} {label}' for v in values) + ' |',
             '|---|' + '---:|' * len(values)]
    for name in names:
        lines.append(f'| {name} | ' + ' | '.join(f'{r["epoch_s"]:.0f} s ({r["efficiency"]:.2f})'
                                                 for r in by[name]) + ' |')
    return '\n'.join(lines)


def plot(points, scale, path):
    plt = harness.pyplot()
    if plt is None:
        return harness.NO_MATPLOTLIB
    fig, axes = plt.subplots(2, 2, figsize=(14, 10.5))
    axes = axes.ravel()
    ok = [p for p in points if 'skipped' not in p]
    ax = axes[0]
    if ok:
        for what, marker in (('alone', 's'), ('step', 'o')):
            xs = [p[f'{what}_ms'] for p in ok]
            ys = [p[f'{what}_model_ms'] for p in ok]
            ax.scatter(xs, ys, marker=marker, label='exchange alone' if what == 'alone' else 'step')
        top = max(max(p['step_ms'], p['step_model_ms']) for p in ok) * 1.1
        low = max(1.0, min(min(p['alone_ms'], p['alone_model_ms']) for p in ok) * 0.8)
        grid = np.geomspace(low, top, 50)
        ax.plot(grid, grid, color='black', linewidth=0.8, label='model = measured')
        ax.fill_between(grid, grid * (1 - TARGET_ERROR), grid * (1 + TARGET_ERROR), color='grey',
                        alpha=0.2, label=f'within {TARGET_ERROR:.0%}')
        ax.set(xscale='log', yscale='log')
    ax.set(xlabel='measured (ms)', ylabel='model (ms)', title='validation on the test bed')
    ax.grid(True, which='both', alpha=0.3)
    if ok:
        ax.legend(fontsize=8)
    ax = axes[1]
    for name, series in scale['by_gpus'].items():
        ax.plot([r['gpus'] for r in series], [r['efficiency'] for r in series], marker='.', label=name)
    ax.axvline(scale['gpus'], color='grey', linewidth=0.8, linestyle=':')
    ax.set(xscale='log', xlabel='GPUs', ylabel='compute-only step / step', ylim=(0, 1.05),
           title='ResNet-50 / ImageNet: scaling efficiency, assumed cluster')
    ax.grid(True, which='both', alpha=0.3)
    ax.legend(fontsize=7)
    ax = axes[2]
    for name, series in scale['by_net'].items():
        ax.plot([r['net_gbit'] for r in series], [r['epoch_s'] for r in series], marker='.', label=name)
    ax.axhline(scale['by_net'][HEADLINE][0]['epoch_compute_only_s'], color='black', linestyle='--',
               label='compute only')
    ax.axhline(50, color='red', linewidth=0.8, linestyle=':', label='paper: about 50 s at 256 GPUs')
    ax.axvline(scale['net_gbit'], color='grey', linewidth=0.8, linestyle=':')
    ax.set(xscale='log', yscale='log', xlabel='network Gbit/s a node', ylabel='seconds per epoch',
           title=f'{scale["gpus"]} GPUs: epoch against network bandwidth')
    ax.grid(True, which='both', alpha=0.3)
    ax.legend(fontsize=7)
    ax = axes[3]
    for name, series in scale['by_gpu_speed'].items():
        ax.plot([r['gpu_images_per_s'] for r in series], [r['efficiency'] for r in series],
                marker='.', label=name)
    ax.set(xscale='log', xlabel='images/s of one GPU', ylabel='compute-only step / step',
           title=f'{scale["gpus"]} GPUs: scaling efficiency against GPU speed', ylim=(0, 1.05))
    ax.grid(True, which='both', alpha=0.3)
    ax.legend(fontsize=7)
    return harness.save_figure(plt, fig, path, dpi=110)


# ---------------------------------------------------------------- main

def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument('--measured', default=DEFAULT_MEASURED,
                        help='testbed_scaling.py json with the training measurements to validate against')
    parser.add_argument('--calibration', default=None,
                        help='comma-separated testbed_scaling.py jsons holding raw allreduce '
                             'timings for every test bed checked (interleaved in training jobs, or '
                             'allreduce.py sweeps) and a 1-rank training job (default: --measured '
                             'when it has raw timings, else the files --calibrate writes under '
                             f'{CALIBRATION_DIR})')
    parser.add_argument('--calibrate', action='store_true',
                        help='first measure on the test bed: allreduce.py sweeps on 2 hosts at '
                             'every rate (testbed_scaling.py --allreduce-only) and a 1-rank '
                             f'training job, into {CALIBRATION_DIR}')
    parser.add_argument('--rates', default='1gbit,3gbit,10gbit', help='--calibrate: link rates')
    parser.add_argument('--ranks', default='1,2,4', help='--calibrate: rank counts (as testbed_scaling.py)')
    parser.add_argument('--designs', default=None, help='--calibrate: designs (default all)')
    parser.add_argument('--checkout', default=REPO_ROOT, help='--calibrate: tree whose allreduce.py runs')
    parser.add_argument('--predict-only', action='store_true', help='no calibration or validation')
    parser.add_argument('--out', default=DEFAULT_DIR, help='folder for cost_model.{md,json,png}')
    scale = parser.add_argument_group('the prediction at scale (assumptions)')
    scale.add_argument('--gpus', type=int, default=256)
    scale.add_argument('--gpus-per-node', type=int, default=4)
    scale.add_argument('--gpu-images-per-s', type=float, default=125.0,
                       help='ResNet-50 training images/s of one GPU alone (P100 class, fp32)')
    scale.add_argument('--batch-per-gpu', type=int, default=32)
    scale.add_argument('--fwd-share', type=float, default=1 / 3, help='forward share of compute')
    scale.add_argument('--images', type=int, default=IMAGENET_TRAIN, help='images per epoch')
    scale.add_argument('--net-gbit', type=float, default=100.0, help='link a node (EDR InfiniBand)')
    scale.add_argument('--net-efficiency', type=float, default=0.9, help='share of the link MPI reaches')
    scale.add_argument('--net-latency-us', type=float, default=2.0, help='one message step between nodes')
    scale.add_argument('--intra-gbytes', type=float, default=10.0, help='shared memory inside a node')
    scale.add_argument('--intra-latency-us', type=float, default=1.0)
    scale.add_argument('--stage-gbytes', type=float, default=12.0,
                       help='GPU-host copies (PCIe 3 x16) each way; 0: CUDA-aware MPI')
    scale.add_argument('--sigma-us', type=float, default=30.0,
                       help="the store's own cost per collective on a real node")
    scale.add_argument('--kappa-us', type=float, default=20.0,
                       help="the store's cost per array (the Python pushpull call)")
    learned = parser.add_argument_group('overlap learned on GPU-like runs (benchmarks/overlap.py)')
    learned.add_argument('--overlap', default='',
                         help='comma-separated overlap.py JSON files: fit h per schedule, check '
                              'it, and predict with it (alone: only this)')
    learned.add_argument('--fit-on', default='',
                         help='comma-separated parts of file names to fit on (default: the first '
                              'file); the others check the fit')
    return parser.parse_args(argv)


def calibration_files():
    return [os.path.join(CALIBRATION_DIR, part, 'testbed_scaling.json') for part in ('network', 'software')]


def run_calibration(args):
    """The network: allreduce sweeps on 2 hosts at every rate (testbed_scaling.py
    --allreduce-only); the software: one 1-rank training job (and its sweep)."""
    from benchmarks import testbed_scaling  # only here: it builds test beds
    network, software = calibration_files()
    common = ['--checkout', args.checkout] + (['--designs', args.designs] if args.designs else [])
    multi = ','.join(r for r in harness.names(args.ranks) if int(r) > 1)
    status = testbed_scaling.main(['--allreduce-only', '--rates', args.rates, '--ranks', multi,
                                   '--out', os.path.dirname(network)] + common)
    status |= testbed_scaling.main(['--allreduce', '--ranks', '1', '--out',
                                    os.path.dirname(software)] + common)
    if status:
        print('warning: some calibration jobs failed; fitting what ran')
    return ','.join(calibration_files())


def _load(path):
    with open(path) as handle:
        return json.load(handle)


def learned_overlap(args):
    """--overlap: h per schedule fitted on GPU-like runs, checked, and the prediction at
    args.gpus with it; -> markdown."""
    paths = [p for p in args.overlap.split(',') if p]
    points = overlap_points(paths)
    fit_on = [n for n in args.fit_on.split(',') if n] or [os.path.relpath(paths[0], REPO_ROOT)]
    fitted = fit_overlap(points, fit_on)
    sizes = resnet50_sizes()
    predictions = {c: predict_with_overlap(args, sizes, args.gpus, h) for c, h in fitted.items()}
    checks = [p for p in points if not p['fitted'] and 'step_error' in p]
    worst = max((abs(p['step_error']) for p in checks), default=None)
    text = '\n'.join([
        f'## Overlap learned on GPU-like runs: ResNet-50 on ImageNet-1k, {args.gpus} GPUs', '',
        'h = (compute + exchange - step) / min(compute, exchange), fitted per schedule on '
        + ', '.join(fit_on) + '; step = compute + exchange - h min(compute, exchange). '
        'At scale compute and exchange come from the alpha-beta model (flat, fusion on, '
        'the assumptions above).', '', overlap_tables(points, fitted, predictions), '',
        ('No run outside the fit to check it on.' if worst is None else
         f'Largest error on runs not fitted on: {100 * worst:.1f}% (target '
         f'{100 * TARGET_ERROR:.0f}%).')])
    with open(os.path.join(args.out, 'overlap_model.json'), 'w') as fh:
        json.dump({'points': points, 'fitted': fitted, 'predictions': predictions,
                   'fit_on': fit_on, 'assumptions': vars(args)}, fh, indent=1, default=str)
    return text


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.overlap:
        text = learned_overlap(args)
        with open(os.path.join(args.out, 'overlap_model.md'), 'w') as fh:
            fh.write(text + '\n')
        print(text)
        return 0
    report = {'time': time.strftime('%Y-%m-%dT%H:%M:%S%z'), 'assumptions': vars(args)}
    md = ['# Cost model (benchmarks/cost_model.py)', '']
    points = []
    if not args.predict_only:
        if args.calibrate:
            args.calibration = run_calibration(args)
        measured = _load(args.measured) if os.path.exists(args.measured) else {'jobs': []}
        if args.calibration is None:
            has_raw = any(raw_points(job)[0] for job in measured.get('jobs', []))
            args.calibration = args.measured if has_raw else ','.join(calibration_files())
        cal = calibrate([_load(path) for path in args.calibration.split(',')])
        points = training_points(measured, cal)
        report.update(calibration_file=args.calibration, measured_file=args.measured,
                      calibration=cal.as_dict(), validation=points, topology=topology_check(cal))
        md += ['## Calibration (' + ', '.join(os.path.relpath(p, REPO_ROOT)
                                               for p in args.calibration.split(',')) + ')', '',
               calibration_table(cal), '',
               '## Topology: flat against hierarchical', '',
               ('Flat, N ranks N/2 a host carry N/2 times the bytes of 2 ranks over each link: '
               'their allreduce cannot take less than the "flat: link alone" column (the 2-rank '
               'fit times N/2, shared memory free). Hierarchical, the link carries what 2 ranks '
               'carry, and the rest of the time is a reduce-scatter and an allgather inside each '
               'host, whose rate the last column infers. Measured times below the '
               'flat bound, and one inferred rate at every link rate, mean that MPICH reduces '
               'inside the hosts first (it has node-aware allreduce algorithms); the validation '
               'uses each test bed\'s own measured line, so it does not depend on this reading.'), '',
               topology_table(topology_check(cal)), '',
               (f'## Validation against {os.path.relpath(args.measured, REPO_ROOT)} '
               '(overlap h = 0 on the test bed)'), '',
               validation_table(points), '', validation_summary(points), '']
    sizes = resnet50_sizes()
    rows = [(name, predict(args, sizes, args.gpus, h, thr, hier)) for name, h, thr, hier in VARIANTS]
    gpus_axis = [g for g in (4, 8, 16, 32, 64, 128, 256, 512, 1024)]
    scale = {'gpus': args.gpus, 'net_gbit': args.net_gbit,
             'by_gpus': {name: [predict(args, sizes, g, h, thr, hier) for g in gpus_axis]
                         for name, h, thr, hier in VARIANTS},
             'by_net': {name: [dict(predict(args, sizes, args.gpus, h, thr, hier, net_gbit=bw), net_gbit=bw)
                               for bw in (1, 3, 10, 25, 56, 100, 200)]
                        for name, h, thr, hier in VARIANTS},
             'by_gpu_speed': {name: [dict(predict(args, sizes, args.gpus, h, thr, hier, gpu_rate=g),
                                          gpu_images_per_s=g)
                                     for g in (60, 125, 250, 500, 1000, 2000)]
                              for name, h, thr, hier in VARIANTS}}
    headline = dict(rows)[HEADLINE]
    readings = what_reads_50s(args, sizes)
    implied = args.images / 50.0 / args.gpus
    md += [f'## Prediction: ResNet-50 on ImageNet-1k, {args.gpus} GPUs', '',
           ('Assumptions (the paper text available here, the arXiv abstract, states the result but '
           'not the GPUs or the network; these are ours):'), ''] + assumptions_text(args, sizes) + [
           '', prediction_table(rows), '',
           (f'Headline ({HEADLINE}): **{headline["epoch_s"]:.0f} s per epoch** '
           f'({headline["images_per_s"]:.0f} images/s, {headline["efficiency"]:.2f} of compute-only '
           f'{headline["epoch_compute_only_s"]:.0f} s). The paper reports about 50 s; 50 s means '
           f'{implied:.0f} images/s per GPU delivered.'), ''] + readings + [
           '', (f'Where overlap, fusion and hierarchy matter: epoch seconds (and compute-only step / '
           f'step) at {args.gpus} GPUs, against the GPU\'s speed (faster GPUs leave less backward '
           'to hide the exchange behind) and the network:'), '',
           sensitivity_table(scale['by_gpu_speed'], 'gpu_images_per_s', 'img/s', lambda v: f'{v:g}'), '',
           sensitivity_table(scale['by_net'], 'net_gbit', 'Gbit/s', lambda v: f'{v:g}'), '']
    report['prediction'] = {'rows': dict(rows), 'by_gpus': scale['by_gpus'], 'by_net': scale['by_net'],
                            'by_gpu_speed': scale['by_gpu_speed'], 'readings_of_50s': readings,
                            'gradient_sizes': sizes}
    md_text = '\n'.join(md) + '\n'
    with open(os.path.join(args.out, 'cost_model.md'), 'w') as handle:
        handle.write(md_text)
    with open(os.path.join(args.out, 'cost_model.json'), 'w') as handle:
        json.dump(report, handle, indent=1, default=str)
    print(md_text)
    print(plot(points, scale, os.path.join(args.out, 'cost_model.png')))
    print(f'written: {args.out}/cost_model.md, cost_model.json')
    return 0


if __name__ == '__main__':
    sys.exit(main())
