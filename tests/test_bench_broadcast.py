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


def test_unknown_method_and_params_without_table_are_refused(capsys):
    """In this process (one rank): no job to launch for an argument error."""
    import pytest

    from benchmarks import broadcast as bench
    from mpi_kvstore.comm.broadcast import Hierarchical
    args = bench.parse_args(['--quick', '--methods', 'flat,teleport'])
    with pytest.raises(SystemExit, match=r"unknown method\(s\) \['teleport'\]"):
        bench.methods(bench.COMM, Hierarchical(bench.COMM), args)
    with pytest.raises(SystemExit):
        bench.parse_args(['--params', 'vgg16'])
    assert '--params vgg16 needs --table' in capsys.readouterr().err


def test_broadcast_parameters_before_and_after_a_table(mpi_available, tmp_path):
    """--params: broadcast_parameters on a store without a table and one whose rows send the
    larger tensors as chains (the script checks every parameter against the root's value
    before timing, and fails the job otherwise); both rows report their trials."""
    table = tmp_path / 'table.json'
    table.write_text(json.dumps({
        'version': 1, 'comm_size': NPROCS, 'allreduce': [{'bytes': 4, 'algorithm': 'mpi'}],
        'ops': {'broadcast': [{'bytes': 4, 'algorithm': 'flat'},
                              {'bytes': 147456, 'algorithm': 'chain', 'chunk_bytes': 8192}]}}))
    out = run_mpi(NPROCS, SCRIPT, '--params', 'tiny', '--table', table, '--root', '1',
                  '--warmups', '1', '--trials', '3', '--label', 'params', '--out', tmp_path,
                  timeout=TIMEOUT)
    record = json.loads((tmp_path / ('broadcast_n%d_params.json' % NPROCS)).read_text())
    assert record['config']['model'] == 'tiny' and record['config']['tensors'] == 4
    rows = {r['method']: r for r in record['results']}
    assert sorted(rows) == ['after', 'before'], out[-2000:]
    assert rows['before']['size'] == 4 * (15 + 7 + 33000 + 36864)
    for row in rows.values():
        assert len(row['times_s']) == 3 and row['min_s'] <= row['median_s'] <= row['max_s']
    assert abs(rows['after']['vs_flat'] - rows['after']['median_s'] / rows['before']['median_s']) < 1e-12
