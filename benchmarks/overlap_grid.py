"""Every trainer side by side over the test bed: benchmarks.overlap per (hosts, rate, model, wire).

    python -m benchmarks.overlap_grid --best-options BEST.json --horovod-python /work/hvd-venv/bin/python
    python -m benchmarks.overlap_grid --report-only [--out DIR]

Runs as root, not under mpiexec, as testbed_scaling does, whose test-bed loop it reuses: per
cell, a test bed of that many hosts, 1 rank each, links shaped at the rate, and on it
overlap.py jobs, each under a timeout:
- ours: --columns (default fifo,autotuned,best,gluon,dist_sync; compute alone comes with it);
- horovod, with --horovod-python (a Python that imports horovod.mxnet; the mpiexec beside
  it launches): --columns horovod, a job of its own, since Horovod's background thread
  polls and would load the CPU of every other column;
- p3: --p3 --columns dist_sync, a job of its own: ps-lite starts once a process.
The order alternates from cell to cell (ours first, then last), so that no job always runs
on a machine another job just left. fp16 cells pass --compression fp16: every mpi_kvstore
column and Horovod send fp16, dist_sync and P3 float32.

Before any test bed is built, a grid whose largest job would not fit in free memory is
refused (MEMORY_BASE, MEMORY_PER_COLUMN; --ignore-memory starts it anyway). Each job gets
overlap's --timeout 30 s inside --job-timeout, unless --overlap-args gives one.

best: --best-options 'name=value,...' for every cell, or the path of a JSON written from an
offline grid, {cell name or 'default': 'name=value,...'}, cell names as runs/ has them
(resnet50_v1_h2_3gbit_fp16).

Writes into --out: runs/<cell>/<job>/ (overlap's JSON, table and plot; the cell's log.txt),
overlap_grid.json (every cell, every job, how it ended), overlap_grid.md (a row per cell:
each column's step ms, median (min-max) over the rounds, and FIFO's step over it; autotuned
vs best: best's step over autotuned's) and overlap_grid.png; --report-only rebuilds the last
two.
"""
import glob
import json
import os
import shlex
import sys
import time

import psutil

import testbed
from benchmarks import gpu_like, harness, report, testbed_scaling

DEFAULT_OUT = os.path.join(harness.DEFAULT_OUT, 'overlap_grid')
JSON_NAME = 'overlap_grid.json'
OVERLAP_ARGS = '--images-per-s 125 --batch 32 --warmups 1 --rounds 5 --chain 3 --optimizer gpulikesgd'
# The table's columns, left to right; 'p3' is the p3 job's dist_sync.
ORDER = ('fifo', 'priority', 'autotuned', 'best', 'gluon', 'horovod', 'dist_sync', 'p3')
# A rank's peak resident memory in gradient sizes: compute alone's model (weights and
# gradients), and each column's model with its store's buffers. Measured on VGG-16 (553 MB
# of gradients): 2 columns peaked at 4.6 GB a rank; 4 columns on 4 test hosts ran the
# 24 GB machine out of memory, and the kernel killed a rank.
MEMORY_BASE, MEMORY_PER_COLUMN = 2, 3


def parse_args(argv=None):
    parser = harness.parser(__doc__)
    add = parser.add_argument
    add('--hosts', default='2,4', help='test hosts per cell, 1 rank on each')
    add('--rates', default='1gbit,3gbit,10gbit', help='link rates')
    add('--models', default='resnet50_v1,vgg16', help="gpu_like's models")
    add('--wires', default='none,fp16', help="overlap's --compression, a cell each")
    add('--columns', default='fifo,autotuned,best,gluon,dist_sync', help="overlap's, in our job")
    add('--best-options', help="the best column's store options, or a JSON of them per cell")
    add('--horovod-python', help='a Python that imports horovod.mxnet: a Horovod job per cell')
    add('--no-p3', action='store_true', help='no P3 job')
    add('--overlap-args', default=OVERLAP_ARGS, help="more of overlap's options, for every job")
    add('--job-timeout', type=float, default=3600.0, help='seconds one overlap job may take')
    add('--out', default=DEFAULT_OUT, help='results folder')
    add('--ignore-memory', action='store_true',
        help="start cells whose jobs look too large for this machine's free memory")
    add('--report-only', action='store_true', help='rebuild the table and plot from --out')
    args = parser.parse_args(argv)
    args.out = os.path.abspath(args.out)
    if args.report_only:
        return args
    try:
        args.hosts = [int(h) for h in harness.names(args.hosts)]
    except ValueError:
        parser.error(f'--hosts {args.hosts}: whole numbers of test hosts')
    if any(h < 2 for h in args.hosts):
        parser.error(f'--hosts {args.hosts}: at least 2 test hosts a cell')
    args.rates, args.models, args.wires = (harness.names(v) for v in (args.rates, args.models, args.wires))
    for rate in args.rates:
        testbed.parse_rate(rate)            # raises on a bad rate before anything starts
    for name, given, known in (('--models', args.models, gpu_like.MODELS),
                               ('--wires', args.wires, ('none', 'fp16'))):
        if not given or set(given) - set(known):
            parser.error(f'{name} {",".join(given)}: use some of {",".join(known)}')
    python = args.horovod_python
    if python and not (os.access(python, os.X_OK) and os.access(mpiexec_beside(python), os.X_OK)):
        parser.error(f'--horovod-python {python}: not an executable with mpiexec beside it')
    args.best = best_per_cell(parser, args.best_options, [c.name for c in grid(args)])
    if not args.ignore_memory:
        check_memory(parser, args, grid(args), psutil.virtual_memory().available)
    return args


def check_memory(parser, args, cells, available):
    """Refuse a grid whose largest job would not fit in `available` bytes: the kernel then
    kills a rank minutes in, and the cell is lost."""
    ours = len(harness.names(args.columns))
    for cell in cells:
        # one gradient size on every test host of the cell: the estimate's unit
        unit = cell.hosts * gpu_like.plan(cell.model).grad_bytes
        need = unit * (MEMORY_BASE + MEMORY_PER_COLUMN * ours)
        if need > available:
            fits = max(0, (available / unit - MEMORY_BASE) // MEMORY_PER_COLUMN)
            parser.error(f'cell {cell.name}: {ours} columns in one job need about '
                         f'{need / 2**30:.1f} GiB on {cell.hosts} test hosts, and '
                         f'{available / 2**30:.1f} GiB is free; run at most {fits:.0f} '
                         f'columns a job (--columns), or --ignore-memory')


def mpiexec_beside(python):
    return os.path.join(os.path.dirname(python), 'mpiexec')


def best_per_cell(parser, given, cells):
    """{cell: 'name=value,...'} from --best-options (checked as overlap checks it), {} without."""
    if not given:
        return {}
    table = {'default': given}
    if given.endswith('.json'):
        try:
            with open(given) as handle:
                table = json.load(handle)
        except (OSError, ValueError) as exc:
            parser.error(f'--best-options {given}: {exc}')
    best = {cell: table.get(cell, table.get('default')) for cell in cells}
    missing = [cell for cell, options in best.items() if not options]
    if missing:
        parser.error(f'--best-options {given}: no entry for {", ".join(missing)} and no default')
    for cell, options in best.items():
        try:
            gpu_like.fixed_options(options)
        except Exception as exc:
            parser.error(f'--best-options {given}, cell {cell}: {exc}')
    return best


class Cell:
    """One point of the grid: a test bed of `hosts` hosts, 1 rank each (what
    testbed_scaling.on_testbed asks of a job)."""

    def __init__(self, hosts, rate, model, wire):
        self.hosts, self.ranks, self.ppn, self.rate = hosts, hosts, 1, rate
        self.model, self.wire = model, wire
        self.name = f'{model}_h{hosts}_{rate}' + ('' if wire == 'none' else f'_{wire}')
        self.layout = f'{hosts} hosts x 1 rank'

    def describe(self):
        return f'{self.model}, {self.layout} at {self.rate}, wire {self.wire}'


def grid(args):
    return [Cell(hosts, rate, model, wire) for model in args.models for wire in args.wires
            for hosts in args.hosts for rate in args.rates]


def launches(args, cell, index, out_dir):
    """(job, argv, timeout, mpiexec) of the cell's jobs, in this cell's order."""
    overlap_args = shlex.split(args.overlap_args)
    if not any(a == '--timeout' or a.startswith('--timeout=') for a in overlap_args):
        # overlap's own deadline (600 s by default) would end a job that --job-timeout
        # allows: VGG-16's autotune warm-up alone outlasts it at 4 test hosts
        overlap_args += ['--timeout', f'{max(args.job_timeout - 30, args.job_timeout / 2):g}']

    def job(name, columns, python=sys.executable, extra=()):
        argv = [python, '-m', 'benchmarks.overlap', '--model', cell.model, '--columns', columns,
                '--compression', cell.wire, '--topology', f'{cell.layout}, {cell.rate}',
                '--out', os.path.join(out_dir, name), *overlap_args, *extra]
        if 'best' in columns:
            argv += ['--best-options', args.best[cell.name]]
        return (name, argv, args.job_timeout, mpiexec_beside(python) if name == 'horovod' else None)
    jobs = [job('ours', args.columns)]
    if args.horovod_python:
        jobs.append(job('horovod', 'horovod', args.horovod_python))
    if not args.no_p3:
        jobs.append(job('p3', 'dist_sync', extra=['--p3']))
    return jobs if index % 2 == 0 else jobs[::-1]


def run_cell(args, cell, index):
    out_dir = os.path.join(args.out, 'runs', cell.name)
    record = testbed_scaling.on_testbed(cell, out_dir, launches(args, cell, index, out_dir))
    record.update(model=cell.model, wire=cell.wire, results={})
    for name in record['steps']:
        found = sorted(glob.glob(os.path.join(out_dir, name, 'overlap_n*.json')))
        if found:
            with open(found[0]) as handle:
                record['results'][name] = json.load(handle)
    return record


# ---------------------------------------------------------------- the report

def columns_of(record):
    """{column: overlap's row} of a cell's jobs, P3's as 'p3'; compute alone as 'compute'."""
    rows = {}
    for job, result in record['results'].items():
        for row in result['columns']:
            rows['p3' if job == 'p3' else row['column']] = row
        for name, why in result.get('skipped', {}).items():
            rows.setdefault('p3' if job == 'p3' else name, {'skipped': why})
        if job == 'ours' or 'compute' not in rows:
            rows['compute'] = {'step': {k: result['compute_alone'][k] for k in ('median', 'min', 'max')}}
    return rows


def _ms(row, fifo):
    if 'step' not in row:
        return 'skipped' if 'skipped' in row else 'failed'
    step = row['step']
    text = f'{step["median"] * 1e3:.0f} ({step["min"] * 1e3:.0f}-{step["max"] * 1e3:.0f})'
    return text if fifo is None else f'{text} {fifo / step["median"]:.2f}x'


def markdown(combined):
    cells, shown = [], []
    for record in combined['cells']:
        rows = columns_of(record)
        shown += [c for c in ORDER if c in rows and c not in shown]
        fifo = rows.get('fifo', {}).get('step', {}).get('median')
        tuned, best = (rows.get(c, {}).get('step', {}).get('median') for c in ('autotuned', 'best'))
        cells.append((record, rows, fifo, report.cell(best / tuned if tuned and best else None, '.2f', 'x')))
    shown = [c for c in ORDER if c in shown]
    table = [[f'{r["model"]}, {r["layout"]}, {r["rate"]}, {r["wire"]}', _ms(rows['compute'], None)
              if 'compute' in rows else '-', *[_ms(rows[c], fifo) if c in rows else '-' for c in shown],
              versus] for r, rows, fifo, versus in cells]
    failed = [f'- {r["job"]}: ' + (r.get('error') or ', '.join(
        f'{name} ' + ('timed out' if s['timed_out'] else f'status {s["returncode"]}')
        for name, s in r['steps'].items() if s['returncode'] or s['timed_out']))
        for r in combined['cells'] if not r['ok']]
    return '\n'.join([
        f'Step ms, median (min-max) over the rounds, then FIFO\'s step over it; autotuned vs best: '
        f"best's step over autotuned's. Horovod and P3 ran in jobs of their own. Started "
        f'{combined["time"]}, {combined["elapsed_s"]:.0f} s in all:', '',
        f'`{combined["command"]}`', '',
        report.markdown(['cell', 'compute alone', *shown, 'autotuned vs best'], table), '',
        *(['Jobs that did not finish (their partial results are in the table):', *failed] if failed else [])])


def plot(combined, path):
    """A panel per model and wire: FIFO's step over each column's, a group of bars per
    hosts and rate."""
    plt = report.pyplot()
    if plt is None:
        return report.NO_MATPLOTLIB
    panels = {}
    for record in combined['cells']:
        rows = columns_of(record)
        fifo = rows.get('fifo', {}).get('step', {}).get('median')
        groups = panels.setdefault(f'{record["model"]}, wire {record["wire"]}', {})
        groups[f'{record["hosts"]}h {record["rate"]}'] = {
            c: fifo / rows[c]['step']['median'] for c in ORDER if fifo and 'step' in rows.get(c, {})}
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 3.5 * len(panels)), squeeze=False)
    for ax, (title, groups) in zip(axes[:, 0], panels.items()):
        names = [c for c in ORDER if any(c in bars for bars in groups.values())]
        width = 0.8 / max(1, len(names))
        for i, name in enumerate(names):
            ax.bar([g + i * width for g in range(len(groups))],
                   [bars.get(name, 0) for bars in groups.values()], width, label=name)
        ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))], list(groups))
        ax.axhline(1.0, color='grey', linewidth=0.8)
        ax.set(title=title, ylabel="FIFO's step / its step")
        ax.legend(fontsize=7, ncol=4)
    return report.save_figure(plt, fig, path)


def write_report(args, combined):
    text = markdown(combined)
    with open(os.path.join(args.out, 'overlap_grid.md'), 'w') as handle:
        handle.write('# Every trainer side by side over the test bed (benchmarks/overlap_grid.py)\n\n'
                     + text + '\n')
    print('\n' + text + '\n' + plot(combined, os.path.join(args.out, 'overlap_grid.png')), flush=True)


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.report_only:
        with open(os.path.join(args.out, JSON_NAME)) as handle:
            write_report(args, json.load(handle))
        return 0
    ok, why = testbed.available(rate=True, mpi=True)
    if not ok:
        raise SystemExit(f'the test bed is not available here: {why}')
    cells = grid(args)
    print(f'overlap_grid: {len(cells)} cells ({", ".join(c.name for c in cells)})', flush=True)
    combined = {'benchmark': 'overlap_grid', 'time': time.strftime('%Y-%m-%dT%H:%M:%S%z'),
                'command': shlex.join(['python', '-m', 'benchmarks.overlap_grid', *sys.argv[1:]]),
                'config': {k: v for k, v in vars(args).items() if k != 'best'}, 'best': args.best,
                'testbed': {'transport': testbed.TCP_ENV, 'shaping': 'tbf, both directions'},
                'cells': []}
    started = time.monotonic()
    for index, cell in enumerate(cells):
        combined['cells'].append(run_cell(args, cell, index))
        combined['elapsed_s'] = time.monotonic() - started
        harness.replace_json(os.path.join(args.out, JSON_NAME), combined)   # a killed run keeps the cells done
    write_report(args, combined)
    failed = [r['job'] for r in combined['cells'] if not r['ok']]
    print(f'{len(cells)} cells in {combined["elapsed_s"]:.0f} s' + (f'; failed: {", ".join(failed)}' if failed else ''))
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
