"""benchmarks/small.py runs briefly at 2 ranks, so that it does not rot: every method is checked
by the script (the sum over ranks, the trainers' weights equal across ranks) before it is
timed, and the JSON holds each method's trials with their spread and the ratio to the
reference of its case from the same run. Its driver of alternating jobs (--horovod-python)
runs here with this python in Horovod's place (horovod.mxnet does not import here), and its
table pools every job's trials. About 40 s on 2 cores.
"""
import json
import sys

from test_benchmarks import run

from benchmarks import harness, report, schema

from mpi_harness import run_mpi

NPROCS = 2
TIMEOUT = 180
SCRIPT = 'benchmarks/small.py'
ARGS = ['--sizes', '4K,64K', '--warmups', '1', '--trials', '3', '--burst-keys', '12',
        '--burst-size', '8K', '--layers', '2']
SINGLE = ['raw_mpi', 'pushpull', 'hvd']
BURST = ['raw_mpi', 'raw_mpi:fused', 'pushpull', 'hvd', 'hvd:grouped']
TRAINER = ['no_exchange', 'gluon', 'hvd']
STEP_BYTES = (64 * 64 + 64) * 4 // 2        # a Dense(64)'s two parameters, on average


def test_every_case_and_method_runs_and_is_reported(mpi_available, tmp_path):
    out = run_mpi(NPROCS, SCRIPT, *ARGS, '--no-horovod', '--label', 'smoke', '--out', tmp_path,
                  timeout=TIMEOUT)
    record = json.loads((tmp_path / ('small_n%d_smoke.json' % NPROCS)).read_text())
    assert record['benchmark'] == 'small' and record['nranks'] == NPROCS
    assert record['skipped'] == {'horovod': 'left out (--no-horovod)'}
    rows = record['results']
    assert [(r['case'], r['tensor_bytes'], r['method']) for r in rows] == (
        [('single', 4096, m) for m in SINGLE] + [('single', 65536, m) for m in SINGLE]
        + [('burst', 8192, m) for m in BURST] + [('trainer', STEP_BYTES, m) for m in TRAINER])
    for row in rows:
        keys = {'single': 1, 'burst': 12, 'trainer': 4}[row['case']]
        assert row['keys'] == keys and row['bytes'] == keys * row['tensor_bytes'], row
        assert len(row['trials_us']) == 3 and all(t > 0 for t in row['trials_us']), row
        assert row['min_us'] <= row['latency_us'] <= row['max_us'], row
        reference = next(r for r in rows if r['case'] == row['case']
                         and r['tensor_bytes'] == row['tensor_bytes']
                         and r['method'] == row['reference'])
        assert abs(row['vs_reference'] - row['latency_us'] / reference['latency_us']) < 1e-9
    assert {r['case']: r['reference'] for r in rows} == {
        'single': 'raw_mpi', 'burst': 'raw_mpi:fused', 'trainer': 'no_exchange'}
    assert 'median (min-max) us' in out and 'hvd:grouped' in out


def test_alternating_jobs_pool_into_one_table(mpi_available, tmp_path):
    """One pair of jobs, the store's then the other python's (--horovod-only: raw MPI and the
    step's reference): the table has a row per case, each cell every trial of both jobs."""
    argv = [sys.executable, '-m', 'benchmarks.small', *ARGS, '--horovod-python', sys.executable,
            '--jobs', '1', '-n', NPROCS, '--label', 'alt', '--out', tmp_path]
    run(argv, timeout=2 * TIMEOUT)
    store, other = (json.loads((tmp_path / f'small_n{NPROCS}_alt{side}0.json').read_text())
                    for side in ('store', 'horovod'))
    assert [r['method'] for r in other['results']] == ['raw_mpi'] * 2 + [
        'raw_mpi', 'raw_mpi:fused', 'no_exchange']
    assert other['skipped']['horovod'].startswith('horovod.mxnet does not import')
    table = json.loads((tmp_path / 'small.json').read_text())
    assert schema.check(table) == 'table' and table['table'] == 'small'
    assert (tmp_path / 'small.md').read_text() == report.table_markdown(table)
    assert table['columns'] == ['raw MPI', 'kv.pushpull', 'mpi_kvstore.horovod', 'horovod.mxnet']
    assert [r['label'] for r in table['rows']] == [
        'single, 4KB', 'single, 64KB', 'burst, 8KB x 12', 'train step, 2 x Dense(64), batch 8']

    def trials(case, nbytes, method, records):
        return [t for rec in records for r in rec['results'] if (r['case'], r['tensor_bytes'],
                r['method']) == (case, nbytes, method) for t in r['trials_us']]
    for row, (case, nbytes, ref, kv) in zip(table['rows'], [
            ('single', 4096, 'raw_mpi', 'pushpull'), ('single', 65536, 'raw_mpi', 'pushpull'),
            ('burst', 8192, 'raw_mpi:fused', 'pushpull'), ('trainer', STEP_BYTES, 'no_exchange', 'gluon')]):
        cells = row['cells']
        assert cells['raw MPI'] == harness.spread(trials(case, nbytes, ref, [store, other]))
        assert len(trials(case, nbytes, ref, [store, other])) == 6
        assert cells['kv.pushpull'] == harness.spread(trials(case, nbytes, kv, [store]))
        assert cells['mpi_kvstore.horovod'] == harness.spread(trials(case, nbytes, 'hvd', [store]))
        assert cells['horovod.mxnet'] is None
