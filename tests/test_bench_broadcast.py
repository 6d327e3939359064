"""benchmarks/broadcast.py (issue 33) runs briefly at 2 ranks, so that it does not rot: every
method delivers the root's bytes (the script checks each before timing it and fails the job
otherwise), and the JSON holds each method's trials with their spread and the ratio to flat
from the same run. Root 1 and "hosts" of one rank split from COMM_WORLD, so that the
hierarchical method is active. About 10 s on 2 cores.
"""
import json

from mpi_harness import run_mpi

NPROCS = 2
TIMEOUT = 180
SCRIPT = 'benchmarks/broadcast.py'
SIZES = ['4K', '100K']
CHUNKS = ['4K', '32K']


def test_every_method_runs_and_is_reported(mpi_available, tmp_path):
    args = ['--sizes', ','.join(SIZES), '--chunks', ','.join(CHUNKS), '--warmups', '1',
            '--trials', '3', '--root', '1', '--ranks-per-host', '1', '--label', 'smoke',
            '--out', tmp_path]
    out = run_mpi(NPROCS, SCRIPT, *args, timeout=TIMEOUT)
    assert 'hosts of 1 split from COMM_WORLD' in out, out[-3000:]
    record = json.loads((tmp_path / ('broadcast_n%d_smoke.json' % NPROCS)).read_text())
    assert record['benchmark'] == 'broadcast' and record['nranks'] == NPROCS
    assert record['config']['hierarchy_active'] is True
    assert record['config']['root'] == 1
    methods = ['flat', 'hier'] + ['%s:%sB' % (m, c) for c in CHUNKS
                                  for m in ('pipelined', 'chain', 'hier', 'hier-ibcast')]
    rows = record['results']
    assert [r['size'] for r in rows] == [4096] * len(methods) + [102400] * len(methods)
    for size in (4096, 102400):
        mine = {r['method']: r for r in rows if r['size'] == size}
        assert sorted(mine) == sorted(methods), sorted(mine)
        assert mine['flat']['vs_flat'] == 1.0
        for row in mine.values():
            assert len(row['times_s']) == 3 and all(t > 0 for t in row['times_s']), row
            assert row['min_s'] <= row['median_s'] <= row['max_s']
            assert abs(row['vs_flat'] - row['median_s'] / mine['flat']['median_s']) < 1e-12
            assert abs(row['algbw_GBps'] - size / row['median_s'] / 1e9) < 1e-9
    assert 'fastest per size' in out


def test_unknown_method_is_refused(mpi_available, tmp_path):
    from mpi_harness import MPIRunError
    try:
        out = run_mpi(NPROCS, SCRIPT, '--quick', '--methods', 'flat,teleport', '--out', tmp_path,
                      timeout=TIMEOUT)
    except MPIRunError as err:
        out = err.output
    else:
        raise AssertionError('an unknown method ran:\n' + out[-2000:])
    assert "unknown method(s) ['teleport']" in out, out[-2000:]
