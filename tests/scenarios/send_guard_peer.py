"""A survivor that goes on starting collectives on a world whose peer was SIGKILLed.

Roles, each its own ``mpiexec -n 1`` meeting through ports published in DIR:
  root    accepts 'victim', allreduces with it; once the victim said it dies, it starts a
          new Iallreduce every DEADLINE for WINDOW seconds on the old world, then accepts
          'late' and allreduces over the new world;
  victim  joins, allreduces KILL_AFTER times, says it dies (a file), then SIGKILLs itself;
  late    joins the new world.
MPICH's UCX sends to the dead peer fail at once once UCX has seen its connection go, and
MPICH then crashed inside MPI_Iallreduce (comm/sendguard.py, guard_failed_sends).
"""
import os
import signal
import sys
import time

import numpy as np

from mpi_kvstore.comm import abandoned, sendguard
from mpi_kvstore.comm.mpiabi import MPI

role, directory = sys.argv[1], sys.argv[2]
KILL_AFTER, DEADLINE, WINDOW, GRACE, SIZE = 50, 0.05, 1.5, 2.0, 1024


def publish(name, text):
    path = os.path.join(directory, name)
    with open(path + '.tmp', 'w') as file:
        file.write(text)
    os.rename(path + '.tmp', path)


def published(name, timeout=60):
    path, ends = os.path.join(directory, name), time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > ends:
            sys.exit('%s: no %s in %g s' % (role, name, timeout))
        time.sleep(0.01)
    with open(path) as file:
        return file.read()


def allreduce_new_world(world):
    out = np.empty(4, np.float64)
    world.Allreduce(np.full(4, 1.5 + world.Get_rank()), out, MPI.SUM)
    print('%s: new world of %d: %s' % (role, world.Get_size(), out.tolist()), flush=True)


print('%s: guarded %s' % (role, ','.join(sendguard.guarded()) or 'nothing'), flush=True)
data = np.arange(SIZE, dtype=np.float32)
if role == 'root':
    port = MPI.Open_port()
    publish('port1', port)
    world = MPI.COMM_WORLD.Accept(port).Merge(False)
    done, started = 0, 0
    while True:   # until the victim's collectives are over and it said it dies
        out = np.empty_like(data)
        request = world.Iallreduce(data, out, MPI.SUM)
        while not request.Test() and not os.path.exists(os.path.join(directory, 'dying')):
            pass
        ends = time.monotonic() + GRACE   # what the victim sent before it died still lands
        while not request.Test() and time.monotonic() < ends:
            pass
        if not request.Test():
            break
        assert np.array_equal(out, 2 * data), out[:4]
        done += 1
    abandoned.keep(request, out)
    lost_at = time.monotonic()
    while time.monotonic() - lost_at < WINDOW:   # new collectives on the old world
        out = np.empty_like(data)
        request = world.Iallreduce(data, out, MPI.SUM)
        started += 1
        ends = time.monotonic() + DEADLINE
        while time.monotonic() < ends:
            assert not request.Test(), 'a collective with the killed peer completed'
        abandoned.keep(request, out)
    print('root: %d collectives done, %d started after the loss' % (done, started), flush=True)
    port = MPI.Open_port()
    publish('port2', port)
    allreduce_new_world(MPI.COMM_WORLD.Accept(port).Merge(False))
elif role == 'victim':
    world = MPI.COMM_WORLD.Connect(published('port1')).Merge(True)
    for _ in range(KILL_AFTER):
        out = np.empty_like(data)
        request = world.Iallreduce(data, out, MPI.SUM)
        while not request.Test():
            pass
    publish('dying', 'now')
    os.kill(os.getpid(), signal.SIGKILL)
else:
    allreduce_new_world(MPI.COMM_WORLD.Connect(published('port2')).Merge(True))
sys.stdout.flush()
os._exit(0)   # the old world's peer is gone: MPI_Finalize would wait for it
