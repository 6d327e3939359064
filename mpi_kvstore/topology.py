"""Defaults that depend on where the job runs, decided when a store is created.

``partition_bytes``, ``credit_bytes`` and ``progress_sleep_us`` default to 'auto'. Every rank
resolves them from facts all ranks share, so they are the same everywhere: the number of
hosts the communicator spans (one Split_type and one allreduce), and the tune table, which
rank 0 read and broadcast (tuning.load). A value the user gave is kept.

- One host: the exchange runs over shared memory, where a negotiation round costs about as
  much as a piece; nothing is cut, everything agreed starts at once, MPI calls block,
  unless the host runs more ranks than its ranks have cores: there a rank that spins in a
  blocking call holds a core its peer needs to make progress, so waits sleep between
  polls (progress_sleep_us 200), as across hosts.
- Several hosts: the network is the bottleneck, and the order of the exchange decides how
  much of it hides behind compute. Pieces of 4 MB, 8 MB started between two rounds, and
  allreduces that sleep between polls, so the exchange leaves the cores to compute.
  docs/scheduling.md has the measurements behind these values.
- A tune table's ``schedule`` entry (python -m mpi_kvstore tune) wins over both.
"""
import logging
import os

import numpy as np

from .config import format_bytes, window_of
from .errors import ConfigError
from .mpiabi import MPI

__all__ = ['ACROSS_HOSTS', 'ONE_HOST', 'OVERSUBSCRIBED', 'count_hosts', 'oversubscribed',
           'resolve']

log = logging.getLogger(__name__)

ACROSS_HOSTS = {'partition_bytes': 4 << 20, 'credit_bytes': 8 << 20, 'progress_sleep_us': 200.0}
ONE_HOST = {'partition_bytes': 0, 'credit_bytes': 0, 'progress_sleep_us': 0.0}
# One host with more ranks than cores. Spinning there made a 4-rank test on 2 cores take
# 53-70 s, once over 400 s, against 19-21 s with sleeps; docs/scheduling.md has the figures.
OVERSUBSCRIBED = dict(ONE_HOST, progress_sleep_us=200.0)


def count_hosts(comm):
    """Collective: how many hosts (shared-memory domains) the ranks of ``comm`` span."""
    if comm.Get_size() == 1:
        return 1
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        leader = np.array([1 if node.Get_rank() == 0 else 0], dtype=np.int32)
    finally:
        node.Free()
    comm.Allreduce(MPI.IN_PLACE, leader, op=MPI.SUM)
    return int(leader[0])


def oversubscribed(comm):
    """Collective: whether some host runs more ranks of ``comm`` than the cores those ranks
    may run on (the union of their CPU affinities), the same answer on every rank."""
    if comm.Get_size() == 1:
        return False
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        cores = set().union(*node.allgather(sorted(_cores())))
        flag = np.array([1 if node.Get_size() > len(cores) else 0], dtype=np.int32)
    finally:
        node.Free()
    comm.Allreduce(MPI.IN_PLACE, flag, op=MPI.MAX)
    return bool(flag[0])


def _cores():
    try:
        return os.sched_getaffinity(0)
    except AttributeError:   # no affinity on this platform: every core of the machine
        return set(range(os.cpu_count() or 1))


def resolve(config, comm, table=None):
    """Collective: ``config`` with every 'auto' of :data:`ACROSS_HOSTS` decided, and a line
    that says what was chosen and why (None when nothing was 'auto'). Raises ConfigError on
    every rank when ranks end up with different pieces or credits."""
    hosts = count_hosts(comm)
    source = '%d host%s' % (hosts, '' if hosts == 1 else 's')
    if hosts > 1:
        chosen = dict(ACROSS_HOSTS)
    elif oversubscribed(comm):
        chosen = dict(OVERSUBSCRIBED)
        source += ', more ranks than cores'
    else:
        chosen = dict(ONE_HOST)
    tuned = getattr(table, 'schedule', None) or {}
    if tuned:
        chosen.update(tuned)
        source += ', tune table'
    auto = {name: value for name, value in chosen.items() if getattr(config, name) == 'auto'}
    resolved = config.replace(**auto) if auto else config
    _check_agreed(resolved, comm)
    if not auto:
        return config, None
    why = 'mpi_kvstore: %s: %s' % (source, ', '.join(
        '%s=%s' % (name, _show(value)) for name, value in sorted(auto.items())))
    return resolved, why


def _check_agreed(config, comm):
    """Every rank must cut the same pieces, take the same credit and negotiate over the same
    window (the agreement message's size): ranks that differ would pair different
    collectives and hang. One MIN-allreduce of the values and their negatives finds a
    difference on every rank alike."""
    if comm.Get_size() == 1:
        return
    mine = (config.partition_bytes, config.credit_bytes, window_of(config))
    both = np.array(mine + tuple(-v for v in mine), dtype=np.int64)
    comm.Allreduce(MPI.IN_PLACE, both, op=MPI.MIN)
    smallest = [int(v) for v in both[:3]]
    largest = [-int(v) for v in both[3:]]
    if smallest[:2] != largest[:2]:
        raise ConfigError('ranks disagree on partition_bytes or credit_bytes (this rank: %s, %s; '
                          'smallest %s, %s; largest %s, %s): every rank must be given the same '
                          'values' % (mine[:2] + tuple(smallest[:2]) + tuple(largest[:2])))
    if smallest[2] != largest[2]:
        raise ConfigError('ranks disagree on window (this rank: %d; smallest %d, largest %d; '
                          'window=auto gives 512 with shard_optimizer, else 256): every rank '
                          'must be given the same window and shard_optimizer'
                          % (mine[2], smallest[2], largest[2]))


def _show(value):
    return '%g' % value if isinstance(value, float) else format_bytes(value)
