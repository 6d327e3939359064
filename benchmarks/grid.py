"""The test-bed driver: benchmarks.overlap (default) or benchmarks.scaling over test hosts.

    python -m benchmarks.grid [--models resnet50_v1,vgg16] [--hosts 2,4] [--wires none,fp16] \\
        [--best-options BEST.json] [--horovod-python HVD_VENV/bin/python]
    python -m benchmarks.grid --scaling [--ranks 1,2,4] [--models resnet18_v1]
    python -m benchmarks.grid --report-only [--out DIR]

Runs as root, not under mpiexec. Per cell it brings a test bed up (testbed.Hosts, every link
shaped at the cell's --rates), runs the cell's jobs in turn, each under --job-timeout (and a
--timeout 30 s inside it, unless --job-args gives one), and takes it down whatever happens.

overlap, a cell per (model, wire, hosts, rate), 1 rank a host: ours (overlap --columns);
horovod (--horovod-python: a Python that imports horovod.mxnet, its mpiexec beside it) and
p3 (--p3 --columns dist_sync), each a job of its own, as Horovod's thread polls and ps-lite
starts once a process. The jobs' order alternates from cell to cell. best: --best-options
'name=value,...', or a JSON {cell name or 'default': 'name=value,...'}. A grid whose largest
job would not fit in free memory is refused up front (--ignore-memory starts it anyway).

--scaling, a cell per (ranks, rate): scaling --no-dist-sync, 1 rank on a host alone or N
ranks over 2 hosts, timing raw MPI Allreduce of --raw-sizes (the network's alpha and beta,
for cost_model --measured OUT/grid.json).

Writes into --out: runs/<cell>/ (each job's files, the cell's log.txt), grid.json (every
cell and job, how it ended), and the table of the steps (table.json, table.md) with its
plot; --report-only rebuilds the last three.
"""
import glob
import json
import os
import shlex
import sys
import time

import psutil

import testbed
from benchmarks import gpu_like, harness, report

DEFAULT_OUT = os.path.join(harness.DEFAULT_OUT, 'grid')
JSON_NAME = 'grid.json'
JOB_ARGS = {'overlap': '--images-per-s 125 --batch 32 --warmups 1 --rounds 5 --chain 3 '
                       '--optimizer gpulikesgd',
            'scaling': '--warmup-steps 2 --steps 8'}
MODELS = {'overlap': 'resnet50_v1,vgg16', 'scaling': 'resnet18_v1'}
# A table's columns, left to right; 'P3' is the p3 job's dist_sync.
ORDER = ('compute alone', 'fifo', 'priority', 'autotuned', 'best', 'gluon', 'horovod', 'dist_sync', 'P3')
SCALING_HOSTS = 2           # every multi-rank scaling cell spans two hosts
# A rank's peak resident memory in gradient sizes: compute alone's model (weights and
# gradients), and each column's model with its store's buffers. Measured on VGG-16 (553 MB
# of gradients): 2 columns peaked at 4.6 GB a rank; 4 columns on 4 test hosts ran the
# 24 GB machine out of memory, and the kernel killed a rank.
MEMORY_BASE, MEMORY_PER_COLUMN = 2, 3


def parse_args(argv=None):
    parser = harness.parser(__doc__)
    add = parser.add_argument
    add('--scaling', action='store_true', help='benchmarks.scaling in each cell, not overlap')
    add('--hosts', default='2,4', help='overlap: test hosts a cell, 1 rank on each')
    add('--ranks', default='1,2,4', help=f'scaling: 1 (a host alone) or N over {SCALING_HOSTS} hosts')
    add('--rates', default='1gbit,3gbit,10gbit', help='link rates')
    add('--models', help=f"the job's models (default: overlap {MODELS['overlap']}, scaling "
                         f"{MODELS['scaling']})")
    add('--wires', default='none,fp16', help="overlap's --compression, a cell each")
    add('--columns', default='fifo,autotuned,best,gluon,dist_sync', help="overlap's, in our job")
    add('--best-options', help="the best column's store options, or a JSON of them per cell")
    add('--horovod-python', help='a Python that imports horovod.mxnet: a Horovod job per cell')
    add('--no-p3', action='store_true', help='no P3 job')
    add('--raw-sizes', default='4K,64K,1M,4M,16M,43M', help="scaling: raw MPI Allreduce sizes")
    add('--job-args', help=f"more options for every job (default: overlap {JOB_ARGS['overlap']!r}, "
                           f"scaling {JOB_ARGS['scaling']!r})")
    add('--job-timeout', type=float, default=3600.0, help='seconds one job may take')
    add('--out', default=DEFAULT_OUT, help='results folder')
    add('--ignore-memory', action='store_true',
        help="start cells whose jobs look too large for this machine's free memory")
    add('--report-only', action='store_true', help='rebuild the table and plot from --out')
    args = parser.parse_args(argv)
    args.out = os.path.abspath(args.out)
    if args.report_only:
        return args
    mode = args.mode = 'scaling' if args.scaling else 'overlap'
    args.models = harness.names(args.models or MODELS[mode])
    args.job_args = JOB_ARGS[mode] if args.job_args is None else args.job_args
    try:
        args.hosts, args.ranks = ([int(n) for n in harness.names(v)] for v in (args.hosts, args.ranks))
    except ValueError:
        parser.error(f'--hosts {args.hosts}, --ranks {args.ranks}: whole numbers')
    if any(h < 2 for h in args.hosts):
        parser.error(f'--hosts {args.hosts}: at least 2 test hosts a cell')
    if any(r < 1 or (r > 1 and r % SCALING_HOSTS) for r in args.ranks):
        parser.error(f'--ranks {args.ranks}: 1, or a multiple of {SCALING_HOSTS}')
    args.rates, args.wires = harness.names(args.rates), harness.names(args.wires)
    for rate in args.rates:
        testbed.parse_rate(rate)            # raises on a bad rate before anything starts
    if mode == 'overlap':
        for name, given, known in (('--models', args.models, gpu_like.MODELS),
                                   ('--wires', args.wires, ('none', 'fp16'))):
            if not given or set(given) - set(known):
                parser.error(f'{name} {",".join(given)}: use some of {",".join(known)}')
    harness.check_python(parser, args.horovod_python)
    args.best = best_per_cell(parser, args.best_options, [c.name for c in grid(args)])
    if mode == 'overlap' and not args.ignore_memory:
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
    """One point of the grid: a test bed of `hosts` hosts, `ppn` ranks on each, links at
    `rate` (None: one host alone); overlap's cells have a model and a wire."""

    def __init__(self, hosts, ppn, rate, model=None, wire='none'):
        self.hosts, self.ppn, self.ranks, self.rate = hosts, ppn, hosts * ppn, rate
        self.model, self.wire = model, wire
        if model is None:           # scaling: every model in one job
            self.name = 'n1' if self.ranks == 1 else f'n{self.ranks}_ppn{ppn}_{rate}'
        else:
            self.name = f'{model}_h{hosts}_{rate}' + ('' if wire == 'none' else f'_{wire}')
        self.layout = f'{hosts} hosts x {ppn} rank' + ('s' if ppn > 1 else '')


def grid(args):
    if args.mode == 'scaling':
        return [Cell(1, 1, None) if ranks == 1 else Cell(SCALING_HOSTS, ranks // SCALING_HOSTS, rate)
                for ranks in args.ranks for rate in ([None] if ranks == 1 else args.rates)]
    return [Cell(hosts, 1, rate, model, wire) for model in args.models for wire in args.wires
            for hosts in args.hosts for rate in args.rates]


def launches(args, cell, index, out_dir):
    """(job, argv, mpiexec or None) of the cell's jobs, in this cell's order."""
    extra = shlex.split(args.job_args)
    if not any(a == '--timeout' or a.startswith('--timeout=') for a in extra):
        # the job's own deadline (600 s by default) would end a job that --job-timeout
        # allows: VGG-16's autotune warm-up alone outlasts it at 4 test hosts
        extra += ['--timeout', f'{max(args.job_timeout - 30, args.job_timeout / 2):g}']
    if args.mode == 'scaling':
        return [('scaling', [sys.executable, '-m', 'benchmarks.scaling', '--models', ','.join(args.models),
                             '--no-dist-sync', '--out', os.path.join(out_dir, 'scaling'), *extra,
                             *(['--raw-allreduce', args.raw_sizes] if args.raw_sizes != 'none' else [])],
                 None)]

    def job(name, columns, python=sys.executable, more=()):
        argv = [python, '-m', 'benchmarks.overlap', '--model', cell.model, '--columns', columns,
                '--compression', cell.wire, '--topology', f'{cell.layout}, {cell.rate}',
                '--out', os.path.join(out_dir, name), *extra, *more]
        if 'best' in columns:
            argv += ['--best-options', args.best[cell.name]]
        return (name, argv, harness.mpiexec_beside(python) if name == 'horovod' else None)
    jobs = [job('ours', args.columns)]
    if args.horovod_python:
        jobs.append(job('horovod', 'horovod', args.horovod_python))
    if not args.no_p3:
        jobs.append(job('p3', 'dist_sync', more=['--p3']))
    return jobs if index % 2 == 0 else jobs[::-1]


def _launch(hosts, cell, argv, limit, log, mpiexec=None):
    """One MPI program across the test bed; what happened, and its output in log."""
    print(f'    {shlex.join(argv[1:])} (timeout {limit:.0f} s)', flush=True)
    mpiexec = hosts.mpiexec_argv(cell.ranks, ppn=cell.ppn, mpiexec=mpiexec,
                                 extra=['-genv', 'OMP_NUM_THREADS', '1'])
    result = hosts.run(mpiexec + argv, timeout=limit, env={'OMP_NUM_THREADS': '1'},
                       cwd=harness.REPO_ROOT)
    log.write(f'$ {shlex.join(mpiexec + argv)}\n{result.output}\n')
    print(f'      {"timed out" if result.timed_out else f"status {result.returncode}"}, '
          f'{result.elapsed:.0f} s', flush=True)
    if not result.ok:
        print(result.output[-3000:], flush=True)
    return {'returncode': result.returncode, 'timed_out': result.timed_out,
            'elapsed_s': result.elapsed, 'leftovers': result.leftovers, 'argv': argv,
            'timeout_s': limit}


def run_cell(args, cell, index):
    """The cell's jobs on a test bed of its own, taken down whatever happens; the record of
    what happened, with each job's run record under results."""
    out_dir = os.path.join(args.out, 'runs', cell.name)
    os.makedirs(out_dir, exist_ok=True)
    started = time.monotonic()
    record = {'job': cell.name, 'ranks': cell.ranks, 'hosts': cell.hosts, 'ppn': cell.ppn,
              'rate': cell.rate, 'layout': cell.layout, 'model': cell.model, 'wire': cell.wire,
              'steps': {}, 'results': {}}
    print(f'\n=== {cell.name}: {cell.layout}' + (f' at {cell.rate}' if cell.rate else ''), flush=True)
    with open(os.path.join(out_dir, 'log.txt'), 'w') as log:
        try:
            with testbed.Hosts(cell.hosts, rate=cell.rate) as hosts:
                for name, argv, mpiexec in launches(args, cell, index, out_dir):
                    record['steps'][name] = _launch(hosts, cell, argv, args.job_timeout, log, mpiexec)
        except testbed.TestbedError as err:
            record['error'] = str(err)
            log.write(f'testbed error: {err}\n')
            print(f'    testbed error: {err}', flush=True)
    for name in record['steps']:
        found = sorted(glob.glob(os.path.join(out_dir, name, '*_n*.json')))
        if found:
            with open(found[0]) as handle:
                record['results'][name] = json.load(handle)
    record['elapsed_s'] = time.monotonic() - started
    record['ok'] = 'error' not in record and all(
        s['returncode'] == 0 and not s['timed_out'] for s in record['steps'].values())
    print(f'    {cell.name}: {"ok" if record["ok"] else "FAILED"}, {record["elapsed_s"]:.0f} s; '
          f'log {out_dir}/log.txt', flush=True)
    return record


# ---------------------------------------------------------------- the table

def _ms(spread):
    return {key: spread[key] * 1e3 for key in ('min', 'median', 'max')}


def rows_of(cell):
    """The table's rows of one cell: every column's step in ms, compute alone's, and (for
    the cost model) every overlap column's exchange alone."""
    rows = []
    for job, result in cell['results'].items():
        if 'models' in result:          # scaling: a row a model
            for model, entry in result['models'].items():
                rows.append({'label': f'{model}, {cell["ranks"]} ranks', 'hosts': cell['hosts'],
                             'rate': cell['rate'], 'cells': {
                                 r['config']: _ms(harness.spread(r['step_times_s'])) for r in entry['rows']}})
            continue
        if not rows:
            rows.append({'label': f'{cell["model"]}, wire {cell["wire"]}', 'hosts': cell['hosts'],
                         'rate': cell['rate'], 'cells': {}, 'exchange': {}})
        row = rows[0]
        if job == 'ours' or 'compute alone' not in row['cells']:
            row['cells']['compute alone'] = _ms(result['compute_alone'])
        for column in result['columns']:
            if 'step' in column:
                name = 'P3' if job == 'p3' else column['column']
                row['cells'][name], row['exchange'][name] = _ms(column['step']), _ms(column['exchange'])
    return rows


def table(combined):
    """A report.table_record of every cell's rows."""
    rows = [row for cell in combined['cells'] for row in rows_of(cell)]
    names = list(dict.fromkeys(name for row in rows for name in row['cells']))
    columns = [c for c in ORDER if c in names] + [c for c in names if c not in ORDER]
    ratios = [('fifo', c) for c in columns if 'fifo' in columns and c not in ('fifo', 'compute alone')]
    failed = [f'{c["job"]} did not finish: ' + (c.get('error') or ', '.join(
        f'{name} ' + ('timed out' if s['timed_out'] else f'status {s["returncode"]}')
        for name, s in c['steps'].items() if s['returncode'] or s['timed_out']))
        for c in combined['cells'] if not c['ok']]
    return report.table_record(
        'table', f'benchmarks.{combined["mode"]} over test hosts (benchmarks.grid)', combined['command'],
        combined['time'], f'{combined["cores"]} cores; test hosts: network namespaces on it, TCP shaped '
        'by tbf', 'step ms', columns, rows, 'the rounds, each the slowest rank', ratios, failed)


def write_report(args, combined):
    record = table(combined)
    path = report.write_table(args.out, record)
    panels = {f'{r["label"]}, {r["hosts"]} hosts, {r["rate"]}': {c: s for c, s in r['cells'].items() if s}
              for r in record['rows']}
    print('\n' + report.table_markdown(record), flush=True)
    print(f'table written to {path}\n'
          + report.plot_bars(os.path.join(args.out, 'table.png'), panels, 'step ms', record['title']))


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
    print(f'grid: {len(cells)} cells ({", ".join(c.name for c in cells)})', flush=True)
    combined = {'benchmark': 'grid', 'mode': args.mode, 'time': time.strftime('%Y-%m-%dT%H:%M:%S%z'),
                'command': shlex.join(['python', '-m', 'benchmarks.grid', *sys.argv[1:]]),
                'config': {k: v for k, v in vars(args).items() if k != 'best'}, 'best': args.best,
                'cores': os.cpu_count(), 'testbed': {'transport': testbed.TCP_ENV, 'shaping': 'tbf'},
                'cells': []}
    started = time.monotonic()
    for index, cell in enumerate(cells):
        combined['cells'].append(run_cell(args, cell, index))
        combined['elapsed_s'] = time.monotonic() - started
        harness.replace_json(os.path.join(args.out, JSON_NAME), combined)   # a killed run keeps the cells done
    write_report(args, combined)
    failed = [c['job'] for c in combined['cells'] if not c['ok']]
    print(f'{len(cells)} cells in {combined["elapsed_s"]:.0f} s' + (f'; failed: {", ".join(failed)}' if failed else ''))
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
