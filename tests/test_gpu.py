"""GPU transports on CuPy arrays (tests/scenarios/gpu_transport.py), without MXNet.

Skipped where no GPU exists, unless MPI_KVSTORE_EXPECT_GPU=1 says one must be there: then a
missing GPU fails. The lent GPU machines have one GPU, so 2 and 4 ranks share it: NCCL
(2.28) refuses that, and the test expects the refusal on every rank, not a hang.
"""
import os

import numpy as np
import pytest

from mpi_harness import result, run_mpi

DTYPES = ('float16', 'float32', 'float64', 'int32', 'int64', 'uint8')   # gpu_transport's


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


def _sum(n, scale, nprocs, average=False, dtype='float64'):
    """numpy's sum of the sum over ranks gpu_transport reduces: rank r's array j holds
    (r + 1) * scale + j mod 3 (averaged: divided by the ranks, whole for integers)."""
    total = np.arange(n) % 3 * nprocs + scale * nprocs * (nprocs + 1) // 2
    if average:
        total = total / nprocs if np.dtype(dtype).kind == 'f' else total // nprocs
    return float(total.sum())


def _run(nprocs, transport, expect, *more, env=None):
    """gpu_transport's report at every rank: refused with ConfigError, or every fused
    allreduce of the six dtypes, the 64 MB one and the last rank's broadcasts equal to numpy
    (shape and sum), each check equal to what the scenario expected, and the transports that
    ran exactly EXPECT's ('a+b'), host MPI calls only where a staged or CUDA-aware MPI ran."""
    out = run_mpi(nprocs, 'gpu_transport.py', transport, expect, *more, timeout=300, env=env)
    refused = expect == 'refused'
    _check_transport(result(out, 'gpu_transport[%s]' % transport if refused else
                            'gpu_transport[%s->%s]' % (transport, expect))['ranks'], nprocs, expect)
    return out


def _check_transport(ranks, nprocs, expect):
    refused = expect == 'refused'
    assert len(ranks) == nprocs
    for index, rank in enumerate(ranks):
        if refused:
            assert rank['raised'] == ['ConfigError'] and rank['chosen'] is None, rank
            continue
        checked = rank['checked']
        assert set(checked) == set(rank['expected'])
        for what, (shape, total) in checked.items():
            assert shape == rank['expected'][what][0], what
            assert total == pytest.approx(rank['expected'][what][1], rel=1e-5), what
        for dtype in DTYPES:
            for average in (False, True):
                for i in range(12):
                    n = 1000 + 37 * i
                    assert checked['%s allreduce (average=%s) of array %d' % (dtype, average, i)] \
                        == [[n], pytest.approx(_sum(n, i + 1, nprocs, average, dtype))]
            root = nprocs - 1
            values = (np.arange(5000) % 3 + (root + 1) * (10 + root)).astype(dtype)
            assert checked['%s broadcast from rank %d' % (dtype, root)] == [
                [5000], pytest.approx(float(values.astype(np.float64).sum()))]
        large = np.arange(0, 16 << 20, 4099)
        assert checked['a 64 MB allreduce'] == [
            [large.size], pytest.approx(float((large % 3 * nprocs + nprocs * (nprocs + 1) // 2).sum()))]
        ran = set(expect.split('+'))
        if nprocs == 1:     # the store reduces nothing; the transport ran directly
            assert checked['%s at one rank' % expect] == [[3000], _sum(3000, 3, 1)]
            continue
        assert rank['chosen'] in ran and set(rank['ran']) == ran, rank['ran']
        assert all(count > 0 for count in rank['ran'].values()), rank['ran']
        assert (rank['mpi_calls'] > 0) == bool(ran & {'staged', 'cuda_mpi'}), rank['mpi_calls']
        # check_local_failures: rank 1's fusion fails (its bucket's requests), rank 0 cannot
        # read one array; every other rank's requests all succeed
        want_failed = {0: {'unreadable'}, 1: {'fail0', 'fail1', 'fail2'}}.get(index, set())
        assert set(rank['failed']) <= want_failed and bool(rank['failed']) == bool(want_failed)


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
    ranks = result(out, 'gpu_compression')['ranks']
    assert len(ranks) == nprocs
    steps = ['2bit (two_phase_min_ranks=%d) step %d' % (phases, step)
             for phases in (32, 2) for step in range(4)]
    names = ['%s of %s' % (kind, dtype) for kind in ('fp16', 'bf16', 'fp16-ring', 'bf16-ring')
             for dtype in ('float32', 'float64')] + steps + [
        '%s residual %d' % (step, i) for step in steps for i in range(5)]
    for rank in ranks:
        # every array the GPU path made: bit for bit the host path's, so the same shape and sum
        assert rank['checked'] == rank['expected']
        assert set(rank['checked']) == {'%s, array %d' % (name, i) for name in names
                                        for i in range(5 if ' residual ' not in name else 1)}
        assert [shape for shape, _ in (rank['checked']['fp16 of float32, array %d' % i]
                                       for i in range(5))] == [[1], [7], [1000], [4099], [33]]
        kernels = {'quantize_pack', 'count_sum'} | ({'encode16', 'decode16'} if nprocs > 1 else set())
        assert kernels <= set(rank['device_calls']), rank['device_calls']


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
