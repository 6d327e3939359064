"""A rank whose local step fails before the MPI call keeps the ranks paired
(scenarios/fault_local_failure.py), for every design that runs collectives
inside MXNet's engine, at 2 and 3 ranks (rank 1 fails).
"""
import numpy as np
import pytest

from mpi_kvstore.designs import ENGINE_NAMES as ENGINE_DESIGNS

from mpi_harness import result, run_joint


def _checked(output, design, nprocs):
    """Each rank's report of the scenario after its OK (scenarios/common.done): 'errors', by
    case, what its kv.wait() raised after the failed collective; 'checked', {what: [shape,
    sum]} of the outputs it compared."""
    name = 'fault_local_failure[%s]' % design
    assert '%s: OK' % name in output, output[-2000:]
    ranks = result(output, name)['ranks']
    assert len(ranks) == nprocs
    return ranks


CASES = [('fused-inplace', 'fused-out'), ('single-inplace', 'single-out')]
# both groups of cases at a size in one job (mpi_harness.run_joint): the ranks' start-up
# costs more than the scenario
JOINT = tuple(('fault_local_failure.py', cases, ENGINE_DESIGNS, (2, 3)) for cases in CASES)


# fused: a failed fusion sends zeros; single: an unreadable array is skipped everywhere.
# Either way the next collective pairs.
@pytest.mark.parametrize('cases', CASES, ids=['fused', 'single'])
@pytest.mark.parametrize('nprocs', [2, 3])
@pytest.mark.parametrize('design', ENGINE_DESIGNS)
def test_local_failure_keeps_ranks_paired(design, nprocs, cases, designs):
    out = run_joint(nprocs, 'fault_local_failure.py', design, designs, *cases, timeout=150,
                    joint=JOINT)
    ranks = _checked(out, design, nprocs)
    ranksum = nprocs * (nprocs + 1) / 2
    for rank, report in enumerate(ranks):
        assert sorted(report['errors']) == sorted(cases)
        for case in cases:
            error, seen = report['errors'][case], report['checked']
            if rank == 1:         # the failing rank: its own error, naming the failure
                assert error['injected'], (case, error)
            elif case.startswith('fused'):   # the others got the sum without rank 1's part
                assert error['type'] is None, (case, error)
                shape, total = seen['%s: the failed collective: the sum with rank 1 sending '
                                    'zeros' % case]
                assert total == pytest.approx((ranksum - 2) * np.prod(shape)), case
            else:                 # every rank skipped the collective rank 1 could not read
                assert error['type'] == 'RankMismatchError', (case, error)
            # the next collective pairs, and sums every rank's part: 10 (rank + 1)
            shape, total = seen['%s: the next collective' % case]
            assert total == pytest.approx(10 * ranksum * np.prod(shape)), case
