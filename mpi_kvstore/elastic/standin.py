"""The launcher's stand-in for a worker that died while the world's root waited for it.

MPI's accept has no deadline: a root that waits in ``Accept`` for a worker that was SIGKILLed
meanwhile would wait forever. The elastic launcher (launch/driver.py) then runs this script as its
own one-process MPI job. It reads the port the root published, connects, and answers the
root's challenge with a 'skip' for the dead worker, signed with the job's secret; the root
(mpi_kvstore.elastic.world) forms the world without that worker.

    mpiexec -n 1 python standin.py DIRECTORY GENERATION WORKER   # the secret in the environment

Run as a script, so that it starts without MXNet or the package: it reads
launch/rendezvous.py (no MPI, no MXNet) from its folder.
"""
import os
import sys

from mpi4py import MPI

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'launch'))
import rendezvous  # launch/rendezvous.py, by its folder


def main(directory, generation, worker):
    secret = os.environ[rendezvous.SECRET_ENV]
    found = rendezvous.read_signed(rendezvous.current_port_path(directory), secret)
    if not found or found.get('generation') != generation or found.get('admit') != worker:
        return 3   # the root no longer waits for that worker
    inter = MPI.COMM_SELF.Connect(found['port'], root=0)
    nonce = inter.recv(source=0)
    inter.send({'skip': worker, 'mac': rendezvous.sign(secret, 'skip', nonce, worker)}, dest=0)
    inter.recv(source=0)
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
