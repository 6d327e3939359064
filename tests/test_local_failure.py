"""A rank whose local step fails before the MPI call keeps the ranks paired
(scenarios/fault_local_failure.py), for every design that runs collectives
inside MXNet's engine, at 2 and 3 ranks (rank 1 fails).
"""
import pytest

from mpi_harness import run_mpi

from mpi_kvstore.designs import ENGINE_NAMES as ENGINE_DESIGNS


def _ok(output, design):
    assert 'fault_local_failure[%s]: OK' % design in output, output[-2000:]


@pytest.mark.parametrize('nprocs', [2, 3])
@pytest.mark.parametrize('design', ENGINE_DESIGNS)
def test_failed_fusion_sends_zeros_and_next_collective_pairs(design, nprocs):
    out = run_mpi(nprocs, 'fault_local_failure.py', design, 'fused-inplace', 'fused-out',
                  timeout=150)
    _ok(out, design)


@pytest.mark.parametrize('nprocs', [2, 3])
@pytest.mark.parametrize('design', ENGINE_DESIGNS)
def test_unreadable_array_skipped_everywhere_and_next_collective_pairs(design, nprocs):
    out = run_mpi(nprocs, 'fault_local_failure.py', design, 'single-inplace', 'single-out',
                  timeout=150)
    _ok(out, design)
