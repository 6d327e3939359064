"""GPU communication path, on CuPy arrays. Skipped where no GPU exists, unless
MPI_KVSTORE_EXPECT_GPU=1 says one must be there: then a missing GPU fails."""
import os

import pytest

from mpi_harness import run_mpi


def _gpu_available():
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no cupy, no driver, no device
        return False


def _require_gpu():
    if _gpu_available():
        return
    if os.environ.get('MPI_KVSTORE_EXPECT_GPU') == '1':
        pytest.fail('MPI_KVSTORE_EXPECT_GPU=1 but CuPy sees no GPU')
    pytest.skip('no GPU (CuPy with a device) on this machine')


@pytest.mark.parametrize('nprocs', [1, 2])
def test_cupy_allreduce_and_broadcast(nprocs):
    _require_gpu()
    out = run_mpi(nprocs, 'gpu_comm.py', timeout=240)
    assert 'gpu_comm: OK' in out, out[-2000:]
