"""The sharded optimizer (shard_optimizer, issue 22) under mpiexec: 20 gluon steps with SGD +
momentum, Adam and LAMB, and float16 multi_precision pushpulls (SGD, LAMB), equal an unsharded store and one
process (numpy for float16) with 1/N of the optimizer state on each rank; the fp16 and bf16
wire casts reduce-scatter with compress-once's sums (numpy); states saved
sharded at 2 ranks resume at 3 and 4, sharded and unsharded; the collectives cut in
priority pieces (partition_bytes) give the same weights; Module and gluon's own
scenarios with MPI_KVSTORE_SHARD_OPTIMIZER=1; bad input and join. Scenarios:
scenarios/kv_sharded.py, kv_module.py, kv_gluon.py.
"""
import pytest

from mpi_harness import run_designs, run_mpi

SHARDED = {'MPI_KVSTORE_SHARD_OPTIMIZER': '1'}


def _ok(out, name, nprocs):
    assert '%s: OK at %d ranks' % (name, nprocs) in out, out[-3000:]


@pytest.mark.parametrize('design,nprocs', [('funneled', 2), ('funneled', 3), ('funneled', 4),
                                           ('chained', 3), ('concurrent', 3),
                                           ('blocking', 3)])
def test_sharded_training_equals_unsharded_and_one_process(design, nprocs, designs):
    _ok(run_designs(nprocs, 'kv_sharded.py', design, designs, 'train', timeout=240),
        'kv_sharded[%s] train' % design, nprocs)


def test_states_saved_sharded_resume_at_other_sizes_sharded_and_not(tmp_path, mpi_available):
    _ok(run_mpi(2, 'kv_sharded.py', 'funneled', 'save', str(tmp_path), timeout=180),
        'kv_sharded[funneled] save', 2)
    _ok(run_mpi(3, 'kv_sharded.py', 'chained', 'load', str(tmp_path), timeout=180),
        'kv_sharded[chained] load', 3)
    _ok(run_mpi(4, 'kv_sharded.py', 'concurrent', 'load', str(tmp_path), timeout=180),
        'kv_sharded[concurrent] load', 4)


@pytest.mark.parametrize('design', ['funneled', 'chained'])
def test_module_fit_sharded_equals_one_process(design, designs):
    _ok(run_designs(3, 'kv_module.py', design, designs, '1', timeout=180, env=SHARDED),
        'kv_module[%s, MXNET_UPDATE_ON_KVSTORE=1]' % design, 3)


def test_gluon_scenario_sharded_equals_one_process(mpi_available):
    _ok(run_mpi(3, 'kv_gluon.py', 'concurrent', timeout=180, env=SHARDED),
        'kv_gluon[concurrent]', 3)


@pytest.mark.parametrize('design,nprocs', [('funneled', 2), ('chained', 3)])
def test_global_norm_clipping_in_the_store_equals_one_process(design, nprocs, mpi_available):
    _ok(run_mpi(nprocs, 'kv_sharded.py', design, 'clip', timeout=240),
        'kv_sharded[%s] clip' % design, nprocs)


def test_module_fit_clipped_in_the_store_equals_one_process(mpi_available):
    _ok(run_mpi(3, 'kv_module.py', 'funneled', '1', 'clip', timeout=180, env=SHARDED),
        'kv_module[funneled, MXNET_UPDATE_ON_KVSTORE=1, clipped]', 3)


@pytest.mark.parametrize('design', ['funneled', 'chained'])
def test_bad_input_is_refused_and_the_store_goes_on(design, designs, batch_dir):
    _ok(run_designs(2, 'kv_sharded.py', design, designs, 'errors', batch_dir, timeout=120),
        'kv_sharded[%s] errors' % design, 2)


@pytest.mark.parametrize('design', ['funneled', 'chained', 'concurrent', 'blocking'])
def test_a_joined_rank_goes_on_updating_its_shares(design, designs, batch_dir):
    _ok(run_designs(3, 'kv_sharded.py', design, designs, 'join', batch_dir, timeout=180),
        'kv_sharded[%s] join' % design, 3)


@pytest.mark.parametrize('design,nprocs', [('funneled', 3), ('chained', 2)])
def test_compressed_reduce_scatter_is_compress_once(design, nprocs, mpi_available):
    _ok(run_mpi(nprocs, 'kv_sharded.py', design, 'compressed', timeout=240),
        'kv_sharded[%s] compressed' % design, nprocs)


@pytest.mark.parametrize('design,nprocs', [('funneled', 3), ('concurrent', 4),
                                           ('funneled', 2)])
def test_partitioned_sharded_exchange_equals_whole_shares(design, nprocs, mpi_available):
    _ok(run_mpi(nprocs, 'kv_sharded.py', design, 'partitioned', timeout=240),
        'kv_sharded[%s] partitioned' % design, nprocs)


def test_lossy_allgather_benchmark_runs():
    """benchmarks.lossy_allgather (docs/sharded-optimizer.md's figures), briefly: it prints
    a loss and an accuracy for each rounding, and exact and fp16 stay close."""
    import re
    import subprocess
    import sys

    from mpi_harness import REPO_ROOT
    out = subprocess.run([sys.executable, '-m', 'benchmarks.lossy_allgather', '--steps', '30',
                          '--seeds', '1'], cwd=REPO_ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = dict(re.findall(r'^(\w+)\s+loss \(last 20 steps\) ([0-9.]+)', out.stdout, re.M))
    assert set(rows) == {'exact', 'fp16', 'bf16'}, out.stdout
    assert abs(float(rows['fp16']) - float(rows['exact'])) < 0.05, out.stdout
