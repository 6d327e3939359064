"""Every benchmark runs for a few iterations on tiny sizes, so that none rots unnoticed.

Each runs as users run it, ``[mpiexec -n 2] python -m benchmarks.NAME`` from the repository
root, under a timeout; the checks read what it wrote: the JSON's methods and their timings,
or its report lines. grid runs across two test hosts where the test bed can be built (root,
as CI); cost_model then fits and validates on what grid --scaling measured. gpu_bandwidth
needs CuPy and a GPU.
"""
import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import uuid

import numpy as np
import pytest

import testbed
from benchmarks import harness, report, schema

from mpi_harness import REPO_ROOT, child_env, kill_leftovers, launcher_flags

BENCHMARKS = os.path.join(REPO_ROOT, 'benchmarks')
NPROCS = 2
TIMEOUT = 180           # seconds for one job; each takes 2-40 s here (most of it imports)
KILL_GRACE = 10         # seconds between SIGTERM (testbed.Hosts tears down) and SIGKILL
# gpu_like's smallest model (1.9 MB of gradients): the scripts that train it run in seconds.
SMALL_MODEL = 'mobilenet0.25'
TESTBED, WHY_NO_TESTBED = testbed.available(rate=True, mpi=True)
needs_testbed = pytest.mark.skipif(not TESTBED, reason=WHY_NO_TESTBED or 'test bed available')


def run(argv, timeout=TIMEOUT, env=None):
    """Output of argv, run from the repository root. A non-zero exit or the timeout fails the
    test, after every process of the job is ended: its process group, then any that left it
    (hydra starts ranks in sessions of their own) by the run id child_env marks them with."""
    run_id = uuid.uuid4().hex
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen([str(word) for word in argv], stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                env=child_env(env, run_id), start_new_session=True)
        try:
            status = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            status = None
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(KILL_GRACE)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
        finally:
            kill_leftovers(run_id)
        log.seek(0)
        output = log.read().decode('utf-8', 'replace')
    what = f'timed out after {timeout} s' if status is None else f'exited with {status}'
    assert status == 0, f'{" ".join(map(str, argv))} {what}:\n{output[-4000:]}'
    return output


def _signal_group(pgid, sig):
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def python_m(module, *args):
    return [sys.executable, '-m', f'benchmarks.{module}', *args]


def mpirun(mpiexec, module, *args, env=None):
    """python -m benchmarks.MODULE ARGS on NPROCS ranks of this machine."""
    return run([mpiexec, *launcher_flags(mpiexec), '-n', NPROCS, *python_m(module, *args)], env=env)


def load(path):
    with open(path) as handle:
        return json.load(handle)


def positive(value):
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def check_run_record(record, benchmark):
    """What every JSON a benchmark writes carries besides its results."""
    assert schema.check(record) == 'run'
    assert record['benchmark'] == benchmark
    assert record['nranks'] == NPROCS and record['config']['nranks'] == NPROCS
    assert record['versions']['mpi_kvstore'] and record['versions']['mxnet']


# ---------------------------------------------------------------- the package itself

def test_benchmarks_is_a_package_without_path_edits():
    """Scripts import each other as benchmarks.*; none edits sys.path, and the package's
    docstring names every script."""
    import benchmarks
    scripts = sorted(name[:-3] for name in os.listdir(BENCHMARKS)
                     if name.endswith('.py') and name != '__init__.py')
    for name in scripts:
        with open(os.path.join(BENCHMARKS, name + '.py')) as handle:
            assert not re.search(r'sys\.path\.(insert|append|extend)|sys\.path\s*(\[|\+?=)',
                                 handle.read()), name
        assert re.search(rf'^\s+{name}\s', benchmarks.__doc__, re.MULTILINE), f'{name} not in the docstring'


RESULTS = os.path.join(BENCHMARKS, 'results')


def committed_tables():
    """{name: record} of the tables in benchmarks/results/ (its top level: runs write below)."""
    tables = {}
    for name in sorted(os.listdir(RESULTS)):
        if name.endswith('.json'):
            tables[name[:-5]] = load(os.path.join(RESULTS, name))
    return tables


def test_committed_results_are_the_documented_tables():
    """benchmarks/results/ holds, at its top, a table a pair: NAME.json of kind 'table' (the
    schema checks its rows: hosts, rate, min <= median <= max) and NAME.md, exactly its
    rendering; every JSON below (a local run's) follows the schema too."""
    tables = committed_tables()
    files = {name for name in os.listdir(RESULTS) if os.path.isfile(os.path.join(RESULTS, name))}
    assert files == {f'{name}.{ext}' for name in tables for ext in ('json', 'md')}, files
    assert {'overlap', 'horovod', 'grid', 'scaling', 'allreduce', 'gpu_bandwidth'} <= set(tables)
    for name, record in tables.items():
        assert schema.check(record, name) == 'table' and record['table'] == name
        assert record['command'] and record['date'][:4] == '2026' and record['machine'], name
        with open(os.path.join(RESULTS, name + '.md')) as handle:
            assert handle.read() == report.table_markdown(record), name
    assert set(schema.check_tree(RESULTS).values()) <= set(schema.KINDS)


def test_every_table_of_benchmarks_md_is_a_committed_one():
    """Each measurement table docs/benchmarks.md shows is a committed table's, line for line:
    the page quotes result files, never figures of its own (its last section, the retired
    scripts, is a list of commits)."""
    with open(os.path.join(REPO_ROOT, 'docs', 'benchmarks.md')) as handle:
        page = handle.read().split('\n## Retired scripts\n')[0]
    shown = re.findall(r'(?:^\|.*\|\n)+', page, re.MULTILINE)
    committed = [report.table_markdown(record) for record in committed_tables().values()]
    assert len(shown) >= 6
    for table in shown:
        assert any(table in text for text in committed), table[:300]


def test_schema_names_what_a_result_lacks(tmp_path):
    """A table whose row lacks its rate or whose cell is out of order, a run record without
    its versions or its command, or a file of no kind at all is refused with the file and
    what is wrong named."""
    table = load(os.path.join(RESULTS, 'overlap.json'))
    assert schema.check(table, 't.json') == 'table'
    row = table['rows'][0]
    row['cells']['fifo'] = dict(row['cells']['fifo'], min=row['cells']['fifo']['max'] + 1)
    with pytest.raises(schema.SchemaError, match=r"t\.json: row .*, fifo: not min <= median <= max"):
        schema.check(table, 't.json')
    del row['rate']
    with pytest.raises(schema.SchemaError, match=r't\.json: row .* without rate'):
        schema.check(table, 't.json')
    record = {'benchmark': 'overlap', 'versions': {}, 'env': {}, 'nranks': 2, 'time': 'now',
              'skipped': {}, 'config': {key: 1 for key in schema.CONFIG}}
    record['versions'] = {key: 'x' for key in schema.VERSIONS}
    assert schema.check(record, 'r.json') == 'run'
    del record['config']['command']
    with pytest.raises(schema.SchemaError, match=r'r\.json: a run result without config\.command'):
        schema.check(record, 'r.json')
    del record['versions']
    with pytest.raises(schema.SchemaError, match=r'without versions, config\.command'):
        schema.check(record, 'r.json')
    (tmp_path / 'NOTES.md').write_text('# prose\n')
    (tmp_path / 'x.json').write_text(json.dumps({'figures': [1, 2]}))
    with pytest.raises(schema.SchemaError, match=r'x\.json: not a result of any kind'):
        schema.check_tree(tmp_path)


class _OneRank:
    """A communicator of one rank that keeps the value it gathers (a digest)."""

    def allgather(self, value):
        self.value = value
        return [value]


class _Ranks:
    """This rank and others holding `others` (lists of arrays): allgather returns this
    rank's value and each other rank's digest."""

    def __init__(self, others):
        self.digests = []
        for arrays in others:
            alone = _OneRank()
            assert harness.ranks_differ(arrays, alone) is None
            self.digests.append(alone.value)

    def allgather(self, value):
        return [value, *self.digests]


def test_ranks_differ_compares_every_array_of_every_rank():
    """harness.ranks_differ (scaling's check that every rank starts from rank 0's weights): None where every
    rank holds the same bytes, a view or a copy alike; one element changed in the last array,
    or two arrays swapped, on one rank of three is found and named."""
    mine = [np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2], np.ones(5, np.float32)]
    same = [np.ascontiguousarray(mine[0]), mine[1].copy()]
    assert harness.ranks_differ(mine, _Ranks([same, same])) is None
    changed = [same[0], same[1].copy()]
    changed[1][4] = np.nextafter(np.float32(1), np.float32(2))
    for other in (changed, same[::-1]):
        why = harness.ranks_differ(mine, _Ranks([same, other]))
        assert why is not None and why.startswith('weights differ across ranks (digests ['), why


# ---------------------------------------------------------------- MPI benchmarks on this machine

def test_allreduce(mpi_available, tmp_path):
    out = mpirun(mpi_available, 'allreduce', '--sizes', '4K,64K', '--warmups', 1, '--trials', 2,
                 '--fusion-keys', 4, '--fusion-size', '4K', '--designs', 'funneled,blocking',
                 '--out', tmp_path)
    record = load(tmp_path / f'allreduce_n{NPROCS}.json')
    check_run_record(record, 'allreduce')
    assert record['config']['interleaved'] is True and '--fusion-keys' in record['config']['argv']
    assert record['skipped'] == {}
    rows = record['results']
    methods = {'raw_mpi', 'raw_mpi:in_place', 'engine_floor', 'mpi_kvstore:funneled',
               'mpi_kvstore:blocking', 'dist_sync'}
    for size in (4096, 65536):
        assert {r['method'] for r in rows if r['case'] == 'allreduce' and r['bytes'] == size} == methods
    assert {r['method'] for r in rows if r['case'] == 'fusion'} == methods - {'raw_mpi:in_place'}
    for row in rows:
        assert len(row['trials_us']) == 2 and all(positive(t) for t in row['trials_us']), row
        assert row['min_us'] <= row['latency_us'] <= row['max_us'], row
        assert positive(row['algbw_GBps']), row
    assert re.search(r'^\s+4KB  dist_sync\s+\d', out, re.MULTILINE), out[-3000:]
    assert 'fusion: 4 keys x 4KB' in out
    assert (tmp_path / f'allreduce_n{NPROCS}.png').exists()


def test_scaling(mpi_available, tmp_path):
    """A training step of every kind once (one design each), ps-lite with its P3 van."""
    out = mpirun(mpi_available, 'scaling', '--models', 'resnet20', '--batch-size', 2,
                 '--warmup-steps', 0, '--steps', 2, '--designs', 'blocking', '--trainer-designs',
                 'chained', '--raw-allreduce', '4K', '--p3', '--out', tmp_path)
    record = load(tmp_path / f'scaling_n{NPROCS}.json')
    check_run_record(record, 'scaling')
    entry = record['models']['resnet20']
    configs = [r['config'] for r in entry['rows']]
    assert configs[:2] == ['single', 'none']
    expected = {'single', 'none', 'mpi_kvstore:blocking', 'DistributedTrainer:chained', 'dist_sync:p3'}
    assert set(configs) - {'horovod'} == expected, (configs, record['skipped'])
    assert 'horovod' in configs or 'horovod' in record['skipped']
    for row in entry['rows']:
        assert len(row['step_times_s']) == 2 and positive(row['step_ms']), row
        assert row['step_min_ms'] <= row['step_ms'] <= row['step_max_ms'], row
        assert positive(row['images_per_s']), row
        assert row['step_ms'] == pytest.approx(float(np.median(row['step_times_s'])) * 1e3), row
        assert len(row['cpu_step']['rank_cpu_ms_per_unit']) == (1 if row['config'] == 'single' else NPROCS)
        if row['config'] not in ('single', 'none'):
            none = next(r for r in entry['rows'] if r['config'] == 'none')
            compute, alone = none['step_ms'], row['exchange_alone_ms']
            assert row['hidden'] == pytest.approx(
                (compute + alone - row['step_ms']) / min(compute, alone)), row
    (raw,) = entry['raw_allreduce']
    assert raw['bytes'] == 4096 and positive(raw['median_ms'])
    assert entry['info']['gradient_arrays'] == len(entry['info']['gradient_sizes']) > 0
    assert 'best mpi_kvstore config:' in out and 'how to read the tables:' in out


def test_overlap(mpi_available, tmp_path):
    """Every trainer of issue 21's side by side trains, passes the weight check and is timed."""
    out = mpirun(mpi_available, 'overlap', '--model', SMALL_MODEL, '--warmups', 1, '--rounds', 2,
                 '--chain', 2, '--topology', 'smoke', '--out', tmp_path)
    record = load(tmp_path / f'overlap_n{NPROCS}_{SMALL_MODEL}_h1.json')
    check_run_record(record, 'overlap')
    topology = record['topology']
    assert (topology['hosts'], list(topology['ranks_per_host'].values())) == (1, [NPROCS])
    assert topology['label'] == record['config']['topology'] == 'smoke'
    assert len(record['compute_alone']['step_s']) == 2 and positive(record['compute_alone']['median'])
    rows = {row['column']: row for row in record['columns']}
    assert set(rows) - {'horovod'} == {'fifo', 'priority', 'gluon', 'dist_sync'}, (rows, record['skipped'])
    assert 'horovod' in rows or 'horovod' in record['skipped']
    # One host: the default store resolves the 'auto' options to no partitioning.
    assert rows['fifo']['options']['partition_bytes'] == rows['priority']['options']['partition_bytes'] == 0
    for row in rows.values():
        assert row['check'] == 'ok', row
        assert len(row['step_s']) == len(row['exchange_s']) == 2, row
        assert all(positive(t) for t in row['step_s'] + row['exchange_s']), row
        step, exchange = row['step']['median'], row['exchange']['median']
        assert step == float(np.median(row['step_s'])) and exchange == float(np.median(row['exchange_s']))
        compute = record['compute_alone']['median']
        assert row['hidden_share'] == pytest.approx((compute + exchange - step) / min(compute, exchange))
        assert row['step_over_max'] == pytest.approx(step / max(compute, exchange)), row
        assert row['vs_fifo'] == pytest.approx(rows['fifo']['step']['median'] / step), row
        # every rank's CPU a step, and the machine's busy share (every rank is on it)
        cpu = row['cpu_step']
        assert len(cpu['rank_cpu_ms_per_unit']) == NPROCS and cpu['machine_busy'] > 0, cpu
    assert rows['fifo']['vs_fifo'] == 1.0
    assert re.search(r'^\| dist_sync \| [\d.]+ \(', out, re.MULTILINE), out[-3000:]
    assert (tmp_path / f'overlap_n{NPROCS}_{SMALL_MODEL}_h1.png').exists()
    assert '| fifo |' in (tmp_path / f'overlap_n{NPROCS}_{SMALL_MODEL}_h1.md').read_text()


# ---------------------------------------------------------------- across test hosts

@needs_testbed
def test_grid_scaling_then_cost_model(mpi_available, tmp_path):
    """grid --scaling: one rank alone and two over two test hosts; its table holds each
    config's step as the jobs' records have it; then the cost model fitted and checked on
    them."""
    out = run(python_m('grid', '--scaling', '--ranks', '1,2', '--rates', '3gbit', '--models', 'resnet20',
                       '--raw-sizes', '4K,64K', '--job-timeout', TIMEOUT, '--job-args',
                       '--designs blocking --warmup-steps 0 --steps 2 --batch-size 2', '--out', tmp_path),
              timeout=2 * TIMEOUT)     # two jobs, each with a test bed of its own
    combined = load(tmp_path / 'grid.json')
    assert schema.check(combined) == 'grid' and combined['mode'] == 'scaling'
    cells = {cell['job']: cell for cell in combined['cells']}
    assert set(cells) == {'n1', 'n2_ppn1_3gbit'}, out[-3000:]
    table = load(tmp_path / 'table.json')
    assert schema.check(table) == 'table'
    for cell, row in zip(combined['cells'], table['rows']):
        assert cell['ok'], cell
        rows = {r['config']: r for r in cell['results']['scaling']['models']['resnet20']['rows']}
        assert list(rows)[:3] == ['single', 'none', 'mpi_kvstore:blocking'], list(rows)
        assert (row['label'], row['hosts'], row['rate']) == (
            f'resnet20, {cell["ranks"]} ranks', cell['hosts'], cell['rate'])
        for config, spread in row['cells'].items():
            steps = rows[config]['step_times_s']
            assert spread == pytest.approx({'min': min(steps) * 1e3, 'median': float(np.median(steps)) * 1e3,
                                            'max': max(steps) * 1e3}), config
    md = (tmp_path / 'table.md').read_text()
    assert md == report.table_markdown(table) and '| resnet20, 2 ranks | 2 | 3gbit |' in md
    (tmp_path / 'table.md').unlink()
    run(python_m('grid', '--report-only', '--out', tmp_path))
    assert (tmp_path / 'table.md').read_text() == md

    model_out = tmp_path / 'model'
    run(python_m('cost_model', '--measured', tmp_path / 'grid.json', '--out', model_out))
    result = load(model_out / 'cost_model.json')
    points = [p for p in result['validation'] if p['config'] == 'mpi_kvstore:blocking']
    assert len(points) == 1 and 'skipped' not in points[0], result['validation']
    measured = cells['n2_ppn1_3gbit']['results']['scaling']['models']['resnet20']['rows']
    assert points[0]['step_ms'] == pytest.approx(
        next(r['step_ms'] for r in measured if r['config'] == 'mpi_kvstore:blocking'))
    for key in ('alone_ms', 'alone_model_ms', 'step_model_ms'):
        assert positive(points[0][key]), points[0]
    line = result['calibration']['lines']['3gbit/n2/ppn1']
    # fitted on the raw Allreduce timed in the job's own exchange-alone rounds (--raw-sizes)
    assert line['source'] == 'interleaved' and set(line['points_s']) == {'4096', '65536'}, line
    assert (model_out / 'cost_model.png').exists()


GRID_CELL = 'mobilenet0.25_h2_3gbit_fp16'


@needs_testbed
def test_grid_smallest_overlap_cell(mpi_available, tmp_path):
    """The grid's smallest cell end to end: FIFO, autotuned (settled first) and best on an
    fp16 wire across two test hosts, every weight checked; the table's cells are the job's
    spreads and its ratios their medians', and --report-only rebuilds it."""
    out = run(python_m('grid', '--hosts', 2, '--rates', '3gbit', '--models', SMALL_MODEL,
                       '--wires', 'fp16', '--columns', 'fifo,autotuned,best', '--no-p3',
                       '--best-options', 'partition_bytes=1M,credit_bytes=4M', '--job-timeout', TIMEOUT,
                       '--job-args', '--warmups 0 --rounds 2 --chain 2 --autotune-steps 1',
                       '--out', tmp_path))
    combined = load(tmp_path / 'grid.json')
    (cell,) = combined['cells']
    assert cell['job'] == GRID_CELL and cell['ok'] and set(cell['results']) == {'ours'}, out[-3000:]
    result = cell['results']['ours']
    assert result['topology']['hosts'] == 2 and result['model'] == SMALL_MODEL
    rows = {row['column']: row for row in result['columns']}
    assert list(rows) == ['fifo', 'autotuned', 'best'] and result['skipped'] == {}, rows
    for row in rows.values():
        assert row['check'] == 'ok' and len(row['step_s']) == 2, row
        assert row['options']['compression'] == 'fp16', row['options']
    tuned = rows['autotuned']['options']['autotune']
    assert tuned['settled'] and 0 < tuned['steps'] <= tuned['bound'] + 2, tuned
    assert (rows['best']['options']['partition_bytes'], rows['best']['options']['credit_bytes']) == (
        1 << 20, 4 << 20)
    table = load(tmp_path / 'table.json')
    (row,) = table['rows']
    assert table['columns'] == ['compute alone', 'fifo', 'autotuned', 'best']
    assert table['ratios'] == [['fifo', 'autotuned'], ['fifo', 'best']]
    for name, spread in row['cells'].items():
        source = result['compute_alone'] if name == 'compute alone' else rows[name]['step']
        assert spread == pytest.approx({k: source[k] * 1e3 for k in ('min', 'median', 'max')}), name
    md = (tmp_path / 'table.md').read_text()
    line = next(line for line in md.splitlines() if line.startswith(f'| {SMALL_MODEL}, wire fp16 |'))
    assert line.split(' | ')[-2:] == [
        f'{rows["fifo"]["step"]["median"] / rows["autotuned"]["step"]["median"]:.2f}x',
        f'{rows["fifo"]["step"]["median"] / rows["best"]["step"]["median"]:.2f}x |'], line
    (tmp_path / 'table.md').unlink()
    run(python_m('grid', '--report-only', '--out', tmp_path))
    assert (tmp_path / 'table.md').read_text() == md
    assert (tmp_path / 'table.png').stat().st_size > 0


@pytest.mark.parametrize('argv, says', [
    (['--hosts', '1'], '--hosts [1]: at least 2 test hosts'),
    (['--ranks', '3'], '--ranks [3]: 1, or a multiple of 2'),
    (['--wires', 'fp8'], '--wires fp8: use some of none,fp16'),
    (['--best-options', 'partition_bytes=4M,credit=8M'], 'unknown option(s) credit'),
    (['--best-options', 'compression=fp16'], 'compression is set by --compression'),
])
def test_grid_names_bad_input(argv, says, capsys):
    """Bad input stops the grid before any test bed is built, saying what was wrong."""
    from benchmarks import grid
    with pytest.raises(SystemExit):
        grid.parse_args(['--models', SMALL_MODEL, '--rates', '3gbit', *argv])
    assert says in capsys.readouterr().err


def test_grid_refuses_a_grid_that_would_run_out_of_memory(capsys):
    """A job whose ranks would need more than the free memory stops the grid before any
    test bed is built, naming the cell and how many columns fit; fewer columns pass."""
    from benchmarks import gpu_like, grid
    size = sum(int(np.prod(p.shape)) * 4 for p in gpu_like.zoo_params('vgg16')
               if p.grad_req != 'null')
    argv = ['--models', 'vgg16', '--hosts', '4', '--rates', '10gbit', '--wires', 'none', '--no-p3']
    need_4 = 4 * size * (2 + 3 * 4)        # 4 hosts; compute alone, then 4 columns
    fake = type('Memory', (), {'available': need_4 - 1})   # 3 columns need 4 * 11 sizes
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(grid.psutil, 'virtual_memory', lambda: fake)
        with pytest.raises(SystemExit):
            grid.parse_args([*argv, '--columns', 'fifo,priority,autotuned,best'])
        err = capsys.readouterr().err
        assert f'cell vgg16_h4_10gbit: 4 columns in one job need about {need_4 / 2**30:.1f} GiB' in err
        assert 'run at most 3 columns a job' in err, err
        assert grid.parse_args([*argv, '--columns', 'fifo,autotuned,best']).columns
        assert grid.parse_args([*argv, '--columns', 'fifo,priority,autotuned,best',
                                '--ignore-memory']).ignore_memory


def test_grid_gives_its_jobs_the_job_timeout():
    """A job's own deadline follows --job-timeout (30 s inside it), so a job that the grid
    allows an hour is not ended by its script's 600 s default; a --timeout given in
    --job-args is passed on alone. --scaling's cells: 1 rank alone, 2 ranks over 2 hosts."""
    from benchmarks import grid
    base = ['--models', SMALL_MODEL, '--rates', '3gbit', '--hosts', '2', '--wires', 'none',
            '--no-p3', '--columns', 'fifo']
    for extra, want in (([], ['3570']), (['--job-timeout', '100'], ['70']),
                        (['--job-args', '--rounds 2 --timeout 42'], ['42']),
                        (['--job-args', '--rounds 2 --timeout=42'], [])):
        args = grid.parse_args(base + extra)
        (cell,) = grid.grid(args)
        ((name, argv, _),) = grid.launches(args, cell, 0, '/nonexistent')
        given = [argv[i + 1] for i, a in enumerate(argv) if a == '--timeout']
        assert name == 'ours' and given == want, (extra, argv)
    assert '--timeout=42' in argv      # the last case's, passed on as given
    args = grid.parse_args(['--scaling', '--ranks', '1,2', '--rates', '3gbit'])
    assert [(c.name, c.hosts, c.ppn, c.rate) for c in grid.grid(args)] == [
        ('n1', 1, 1, None), ('n2_ppn1_3gbit', 2, 1, '3gbit')]
    ((name, argv, _),) = grid.launches(args, grid.grid(args)[1], 0, '/nonexistent')
    assert argv[1:3] == ['-m', 'benchmarks.scaling'] and argv[argv.index('--models') + 1] == 'resnet18_v1'


def test_cost_model_predicts(tmp_path):
    """The prediction alone: fusion (mpi_kvstore.comm.fusion.plan) packs ResNet-50's arrays into
    fewer collectives than arrays, and no fusion sends one collective per array."""
    out = run(python_m('cost_model', '--predict-only', '--out', tmp_path))
    report = load(tmp_path / 'cost_model.json')
    rows, arrays = report['prediction']['rows'], len(report['prediction']['gradient_sizes'])
    assert rows['overlap, no fusion, flat']['collectives'] == arrays > 100
    assert 0 < rows['overlap, fusion, flat (funneled today)']['collectives'] < arrays
    for row in rows.values():
        assert positive(row['epoch_s']) and 0 < row['efficiency'] <= 1, row
    assert 'Headline (' in out


def test_cost_model_learns_overlap(tmp_path):
    """--overlap: h per schedule from overlap.py results, (T_c + T_x - step) / min(T_c, T_x),
    fitted on one file and checked on the other, then the prediction at scale with it."""
    def result(name, compute, columns):
        path = tmp_path / name
        path.write_text(json.dumps({
            'model': 'resnet50_v1', 'images_per_s': 125.0, 'config': {'topology': name},
            'compute_alone': {'median': compute},
            'columns': [{'column': c, 'step': {'median': s}, 'exchange': {'median': x}}
                        for c, s, x in columns] + [{'column': 'dist_sync', 'check': 'failed'}]}))
        return str(path)
    fit = result('fit.json', 0.26, [('fifo', 0.45, 0.30), ('priority', 0.36, 0.29)])
    check = result('check.json', 0.26, [('fifo', 0.50, 0.36), ('priority', 0.40, 0.35)])
    out = run(python_m('cost_model', '--overlap', f'{fit},{check}', '--fit-on', 'fit.json',
                       '--out', tmp_path))
    report = load(tmp_path / 'overlap_model.json')
    h = {'fifo': (0.26 + 0.30 - 0.45) / 0.26, 'priority': (0.26 + 0.29 - 0.36) / 0.26}
    assert report['fitted'] == pytest.approx(h)
    checked = {p['column']: p for p in report['points'] if not p['fitted']}
    for column, point in checked.items():
        model = 0.26 + point['exchange'] - h[column] * 0.26
        assert point['step_model'] == pytest.approx(model)
        assert point['step_error'] == pytest.approx(model / point['step'] - 1)
    predictions = report['predictions']
    assert set(predictions) == {'fifo', 'priority'}
    # the same cluster and model: more overlap, a shorter step
    assert predictions['priority']['step_ms'] < predictions['fifo']['step_ms']
    for row in predictions.values():
        expected = row['compute_ms'] + row['exchange_alone_ms'] - row['h'] * min(
            row['compute_ms'], row['exchange_alone_ms'])
        assert row['step_ms'] == pytest.approx(expected)
    assert 'Largest error on runs not fitted on' in out


# ---------------------------------------------------------------- a GPU

def _gpu_why_not():
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() > 0:
            return None
        return 'gpu_bandwidth needs a GPU: CuPy sees none'
    except Exception as exc:
        return f'gpu_bandwidth needs CuPy and a GPU ({type(exc).__name__}: {exc})'


GPU_WHY_NOT = _gpu_why_not()


@pytest.mark.skipif(GPU_WHY_NOT is not None, reason=str(GPU_WHY_NOT))
def test_gpu_bandwidth(mpi_available):
    out = mpirun(mpi_available, 'gpu_bandwidth', '--mb', 4, '--repeats', 3)
    assert re.search(r'^\| cupy D2D copy \| [\d.]+ \|', out, re.MULTILINE), out[-3000:]
