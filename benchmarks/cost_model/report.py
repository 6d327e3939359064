"""The cost model's report: its tables (Markdown) and its plot."""
import math

import numpy as np

from benchmarks import harness
from benchmarks.cost_model.fit import TARGET_ERROR, _bed_order, _rate_bits
from benchmarks.cost_model.model import FUSION_THRESHOLD, GBIT, GPUS_AXIS
from benchmarks.report import cell, markdown, plot_bars


def overlap_tables(points, fitted, predictions):
    runs = []
    for p in points:
        err = '-' if 'step_error' not in p else _pct(p['step_error'])
        if 'step_error' in p and abs(p['step_error']) > TARGET_ERROR and not p['fitted']:
            err = f'**{err}**'
        runs.append([p['file'], p['column'],
                     f'{p["compute"] * 1e3:.0f}', f'{p["exchange"] * 1e3:.0f}', f'{p["step"] * 1e3:.0f}',
                     f'{p["h"]:.2f}', '-' if 'step_model' not in p else f'{p["step_model"] * 1e3:.0f}',
                     err, 'fitted' if p['fitted'] else 'check'])
    at_scale = [[c, f'{r["h"]:.2f}', f'{r["step_ms"]:.1f}', f'{r["exchange_alone_ms"]:.1f}',
                 f'{r["images_per_s"]:.0f}', f'{r["epoch_s"]:.1f}'] for c, r in predictions.items()]
    return '\n'.join([
        markdown(['run', 'schedule', 'compute ms', 'exchange alone ms', 'step ms', 'h measured',
                  'step, model ms', 'error', ''], runs), '',
        'h per schedule (median over the fitting runs): '
        + ', '.join(f'{c} {h:.2f}' for c, h in fitted.items()), '',
        markdown(['schedule', 'h', 'step ms', 'exchange alone ms', 'images/s', 'epoch s'], at_scale)])


def _pct(x):
    return '-' if x is None else f'{100 * x:+.1f}%'


def calibration_table(cal):
    lines = [markdown(['test bed', 'timed', 'a (us)', '1/b (GB/s)', 'sizes: measured ms (fit ms)'], [
        [f'{ranks} ranks, {ppn} a host, {rate}', line.source, f'{line.a * 1e6:.0f}', _gbps(line.b),
         ', '.join(f'{harness.format_size(n)} {t * 1e3:.2f} ({line(n) * 1e3:.2f})'
                   for n, t in sorted(line.points.items()))]
        for (rate, ranks, ppn), line in sorted(cal.lines.items(), key=_bed_order)])]
    links = []
    for rate, net in sorted(cal.net.items(), key=lambda kv: _rate_bits(kv[0])):
        shm = cal.shm.get(rate)
        links.append([rate, f'{net.alpha * 1e6:.0f}', _gbps(net.beta),
                      '-' if shm is None else f'{shm.alpha * 1e6:.0f}',
                      '-' if shm is None else _gbps(shm.beta)])
    software = [[model, config, f'{seconds * 1e3:.1f}']
                for (model, config), seconds in cal.software.items()]
    return '\n'.join([
        'Raw MPI Allreduce(IN_PLACE) on each test bed, fitted a + b n (a from sizes <= 64 KB, '
        'b the median per-byte time of sizes >= 4 MB):', '', *lines, '',
        'Per link (2 ranks, 1 a host: a = 2 a_net, b = b_net). Inside a host: what the '
        '4-rank line leaves once the traffic across hosts is taken off, read hierarchically '
        '(see the topology table):', '',
        markdown(['link', 'a_net (us)', 'b_net (GB/s)', 'a_shm (us)', 'b_shm (GB/s)'], links), '',
        f'Software: exchange alone on 1 rank (no network), scaled by ranks / cores '
        f'({cal.cores} cores) where ranks outnumber them:', '',
        markdown(['model', 'config', 'ms on 1 rank'], software)])


def topology_table(rows):
    return markdown(
        ['test bed', 'size', '2 ranks, 1 a host (ms)', 'N ranks (ms)', 'ratio', 'flat: link alone (ms)',
         'hierarchical: link alone (ms)', 'inside a host, if hierarchical (GB/s)'],
        [[f'{r["ranks"]} ranks, {r["ppn"]} a host, {r["rate"]}', harness.format_size(r['bytes']),
          cell(r['two_rank_ms'], '.1f'), f'{r["measured_ms"]:.1f}', cell(r['ratio'], '.2f'),
          f'{r["flat_ms"]:.1f}', f'{r["hierarchical_ms"]:.1f}', cell(r['intra_GBps'], '.2f')]
         for r in rows])


def _gbps(beta):
    return 'inf' if beta <= 0 else f'{1 / beta / 1e9:.3f}'


def validation_table(points):
    def flag(e):
        return f'**{_pct(e)}**' if abs(e) > TARGET_ERROR else _pct(e)
    rows = []
    for p in points:
        if 'skipped' in p:
            rows.append([p['job'], p['config'], f'skipped: {p["skipped"]}'])
            continue
        rows.append([f'{p["layout"]}{", " + p["rate"] if p["rate"] else ""}', p['config'],
                     p['collectives'], f'{p["compute_ms"]:.0f}', f'{p["alone_ms"]:.0f}',
                     f'{p["alone_model_ms"]:.0f}', flag(p['alone_error']), f'{p["step_ms"]:.0f}',
                     f'{p["step_model_ms"]:.0f}', flag(p['step_error']),
                     '-' if p['hidden_measured'] is None else format(p['hidden_measured'], '+.2f')])
    return markdown(['test bed', 'config', 'arrays -> collectives', 'compute ms',
                     'exchange alone: measured', 'model', 'error', 'step: measured', 'model',
                     'error', 'hidden (measured)'], rows)


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
    return markdown(['variant', 'collectives', 'exchange alone ms', 'step ms', 'exposed ms',
                     'images/s', 'epoch s', 'efficiency'],
                    [[name, r['collectives'], f'{r["exchange_alone_ms"]:.1f}', f'{r["step_ms"]:.1f}',
                      f'{r["exposed_ms"]:.1f}', f'{r["images_per_s"]:.0f}', f'{r["epoch_s"]:.1f}',
                      f'{r["efficiency"]:.2f}'] for name, r in rows])


def sensitivity_table(by, key, label, fmt):
    """Epoch seconds (efficiency) of every variant against one swept assumption."""
    values = [r[key] for r in next(iter(by.values()))]
    return markdown(['variant'] + [f'{fmt(v)} {label}' for v in values],
                    [[name] + [f'{r["epoch_s"]:.0f} s ({r["efficiency"]:.2f})' for r in series]
                     for name, series in by.items()])


def plot(points, scale, path):
    """report.plot_bars of the model: each validation point's step, model over measured (1 is
    exact), and each variant's efficiency and epoch at the assumed cluster."""
    at = {name: next(r for r, g in zip(series, GPUS_AXIS) if g == scale['gpus'])
          for name, series in scale['by_gpus'].items()} if scale['gpus'] in GPUS_AXIS else {}
    panels = {'validation: step, model / measured': {
        f'{p["layout"]} {p["config"]}': p['step_model_ms'] / p['step_ms']
        for p in points if 'skipped' not in p}}
    panels[f'{scale["gpus"]} GPUs: compute-only step / step'] = {n: r['efficiency'] for n, r in at.items()}
    panels[f'{scale["gpus"]} GPUs: seconds per epoch'] = {n: r['epoch_s'] for n, r in at.items()}
    return plot_bars(path, {k: v for k, v in panels.items() if v}, '', 'cost model: ResNet-50 on '
                     'ImageNet, assumed cluster',
                     {'validation: step, model / measured': ('model = measured', 1.0)}, dpi=110)
