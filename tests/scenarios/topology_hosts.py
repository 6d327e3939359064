"""The hosts of a world whose launcher names each rank's host (an elastic worker's
MPI_KVSTORE_ELASTIC_HOST, set here per rank from argv[1]: names, ',' between ranks, '-' for
none): topology.count_hosts, the node communicator, and the schedule a store resolves; and
host_spread, the count of an elastic store's build (one allgather), beside count_hosts and
oversubscribed."""
import os
import sys

from mpi_kvstore.comm import topology
from mpi_kvstore.config import Config

from common import RANK, WORLD, report

NAMES = sys.argv[1].split(',')
if NAMES[RANK] != '-':   # read at each call of node_comm, so setting it now is enough
    os.environ[topology.HOST_ENV] = NAMES[RANK]

node = topology.node_comm(WORLD)
members = sorted(node.allgather(RANK))
node.Free()
config, _ = topology.resolve(Config(design='funneled'), WORLD, warn=False)
report('topology_hosts', hosts=topology.count_hosts(WORLD), node=members,
       partition_bytes=config.partition_bytes, credit_bytes=config.credit_bytes,
       oversubscribed=topology.oversubscribed(WORLD),
       spread=list(topology.host_spread(WORLD)))   # an elastic build's count, no Split_type
