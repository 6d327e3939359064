"""elastic_hosts_train.py on a test host (tests/test_elastic_testbed.py): the worker first says
where it runs, 'worker I on HOST' (the test host's name: its UTS namespace), then trains.

usage: elastic_testbed_train.py OUT [elastic_hosts_train.py's options]
"""
import os
import runpy
import socket
import sys

from mpi_kvstore.launch import rendezvous

print('worker %s on %s' % (os.environ[rendezvous.ID_ENV], socket.gethostname()), flush=True)
runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                            'elastic_hosts_train.py'), run_name='__main__')
sys.exit(0)
