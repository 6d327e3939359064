"""Training throughput over the multi-host test bed: benchmarks/scaling.py at several link rates.

    python -m benchmarks.testbed_scaling --quick                  # smoke run, about 2 minutes
    python -m benchmarks.testbed_scaling [--rates 1gbit,3gbit,10gbit] [--ranks 1,2,4] [--report-only]

Runs as root, not under mpiexec: it builds the test bed itself (testbed/README.md). One
scaling.py job per grid point (1 rank on one host alone; N ranks over 2 hosts, N/2 a host,
at every rate), each under a timeout, its test bed torn down
whatever happens. Ranks on different hosts talk TCP over a tbf-shaped veth link. Jobs run
with --no-dist-sync (benchmarks/overlap.py compares ps-lite across hosts). Each job also
times raw MPI Allreduce(IN_PLACE) of --raw-sizes in the exchange-alone rounds: the
network's alpha and beta under the same load, which cost_model calibrates on.

Writes into --out: runs/<job>/ (each job's JSONs and log.txt), testbed_scaling.json (every
job and how it ended), testbed_scaling.md (per model: config x rate, with step ms, exchange
alone, hidden share and vs none) and a plot per model; --report-only rebuilds the last two.
All hosts share this machine's cores: a test bed shows what the network does to a job.
"""
import json
import os
import shlex
import sys
import time

import testbed
from benchmarks import harness, report

DEFAULT_OUT = os.path.join(harness.DEFAULT_OUT, 'testbed')
QUICK = {'rates': '3gbit', 'ranks': '1,2', 'designs': 'funneled,blocking', 'warmups': 1,
         'steps': 2, 'batch_size': 16}
HOSTS = 2                   # every multi-rank job spans two hosts
STARTUP_S = 120             # import, model build, store creation, numba compile: per job
JSON_NAME = 'testbed_scaling.json'


# ---------------------------------------------------------------- arguments

def parse_args(argv=None):
    parser = harness.parser(__doc__)
    add = parser.add_argument
    add('--quick', action='store_true', help=f'a smoke run: {QUICK} (explicit options win)')
    add('--rates', default='1gbit,3gbit,10gbit', help='comma-separated link rates')
    add('--ranks', default='1,2,4', help='1: one host alone; N > 1: N/2 ranks on each of 2 hosts')
    add('--models', default='resnet18_v1', help='scaling.py models')
    add('--designs', help="scaling.py's (default: every design)")
    add('--trainer-designs', help="scaling.py's, e.g. 'chained,funneled+group_bytes=0'")
    add('--warmup-steps', dest='warmups', type=int, default=2, help='untimed rounds')
    add('--steps', type=int, default=8, help='timed rounds per job')
    add('--batch-size', type=int, help="images per rank per step (default: scaling.py's)")
    add('--steps-per-round', type=int, default=1, help="scaling.py's")
    add('--step-timeout', type=float, default=300.0, help="seconds a step may take (scaling.py's --timeout)")
    add('--run-timeout', type=float, help='seconds a job may take (default: from the rounds, >= 600)')
    add('--raw-sizes', default='4K,64K,1M,4M,16M,43M',
        help="raw MPI Allreduce sizes timed in each job (scaling.py --raw-allreduce; 'none': none)")
    add('--out', default=DEFAULT_OUT, help='results folder')
    add('--report-only', action='store_true', help='rebuild the table and plot from --out')
    args = parser.parse_args(argv)
    if args.quick:              # QUICK's values become the defaults; explicit options win
        parser.set_defaults(**QUICK)
        args = parser.parse_args(argv)
    args.rates = harness.names(args.rates)
    args.ranks = [int(r) for r in harness.names(args.ranks)]
    for rate in args.rates:
        testbed.parse_rate(rate)            # raises on a bad rate before anything starts
    bad = [r for r in args.ranks if r < 1 or (r > 1 and r % HOSTS)]
    if bad:
        raise SystemExit(f'--ranks: 1, or a multiple of {HOSTS} (ranks spread over {HOSTS} hosts), not {bad}')
    if args.warmups < 0 or args.steps < 1:
        raise SystemExit('--warmup-steps must be >= 0 and --steps >= 1')
    args.out = os.path.abspath(args.out)
    return args


# ---------------------------------------------------------------- the grid

class Job:
    """One scaling.py run on one test bed: ranks, hosts, ranks per host, link rate."""

    def __init__(self, ranks, rate):
        self.ranks, self.rate = ranks, rate if ranks > 1 else None
        self.hosts = 1 if ranks == 1 else HOSTS
        self.ppn = ranks // self.hosts

    @property
    def name(self):
        return 'n1' if self.ranks == 1 else f'n{self.ranks}_ppn{self.ppn}_{self.rate}'

    @property
    def layout(self):
        if self.ranks == 1:
            return '1 rank, 1 host'
        return f'{self.ranks} ranks, {self.hosts} hosts x {self.ppn}'

    def describe(self):
        return f'{self.layout}' + (f' at {self.rate}' if self.rate else '')


def grid(args):
    return [Job(ranks, rate) for ranks in args.ranks
            for rate in ([None] if ranks == 1 else args.rates)]


def scaling_argv(args, job, out_dir):
    # Run as a module from the repository root (_launch's working directory), so that its
    # benchmarks and mpi_kvstore come first on sys.path.
    argv = [sys.executable, '-m', 'benchmarks.scaling',
            '--models', args.models, '--warmup-steps', str(args.warmups), '--steps', str(args.steps),
            '--no-dist-sync', '--timeout', f'{args.step_timeout:g}', '--out', out_dir]
    if args.designs:
        argv += ['--designs', args.designs]
    if args.trainer_designs:
        argv += ['--trainer-designs', args.trainer_designs]
    if args.batch_size:
        argv += ['--batch-size', str(args.batch_size)]
    if args.steps_per_round != 1:
        argv += ['--steps-per-round', str(args.steps_per_round)]
    if args.raw_sizes and args.raw_sizes != 'none':
        argv += ['--raw-allreduce', args.raw_sizes]
    return argv


def run_timeout(args, job):
    """A whole job's limit: startup plus every round of every config, at a pessimistic
    2 s per step and rank (4 ranks on 2 cores at 1 Gbit/s take about 1.5 s a step)."""
    if args.run_timeout:
        return args.run_timeout
    configs = (3 + (len(harness.names(args.designs)) if args.designs else 4)
               + len(harness.names(args.raw_sizes))
               + (len(harness.names(args.trainer_designs)) if args.trainer_designs else 1))
    rounds = (args.warmups + args.steps) * (1 + args.steps_per_round)   # training, exchange alone
    models = len(harness.names(args.models))
    return max(600.0, STARTUP_S + models * rounds * configs * 2.0 * max(1, job.ranks // 2))


def _launch(hosts, job, argv, limit, log, mpiexec=None):
    """One MPI program across the test bed (mpiexec: a hydra of its own, e.g. beside another
    Python); what happened, and the output in LOG."""
    print(f'    {shlex.join(argv[1:])} (timeout {limit:.0f} s)', flush=True)
    mpiexec = hosts.mpiexec_argv(job.ranks, ppn=job.ppn, mpiexec=mpiexec,
                                 extra=['-genv', 'OMP_NUM_THREADS', '1'])
    result = hosts.run(mpiexec + argv, timeout=limit, env={'OMP_NUM_THREADS': '1'},
                       cwd=harness.REPO_ROOT)
    log.write(f'$ {shlex.join(mpiexec + argv)}\n{result.output}\n')
    status = ('timed out' if result.timed_out else f'status {result.returncode}')
    print(f'      {status}, {result.elapsed:.0f} s', flush=True)
    if not result.ok:
        print(result.output[-3000:], flush=True)
    return {'returncode': result.returncode, 'timed_out': result.timed_out,
            'elapsed_s': result.elapsed, 'leftovers': result.leftovers, 'argv': argv,
            'timeout_s': limit}


def run_job(args, job):
    """scaling.py on job's test bed, under a timeout."""
    out_dir = os.path.join(args.out, 'runs', job.name)
    record = on_testbed(job, out_dir, [('scaling', scaling_argv(args, job, out_dir),
                                        run_timeout(args, job), None)])
    record['result_files'] = {'scaling': os.path.join(out_dir, f'scaling_n{job.ranks}.json')}
    return record


def on_testbed(job, out_dir, launches):
    """Bring a test bed up (job: hosts, rate, ranks, ppn, name, layout), run each of launches
    (name, argv, timeout s, mpiexec or None) across it in turn, take it down whatever
    happens (testbed.Hosts); the record of what happened, each program's output in
    out_dir/log.txt."""
    os.makedirs(out_dir, exist_ok=True)
    started = time.monotonic()
    record = {'job': job.name, 'ranks': job.ranks, 'hosts': job.hosts, 'ppn': job.ppn,
              'rate': job.rate, 'layout': job.layout, 'steps': {}}
    print(f'\n=== {job.describe()}', flush=True)
    with open(os.path.join(out_dir, 'log.txt'), 'w') as log:
        try:
            with testbed.Hosts(job.hosts, rate=job.rate) as hosts:
                for name, argv, limit, mpiexec in launches:
                    record['steps'][name] = _launch(hosts, job, argv, limit, log, mpiexec)
        except testbed.TestbedError as err:
            record['error'] = str(err)
            log.write(f'testbed error: {err}\n')
            print(f'    testbed error: {err}', flush=True)
    record['elapsed_s'] = time.monotonic() - started
    record['ok'] = 'error' not in record and all(
        s['returncode'] == 0 and not s['timed_out'] for s in record['steps'].values())
    print(f'    {job.name}: {"ok" if record["ok"] else "FAILED"}, {record["elapsed_s"]:.0f} s; '
          f'log {out_dir}/log.txt', flush=True)
    return record


# ---------------------------------------------------------------- collecting and reporting

def load(record, name):
    """A job's json from scaling.py, or None (not run, or killed before it saved
    anything)."""
    try:
        with open(record['result_files'][name]) as handle:
            return json.load(handle)
    except (KeyError, OSError, ValueError):
        return None


def combine(args, records, started_at, elapsed):
    jobs = [dict(record, scaling=load(record, 'scaling')) for record in records]
    combined = {'benchmark': 'testbed_scaling', 'time': started_at, 'elapsed_s': elapsed,
                'config': dict(vars(args)), 'hosts': HOSTS,
                'testbed': {'transport': testbed.TCP_ENV, 'shaping': 'tbf, both directions, '
                            'bucket 2 ms at the rate, queue 20 ms; no added delay'},
                'dist_sync': 'not run here (--no-dist-sync): benchmarks/overlap.py compares it '
                             'across test hosts',
                'jobs': jobs}
    harness.replace_json(os.path.join(args.out, JSON_NAME), combined)
    return combined


def rows_by_model(combined):
    """{model: {(layout, rate): {config: row}}} plus model info, from every job that ran."""
    models = {}
    for job in combined['jobs']:
        payload = job.get('scaling')
        if not payload:
            continue
        for model, entry in payload['models'].items():
            target = models.setdefault(model, {'info': entry['info'], 'cells': {}, 'skipped': {}})
            target['cells'][(job['layout'], job['rate'])] = {r['config']: r for r in entry['rows']}
            target['skipped'].update({k: v for k, v in payload.get('skipped', {}).items()
                                      if k != 'dist_sync'})
    return models


def _step_cell(row):
    """'median (min-max)' of a row's step ms, over its timed rounds."""
    times = row.get('step_times_s') or []
    if row.get('step_ms') is None or not times:
        return report.cell(row.get('step_ms'), '.0f')
    return f'{row["step_ms"]:.0f} ({min(times) * 1e3:.0f}-{max(times) * 1e3:.0f})'


def _config_order(names):
    """single, none, the stores in scaling.py's order, then anything else."""
    first = [n for n in ('single', 'none') if n in names]
    return first + [n for n in names if n not in first]


def markdown(combined):
    lines = []
    config = combined['config']
    for model, data in rows_by_model(combined).items():
        info = data['info']
        lines += [(f'## {model}: batch {info["batch_per_rank"]} per rank, '
                  f'{info["gradient_bytes"] / 1e6:.1f} MB of gradients in {info["gradient_arrays"]} arrays'),
                  '',
                  (f'Median (min-max) of {config["steps"]} interleaved rounds after {config["warmups"]} '
                  'warm-up rounds; each step the slowest rank. Cell: step ms / exchange alone ms / hidden '
                  'share / the most any overlap could hide on these cores (hidden max: from the '
                  "machine's CPU, scaling.py) / step of `none` (compute only) divided by this "
                  'step.'), '']
        layouts = []
        for layout, _rate in data['cells']:
            if layout not in layouts:
                layouts.append(layout)
        for layout in layouts:
            rates = [rate for (lay, rate) in data['cells'] if lay == layout]
            names = []
            for rate in rates:
                names += [n for n in data['cells'][(layout, rate)] if n not in names]
            headers = ['config'] + [f'{rate or "no network"}: {h}' if h == 'step ms' else h
                                    for rate in rates
                                    for h in ('step ms', 'alone ms', 'hidden', 'hidden max', 'vs none')]
            table = []
            for name in _config_order(names):
                cells = []
                for rate in rates:
                    row = data['cells'][(layout, rate)].get(name)
                    if row is None:
                        cells += ['-'] * 5
                        continue
                    cells += [_step_cell(row), report.cell(row['exchange_alone_ms'], '.0f'),
                              report.cell(row['hidden'], '+.2f'), report.cell(row.get('hidden_max'), '.2f'),
                              report.cell(row['vs_none'], '.2f', 'x')]
                table.append([name] + cells)
            lines += [f'**{layout}**', '', report.markdown(headers, table), '']
        for config_name, why in data['skipped'].items():
            lines.append(f'- skipped {config_name}: {why}')
        lines.append(f'- skipped dist_sync: {combined["dist_sync"]}')
        lines.append('')
    for job in combined['jobs']:
        if job.get('ok'):
            continue
        what = job.get('error') or ', '.join(
            f'{name} ' + ('timed out' if s['timed_out'] else f'status {s["returncode"]}')
            for name, s in job['steps'].items() if s['returncode'] != 0 or s['timed_out'])
        lines.append(f'- job {job["job"]} did not finish: {what} (partial results, if any, '
                     'are in the table)')
    lines.append(f'Jobs took {sum(j.get("elapsed_s") or 0 for j in combined["jobs"]):.0f} s in all.')
    return '\n'.join(lines) + '\n'


def plot(combined, out):
    """Per model: step ms against link rate, a line per layout and config (report.plot_lines)."""
    messages = []
    for model, data in rows_by_model(combined).items():
        series = {}
        cells = [(key, rows) for key, rows in data['cells'].items() if key[1] is not None]
        for (layout, rate), rows in sorted(cells, key=lambda c: testbed.parse_rate(c[0][1])):
            for name, row in rows.items():
                if name != 'single' and row.get('step_ms') is not None:
                    xs, ys = series.setdefault(f'{layout}: {name}', ([], []))
                    xs.append(testbed.parse_rate(rate) / 1e9)
                    ys.append(row['step_ms'])
        if series:
            messages.append(report.plot_lines(
                os.path.join(out, f'testbed_scaling_{model}.png'), series, 'link rate (Gbit/s)',
                'step (ms)', f'{model}: training step over the test bed (2 hosts, shared cores)'))
    return messages


def write_report(args, combined):
    text = markdown(combined)
    path = os.path.join(args.out, 'testbed_scaling.md')
    with open(path, 'w') as handle:
        handle.write('# Training over the test bed (benchmarks/testbed_scaling.py)\n\n' + text)
    print('\n' + text)
    print(f'table written to {path}')
    for message in plot(combined, args.out):
        print(message)


# ---------------------------------------------------------------- main

def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.report_only:
        with open(os.path.join(args.out, JSON_NAME)) as handle:
            combined = json.load(handle)
        write_report(args, combined)
        return 0
    ok, why = testbed.available(rate=True, mpi=True)
    if not ok:
        raise SystemExit(f'the test bed is not available here: {why}')
    jobs = grid(args)
    print(f'testbed_scaling: {len(jobs)} jobs ({", ".join(j.name for j in jobs)}), models '
          f'{args.models}, {args.warmups} + {args.steps} rounds', flush=True)
    started_at, started = time.strftime('%Y-%m-%dT%H:%M:%S%z'), time.monotonic()
    records = []
    for job in jobs:
        records.append(run_job(args, job))
        combine(args, records, started_at, time.monotonic() - started)   # a killed run keeps these
    combined = combine(args, records, started_at, time.monotonic() - started)
    write_report(args, combined)
    failed = [r['job'] for r in records if not r['ok']]
    print(f'\n{len(jobs)} jobs in {combined["elapsed_s"]:.0f} s'
          + (f'; failed: {", ".join(failed)}' if failed else ''))
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
