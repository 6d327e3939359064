"""Harness check: every rank contributes its rank; the sum must be n(n-1)/2.

argv: EXPECTED_SIZE [EXPECTED_MARK]. Also checks the environment the harness
promises each rank: OMP_NUM_THREADS=1 and the caller's env overrides.
"""
import os
import sys

from mpi4py import MPI


def main():
    comm = MPI.COMM_WORLD
    expected_size = int(sys.argv[1])
    assert comm.size == expected_size, (comm.size, expected_size)
    total = comm.allreduce(comm.rank, op=MPI.SUM)
    assert total == comm.size * (comm.size - 1) // 2, total
    assert os.environ.get('OMP_NUM_THREADS') == '1', os.environ.get('OMP_NUM_THREADS')
    if len(sys.argv) > 2:
        assert os.environ.get('HARNESS_MARK') == sys.argv[2], os.environ.get('HARNESS_MARK')
    if comm.rank == 0:
        print('allreduce ok size=%d sum=%d' % (comm.size, total))


if __name__ == '__main__':
    main()
