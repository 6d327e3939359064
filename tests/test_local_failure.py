"""A rank whose local step fails before the MPI call keeps the ranks paired
(scenarios/fault_local_failure.py), for every design that runs collectives
inside MXNet's engine, at 2 and 3 ranks (rank 1 fails).
"""
import pytest

from mpi_kvstore.designs import ENGINE_NAMES as ENGINE_DESIGNS

from mpi_harness import run_designs


def _ok(output, design):
    assert 'fault_local_failure[%s]: OK' % design in output, output[-2000:]


# fused: a failed fusion sends zeros; single: an unreadable array is skipped everywhere.
# Either way the next collective pairs.
@pytest.mark.parametrize('cases', [('fused-inplace', 'fused-out'),
                                   ('single-inplace', 'single-out')], ids=['fused', 'single'])
@pytest.mark.parametrize('nprocs', [2, 3])
@pytest.mark.parametrize('design', ENGINE_DESIGNS)
def test_local_failure_keeps_ranks_paired(design, nprocs, cases, designs):
    _ok(run_designs(nprocs, 'fault_local_failure.py', design, designs, *cases, timeout=150),
        design)
