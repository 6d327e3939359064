"""A process without the job's secret that connects to an elastic world's port
(tests/test_elastic_run.py): it reads the published port without checking its signature,
connects, answers the challenge with a wrong secret, and prints the world's verdict."""
import json
import os
import sys
import time

from mpi4py import MPI

from mpi_kvstore.launch import rendezvous

path = rendezvous.port_path(sys.argv[1], 0)
ends = time.monotonic() + 60
while not os.path.exists(path) and time.monotonic() < ends:
    time.sleep(0.01)
with open(path) as fh:
    port = json.load(fh)['port']
inter = MPI.COMM_SELF.Connect(port, root=0)
nonce = inter.recv(source=0)
inter.send({'id': 1, 'mac': rendezvous.sign('00' * 32, 'join', nonce, 1)}, dest=0)
print('stranger: admitted %s' % inter.recv(source=0), flush=True)
