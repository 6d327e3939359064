"""Harness check: rank 1 raises while rank 0 waits for a message from it.

Without the MPI_Abort that `python -m mpi4py` performs on an uncaught
exception, rank 0 (and every other rank, in the barrier) would wait forever.
"""
from mpi4py import MPI


def main():
    comm = MPI.COMM_WORLD
    if comm.rank == 1:
        raise RuntimeError('harness: rank 1 failed on purpose')
    if comm.rank == 0:
        comm.recv(source=1, tag=7)
    comm.Barrier()


if __name__ == '__main__':
    main()
