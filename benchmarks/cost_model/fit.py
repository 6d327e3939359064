"""The cost model fitted and checked: allreduce lines and the store's software cost from
grid --scaling results, the check against its training steps, what the paper's 50 s
per epoch means, and the overlap learned on overlap.py results."""
import json
import os

import numpy as np
from scipy.optimize import brentq

import testbed
from benchmarks import harness
from benchmarks.cost_model.model import (
    AGREEMENT_BYTES,
    FUSING_DESIGNS,
    FUSION_THRESHOLD,
    HEADLINE,
    VARIANTS,
    Link,
    Store,
    Topology,
    _log2,
    allreduce_flat,
    allreduce_hier,
    exchange_time,
    overlap_step,
    predict,
    step_time,
)

REPO_ROOT = harness.REPO_ROOT
TARGET_ERROR = 0.15


def _load(path):
    with open(path) as handle:
        return json.load(handle)


# ---------------------------------------------------------------- calibration

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


def raw_points(job):
    """{bytes: seconds} of raw MPI Allreduce(IN_PLACE) on a job's test bed, and where from:
    timed inside the training job's exchange-alone rounds (same load as what is checked)."""
    payload = job.get('scaling') or {}
    for entry in payload.get('models', {}).values():
        if entry.get('raw_allreduce'):
            return {r['bytes']: r['median_ms'] * 1e-3 for r in entry['raw_allreduce']}, 'interleaved'
    return None, None


def grid_jobs(combined):
    """The cells of a grid --scaling record, each with its scaling run record as 'scaling'."""
    return [dict(cell, scaling=cell.get('results', {}).get('scaling')) for cell in combined.get('cells', [])]


def calibrate(files):
    """Fit from grid --scaling records (docs/cost-model.md#calibration)."""
    cal = Calibration()
    jobs = [job for combined in files for job in grid_jobs(combined)]
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
                         'grid --scaling (it times them beside the exchange)')
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
        raise SystemExit('no 1-rank training job in the calibration files: run grid --scaling '
                         'with --ranks including 1')
    return cal


def _base(design):
    return design.split('+', 1)[0]


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
    """Every store config of every multi-rank job of grid --scaling, with the model's
    prediction (1-rank jobs calibrate the software cost, so they are no check)."""
    points = []
    for job in grid_jobs(measured):
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


def _bed_order(item):
    (rate, ranks, _), _ = item
    return ranks, _rate_bits(rate)


def _rate_bits(rate):
    return testbed.parse_rate(rate) if rate else 0


def _solve(f, low, high, target):
    """x in [low, high] with f(x) = target for a monotonic f, or None when out of range."""
    if (f(low) - target) * (f(high) - target) > 0:
        return None
    return brentq(lambda x: f(x) - target, low, high)


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


def _runs(path):
    """(name, compute s, {column: (step s, exchange alone s)}) of each run in a
    benchmarks.overlap result file, or in the committed table of them (ms, a run a row)."""
    payload, rel = _load(path), os.path.relpath(path, REPO_ROOT)
    if 'rows' in payload:
        for row in payload['rows']:
            cells, alone = row['cells'], row.get('exchange', {})
            yield (f'{rel}: {row["label"]}, {row["hosts"]} hosts, {row["rate"]}',
                   cells['compute alone']['median'] / 1e3,
                   {c: (cells[c]['median'] / 1e3, alone[c]['median'] / 1e3) for c in alone if cells.get(c)})
        return
    yield (f'{rel}: {payload["model"]} {payload["images_per_s"]:g}/s, '
           f'{payload.get("config", {}).get("topology", "")}', payload['compute_alone']['median'],
           {row['column']: (row['step']['median'], row['exchange']['median'])
            for row in payload['columns'] if 'step' in row})


def overlap_points(paths):
    """[{file, column, compute, exchange, step, h}] of every mpi_kvstore column of
    benchmarks/overlap.py results (seconds, medians); file names the run."""
    points = []
    for path in paths:
        for name, compute, columns in _runs(path):
            for column, (step, exchange) in columns.items():
                if column in OVERLAP_SCHEDULES:
                    points.append({'file': name, 'column': column, 'compute': compute,
                                   'exchange': exchange, 'step': step,
                                   'h': harness.hidden_share(compute, exchange, step)})
    return points


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


