"""benchmarks/small.py runs briefly at 2 ranks, so that it does not rot: every method is checked
by the script (the sum over ranks) before it is timed, and the JSON holds each method's trials
with their spread and the ratio to the reference of its case from the same run. About 15 s on
2 cores.
"""
import json

from mpi_harness import run_mpi

NPROCS = 2
TIMEOUT = 180
SCRIPT = 'benchmarks/small.py'


def test_every_case_and_method_runs_and_is_reported(mpi_available, tmp_path):
    args = ['--sizes', '4K,64K', '--warmups', '1', '--trials', '3', '--burst-keys', '12',
            '--burst-size', '8K', '--no-horovod', '--label', 'smoke', '--out', tmp_path]
    out = run_mpi(NPROCS, SCRIPT, *args, timeout=TIMEOUT)
    record = json.loads((tmp_path / ('small_n%d_smoke.json' % NPROCS)).read_text())
    assert record['benchmark'] == 'small' and record['nranks'] == NPROCS
    assert record['skipped'] == {'horovod': 'left out (--no-horovod)'}
    rows = record['results']
    single = ['raw_mpi', 'pushpull', 'hvd']
    burst = ['raw_mpi', 'raw_mpi:fused', 'pushpull', 'hvd', 'hvd:grouped']
    assert [(r['case'], r['tensor_bytes'], r['method']) for r in rows] == (
        [('single', 4096, m) for m in single] + [('single', 65536, m) for m in single]
        + [('burst', 8192, m) for m in burst])
    for row in rows:
        keys = 12 if row['case'] == 'burst' else 1
        assert row['keys'] == keys and row['bytes'] == keys * row['tensor_bytes'], row
        assert len(row['trials_us']) == 3 and all(t > 0 for t in row['trials_us']), row
        assert row['min_us'] <= row['latency_us'] <= row['max_us'], row
        reference = next(r for r in rows if r['case'] == row['case']
                         and r['tensor_bytes'] == row['tensor_bytes']
                         and r['method'] == row['reference'])
        assert abs(row['vs_reference'] - row['latency_us'] / reference['latency_us']) < 1e-9
    assert row['reference'] == 'raw_mpi:fused'
    assert 'median (min-max) us' in out and 'hvd:grouped' in out
