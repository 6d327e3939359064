"""GPU transports on CuPy arrays (tests/scenarios/gpu_transport.py), without MXNet.

Skipped where no GPU exists, unless MPI_KVSTORE_EXPECT_GPU=1 says one must be there: then a
missing GPU fails. The lent GPU machines have one GPU, so 2 and 4 ranks share it: NCCL
(2.28) refuses that, and the test expects the refusal on every rank, not a hang.
"""
import os

import pytest

from mpi_harness import run_mpi


def _gpus():
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # no cupy, no driver, no device
        return 0


def _require_gpu():
    if _gpus() > 0:
        return
    if os.environ.get('MPI_KVSTORE_EXPECT_GPU') == '1':
        pytest.fail('MPI_KVSTORE_EXPECT_GPU=1 but CuPy sees no GPU')
    pytest.skip('no GPU (CuPy with a device) on this machine')


def _run(nprocs, transport, expect, *more, env=None):
    out = run_mpi(nprocs, 'gpu_transport.py', transport, expect, *more, timeout=300, env=env)
    assert 'gpu_transport[%s' % transport in out and 'OK at %d ranks' % nprocs in out, out[-3000:]
    return out


@pytest.mark.parametrize('nprocs', [1, 2, 4])
def test_staged_mpi(nprocs):
    _require_gpu()
    out = _run(nprocs, 'staged', 'staged')
    if nprocs > 1:
        assert 'transport staged ran' in out


def test_staged_mpi_with_per_thread_default_streams():
    """CuPy's per-thread default stream: work queued on it is not ordered with the legacy
    stream, so a bucket that completes before its stream is done is read stale."""
    _require_gpu()
    _run(2, 'staged', 'staged', env={'CUPY_CUDA_PER_THREAD_DEFAULT_STREAM': '1'})


def test_nccl_one_rank():
    _require_gpu()
    _run(1, 'nccl', 'nccl')


def test_nccl_two_ranks():
    """Two ranks on two GPUs run NCCL; on one GPU both refuse it together."""
    _require_gpu()
    expect = 'nccl' if _gpus() >= 2 else 'refused'
    out = _run(2, 'nccl', expect)
    if expect == 'refused':
        assert 'refused on every rank' in out


@pytest.mark.parametrize('nprocs', [1, 2])
def test_auto_picks_nccl_unless_ranks_share_a_gpu(nprocs):
    _require_gpu()
    _run(nprocs, 'auto', 'nccl' if nprocs == 1 or _gpus() >= 2 else 'staged')


@pytest.mark.parametrize('nprocs', [1, 2, 4])
def test_compression_on_device_matches_the_host_bit_for_bit(nprocs):
    _require_gpu()
    out = run_mpi(nprocs, 'gpu_compression.py', timeout=300)
    assert 'gpu_compression: OK at %d ranks' % nprocs in out, out[-3000:]


def test_a_tune_table_mixes_transports_by_size():
    """Device rows send small buffers through NCCL and large ones through staged MPI. Two
    ranks on two GPUs run both; on one GPU NCCL cannot run, and every rank gives its sizes
    to staged alike."""
    _require_gpu()
    out = _run(2, 'auto', 'nccl+staged' if _gpus() >= 2 else 'staged', 'mixed')
    assert 'transport staged ran' in out



@pytest.mark.parametrize('nprocs', [1, 2, 3])
def test_compressed_reduce_scatter_on_device_equals_numpy_and_the_host(nprocs):
    """fp16/bf16 shares of device buckets (tests/scenarios/gpu_compressed_shares.py): cast,
    summed and decoded on the GPU, only 16-bit values through staged MPI's all-to-all; each
    share bit for bit numpy's and the host path's. 3 ranks: uneven shares."""
    _require_gpu()
    out = run_mpi(nprocs, 'gpu_compressed_shares.py', 'staged', timeout=300)
    assert 'through staged' in out, out[-3000:]
    assert 'gpu_compressed_shares[staged]: OK at %d ranks' % nprocs in out, out[-3000:]


def test_compressed_reduce_scatter_through_nccl():
    """The same through NCCL's send and receive: two ranks on two GPUs, else one rank
    (NCCL refuses two ranks on one GPU), whose all-to-all goes to itself."""
    _require_gpu()
    nprocs = 2 if _gpus() >= 2 else 1
    out = run_mpi(nprocs, 'gpu_compressed_shares.py', 'nccl', timeout=300)
    assert 'through nccl' in out, out[-3000:]
    assert 'gpu_compressed_shares[nccl]: OK at %d ranks' % nprocs in out, out[-3000:]


@pytest.mark.parametrize('nprocs', [1, 2])
def test_device_rows_for_every_collective(nprocs):
    """tests/scenarios/gpu_tune_ops.py. At 1 rank: tune writes device rows for broadcast,
    allgather, reducescatter and alltoall from the transports it timed (nccl and staged),
    then a table's rows send small buffers of each op through NCCL and large ones through
    staged, each result numpy's. At 2 ranks the store's path (a broadcast from rank 1):
    on one GPU NCCL's rows give way to staged on every rank, with a warning."""
    _require_gpu()
    both = nprocs == 1 or _gpus() >= 2
    expect = 'nccl+staged' if both else 'staged'
    out = run_mpi(nprocs, 'gpu_tune_ops.py', expect, *(['tune'] if nprocs == 1 else []),
                  timeout=300)
    assert 'gpu_tune_ops[%s]: OK at %d ranks' % (expect, nprocs) in out, out[-3000:]
    assert 'transport staged ran' in out, out[-3000:]
    if nprocs == 1:
        assert 'tune: device rows for broadcast, allgather, reducescatter, alltoall' in out, \
            out[-3000:]
    if not both:
        assert 'sends some sizes through nccl, which cannot run here' in out, out[-3000:]
