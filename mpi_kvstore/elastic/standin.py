"""The launcher's stand-in for a worker that died while the world's root waited for it.

The root's accept has no deadline (forming.py says why): a root that waits in ``Accept`` for
a worker that was SIGKILLed meanwhile would wait forever. The elastic launcher
(launch/driver.py) then runs this script as its own one-process MPI job. It reads the port
the root published, connects, and answers the root's challenge with a 'skip' for the dead
worker, signed with the job's secret; the root (mpi_kvstore.elastic.world) forms the world
without that worker.

    mpiexec -n 1 python standin.py DIRECTORY GENERATION WORKER TIMEOUT   # secret: environment

Its connect ends after TIMEOUT s (MPI's info key 'timeout', which MPICH's connect honours;
without it, MPICH's MPIR_CVAR_CH4_COMM_CONNECT_TIMEOUT, 180 s): a stand-in started after the
root stopped waiting has no accept to meet, and ends with status 4. What it sent stays queued
at the root under that port's name, which no later accept uses (forming.open_port).

Run as a script, so that it starts without MXNet or the package: it reads
launch/rendezvous.py (no MPI, no MXNet) from its folder.
"""
import os
import sys

from mpi4py import MPI

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'launch'))
import rendezvous  # launch/rendezvous.py, by its folder


def main(directory, generation, worker, timeout):
    secret = os.environ[rendezvous.SECRET_ENV]
    found = rendezvous.read_signed(rendezvous.current_port_path(directory), secret)
    if not found or found.get('generation') != generation or found.get('admit') != worker:
        return 3   # the root no longer waits for that worker
    info = MPI.Info.Create()
    info.Set('timeout', str(max(1, int(timeout))))
    try:
        inter = MPI.COMM_SELF.Connect(found['port'], info, root=0)
    except MPI.Exception:
        return 4   # no accept met it in time: the root no longer waits
    finally:
        info.Free()
    nonce = inter.recv(source=0)
    inter.send({'skip': worker, 'mac': rendezvous.sign(secret, 'skip', nonce, worker)}, dest=0)
    inter.recv(source=0)
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])))
