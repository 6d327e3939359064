"""Harness check: rank 0 waits forever for a message nobody sends.

argv: PIDFILE. Rank 0 writes every rank's pid there before hanging, so the
test can check that the harness left none of them running. The other ranks
wait in a barrier that rank 0 never joins.
"""
import os
import sys

from mpi4py import MPI


def main():
    comm = MPI.COMM_WORLD
    pids = comm.gather(os.getpid(), root=0)
    if comm.rank == 0:
        with open(sys.argv[1], 'w') as f:
            f.write(' '.join(str(pid) for pid in pids))
        print('rank 0 waiting forever', flush=True)
        comm.recv(source=MPI.ANY_SOURCE, tag=99)
    comm.Barrier()


if __name__ == '__main__':
    main()
