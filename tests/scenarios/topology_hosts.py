"""The hosts of a world whose launcher names each rank's host (an elastic worker's
MPI_KVSTORE_ELASTIC_HOST, set here per rank from argv[1]: names, ',' between ranks, '-' for
none): topology.count_hosts, the node communicator, and the schedule a store resolves; and
host_spread, the count of an elastic store's build (one allgather), beside count_hosts and
oversubscribed; places, hvd.init's local and cross ranks on an elastic world (the same
allgather), beside node_comm and a Split by the local rank."""
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
local = node.Get_rank()
split = [local, node.Get_size()]
node.Free()
cross = WORLD.Split(local, RANK)   # hvd.init's cross communicator off an elastic world
split += [cross.Get_rank(), cross.Get_size()]
cross.Free()
config, _ = topology.resolve(Config(design='funneled'), WORLD, warn=False)
report('topology_hosts', hosts=topology.count_hosts(WORLD), node=members,
       partition_bytes=config.partition_bytes, credit_bytes=config.credit_bytes,
       oversubscribed=topology.oversubscribed(WORLD),
       spread=list(topology.host_spread(WORLD)),   # an elastic build's count, no Split_type
       split=split, places=list(topology.places(WORLD)))   # hvd.init's, Split and no Split
