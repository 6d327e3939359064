"""benchmarks/sharded.py (issue 22's side by side) runs briefly at 2 ranks, so that it does not
rot: every configuration trains, passes the weight checks, and the sharded stores hold half
the unsharded store's optimizer state. 2-bit is checked against its own 2-bit reference
(float32 tolerance) and is far from unsharded's weights, so that check tells it apart.
mobilenet0.25 (gpu_like's smallest model, 1.9 MB of gradients): a job takes seconds on 2
cores, most of it imports. Three jobs in all: two --rss-only jobs, then the side by side
that reads their files.
"""
import json
import re
import shlex

from mpi_harness import run_mpi

NPROCS = 2
TIMEOUT = 240
SCRIPT = 'benchmarks/sharded.py'
SMALL = ['--model', 'mobilenet0.25', '--warmups', '1', '--rounds', '2', '--chain', '2']
RECORD = f'sharded_n{NPROCS}_mobilenet0.25_adam_h1.json'


def check_rerun_command(command, nprocs, module, args):
    """COMMAND (a record's 'command') reruns the job: NPROCS ranks of ``python -m MODULE``
    with exactly ARGS; which launcher or interpreter it names does not matter."""
    words = shlex.split(command)
    flag = next((w for w in words if w in ('-n', '-np')), None)
    assert flag and words[words.index(flag) + 1] == str(nprocs), command
    assert '-m' in words and words[words.index('-m') + 1] == module, command
    assert words[words.index('-m') + 2:] == [str(arg) for arg in args], command


def rss_only(name, tmp_path):
    """One --rss-only job: its file, checked."""
    path = tmp_path / f'rss_{name}.json'
    out = run_mpi(NPROCS, SCRIPT, *SMALL, '--rss-only', name, '--rss-json', path,
                  '--out', tmp_path, timeout=TIMEOUT)
    assert f'{name} alone: RSS' in out and 'weights ok' in out, out[-3000:]
    rss = json.loads(path.read_text())['rss']
    assert rss['config'] == name and rss['check'] == 'ok'
    assert len(rss['per_rank']) == NPROCS
    assert 0 < rss['model_rss_MB'] < rss['rss_MB'] <= rss['hwm_MB'], rss
    return str(path)


def test_side_by_side_reads_rss_only_jobs(mpi_available, tmp_path):
    """--rss-only writes one configuration's RSS; the side by side of every configuration
    (--rss-files) puts them in its table."""
    files = [rss_only(name, tmp_path) for name in ('unsharded', 'sharded')]
    args = [*SMALL, '--configs',
            'unsharded,sharded,sharded+bf16,unsharded+whole,sharded+whole,sharded+2bit',
            '--rss-files', ','.join(files), '--out', tmp_path]
    out = run_mpi(NPROCS, SCRIPT, *args, timeout=TIMEOUT)
    assert 'weights check: ok' in out, out[-3000:]
    record = json.loads((tmp_path / RECORD).read_text())
    assert record['benchmark'] == 'sharded' and record['nranks'] == NPROCS
    assert record['config']['interleaved'] is True
    assert record['config']['argv'][1:] == [str(arg) for arg in args], record['config']['argv']
    check_rerun_command(record['config']['command'], NPROCS, 'benchmarks.sharded', args)
    assert record['versions']['mxnet'] and record['versions']['mpi_kvstore']
    assert record['check'] == 'ok'
    rows = {row['config']: row for row in record['rows']}
    assert list(rows) == ['unsharded', 'sharded', 'sharded+bf16', 'unsharded+whole',
                          'sharded+whole', 'sharded+2bit']
    assert rows['unsharded+whole']['check'] == 'ok'
    assert rows['unsharded+whole']['state_bytes'] == rows['unsharded']['state_bytes']
    whole = rows['unsharded']['state_bytes']
    grads = record['grad_bytes']
    # Adam: two float32 arrays a weight.
    assert whole == 2 * grads
    for name in ('sharded', 'sharded+bf16', 'sharded+whole', 'sharded+2bit'):
        row = rows[name]
        assert row['check'] == 'ok' and row['state_share_check'] == 'ok', row
        # Half, within each key's rounding: a share is at most one element away from
        # count / N, for each of Adam's two float32 arrays.
        for held in row['state_bytes_per_rank']:
            assert abs(held - whole / NPROCS) <= record['keys'] * 2 * 4, row
        assert sum(row['state_bytes_per_rank']) == whole, row
        if name != 'sharded+2bit':
            assert row['max_abs_vs_unsharded'] <= 1e-2, row
    assert rows['sharded']['max_abs_vs_unsharded'] <= 1e-5
    # 2-bit's weights passed a float32-tolerance check against its 2-bit reference, and are
    # far from exact training's: the reference models the quantisation, not exact gradients.
    assert rows['sharded+2bit']['max_abs_vs_unsharded'] > 1e-2, rows['sharded+2bit']
    assert rows['sharded+2bit']['options'] == {'shard_optimizer': True, '2bit': 0.5}
    # Ring model: allreduce 2(N-1)/N G; sharded the same; bf16 halves the reduce-scatter.
    assert rows['unsharded']['wire_bytes'] == rows['sharded']['wire_bytes'] == grads
    assert rows['sharded+bf16']['wire_bytes'] == 0.75 * grads
    assert rows['sharded+2bit']['wire_bytes'] == (0.5 + 0.5 / 16) * grads
    for row in rows.values():
        assert len(row['step_s']) == 2 and all(t > 0 for t in row['step_s']), row
        assert row['step']['min'] <= row['step']['median'] <= row['step']['max']
        if row['config'] in ('unsharded', 'sharded'):
            assert row['rss']['rss_MB'] > 0 and row['rss']['file'] in files, row
        else:
            assert row['rss'] is None, row
    assert re.search(r'^\| sharded\+bf16 \| [\d.]+ \([\d.]+-[\d.]+\) \|', out, re.MULTILINE), out
    assert 'state per rank sharded / unsharded: 0.5' in out
    assert re.search(r'RSS per rank fell by -?[\d.]+ MB against [\d.]+ MB of state freed', out), out


def test_two_bit_reference_is_the_store_kernel():
    """sharded.py's 2-bit reference (two_bit_send, one element at a time) sends what the
    store's quantize_pack sends and keeps the residual it keeps, over steps with error
    feedback."""
    import numpy as np

    from benchmarks.sharded import two_bit_send
    from mpi_kvstore.compression.kernels import DELTAS, quantize_pack
    rng = np.random.RandomState(0)
    threshold = np.float32(0.5)
    residual = np.zeros(37, np.float32)
    mine = [np.float32(0)] * residual.size
    for _ in range(10):
        grad = rng.normal(0, 0.4, residual.size).astype(np.float32)
        codes = np.empty(-(-grad.size // 4), np.uint8)
        quantize_pack(grad, residual, threshold, codes)
        sent = DELTAS[codes].reshape(-1)[:grad.size] * threshold
        expected = []
        for i, g in enumerate(grad):
            value, mine[i] = two_bit_send(mine[i], g, threshold)
            expected.append(value)
        assert np.array_equal(sent, np.array(expected, np.float32))
        assert np.array_equal(residual, np.array(mine, np.float32))
    assert np.any(sent != 0) and np.any(sent == 0)
