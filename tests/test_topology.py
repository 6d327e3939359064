"""comm/topology.py without mpiexec: the warning a design that loses across hosts gets, from
the store (rank 0 logs it once) and from doctor (a line of its report)."""
import logging

import pytest

from mpi_kvstore.cli import doctor
from mpi_kvstore.comm import topology
from mpi_kvstore.comm.mpiabi import MPI
from mpi_kvstore.config import Config


@pytest.mark.parametrize('design, hosts, warned', [
    ('chained', 2, True), ('chained', 4, True), ('chained', 1, False),
    ('funneled', 2, False), ('concurrent', 3, False), ('blocking', 2, False)])
def test_chained_across_hosts_is_warned_and_names_the_better_design(design, hosts, warned):
    words = topology.design_warning(design, hosts)
    if not warned:
        assert words is None
        return
    assert 'design=chained across %d hosts' % hosts in words
    assert 'design=funneled' in words and 'docs/designs.md' in words


def test_the_store_logs_it_once_and_doctor_shows_it(monkeypatch, caplog):
    """resolve (what the store calls at creation) logs the warning on rank 0 across hosts;
    doctor's report carries it as a line, and its own resolve call does not log it again."""
    monkeypatch.setattr(topology, 'count_hosts', lambda comm: 2)
    with caplog.at_level(logging.WARNING, logger='mpi_kvstore'):
        config, _ = topology.resolve(Config(environ={}, design='chained'), MPI.COMM_SELF)
    assert config.partition_bytes == topology.ACROSS_HOSTS['partition_bytes']
    assert [r.getMessage() for r in caplog.records] == [topology.design_warning('chained', 2)]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger='mpi_kvstore'):
        topology.resolve(Config(environ={}, design='funneled'), MPI.COMM_SELF)
    assert caplog.records == []

    monkeypatch.setenv('MPI_KVSTORE_DESIGN', 'chained')
    with caplog.at_level(logging.WARNING, logger='mpi_kvstore'):
        lines = doctor.report()
    warned = [line for line in lines if line.startswith('  warning: design=chained across 2')]
    assert len(warned) == 1 and 'design=funneled' in warned[0], lines
    assert caplog.records == []
    monkeypatch.setenv('MPI_KVSTORE_DESIGN', 'funneled')
    assert not any('warning: design' in line for line in doctor.report())


@pytest.mark.parametrize('hosts, options, elastic, chosen', [
    (1, {}, False, 'chained'),
    (2, {}, False, 'funneled'),
    (4, {}, False, 'funneled'),
    (1, {}, True, 'funneled'),
    (1, {'autotune': True}, False, 'funneled'),
    (1, {'autotune': False}, False, 'chained'),
    (1, {'design': 'concurrent'}, False, 'concurrent'),
    (3, {'design': 'chained'}, False, 'chained'),
])
def test_design_auto_is_chained_on_one_host_else_funneled(monkeypatch, hosts, options, elastic,
                                                          chosen):
    """The default design: chained on one host; funneled across hosts, on an elastic world or
    with autotune on; a design the user named is kept, and the line says why."""
    monkeypatch.setattr(topology, 'count_hosts', lambda comm: hosts)
    monkeypatch.setattr(topology, 'oversubscribed', lambda comm: False)
    given = Config(environ={}, **options)
    config, why = topology.resolve(given, MPI.COMM_SELF, warn=False, elastic=elastic)
    assert config.design == chosen
    if 'design' in options:
        assert config.origin('design') == given.origin('design') == 'argument'
    else:
        assert given.design == 'auto'
        assert 'design=%s' % chosen in why and config.origin('design').startswith('auto: ')


@pytest.mark.parametrize('names', ['a,b,a', 'h1,h1', 'x,y', '-,-,-', 'q,p,q,q'])
def test_an_elastic_world_counts_the_hosts_its_launcher_named(names):
    """A world of separate launches (run --elastic) cannot ask MPI which ranks share a host:
    MPICH's Split_type put workers of 2 test hosts in one node, and the job scheduled as on
    one host. The host each worker's launcher names decides instead; none named: MPI's split
    (every rank here is on this machine). host_spread, what an elastic store's build counts
    with (one bounded allgather, no Split_type), gives the same hosts and oversubscription,
    and places (hvd.init's on an elastic world) the local and cross ranks MPI's splits give."""
    from mpi_harness import result, run_mpi
    given = names.split(',')
    out = run_mpi(len(given), 'topology_hosts.py', names, timeout=120)
    hosts = [name if name != '-' else 'this machine' for name in given]
    expected_hosts = len(set(hosts))
    for rank, got in enumerate(result(out, 'topology_hosts')['ranks']):
        assert got['hosts'] == expected_hosts, (rank, got)
        assert got['node'] == [r for r, h in enumerate(hosts) if h == hosts[rank]], (rank, got)
        across = expected_hosts > 1
        assert got['partition_bytes'] == (topology.ACROSS_HOSTS['partition_bytes'] if across
                                          else topology.ONE_HOST['partition_bytes']), (rank, got)
        assert got['credit_bytes'] == (topology.ACROSS_HOSTS['credit_bytes'] if across
                                       else topology.ONE_HOST['credit_bytes']), (rank, got)
        # an elastic store's build counts by one allgather (no Split_type): the same answers
        assert got['spread'] == [got['hosts'], got['oversubscribed']], (rank, got)
        # hvd.init's (local rank, local size, cross rank, cross size) there: node_comm and a
        # Split by the local rank (Split_type with no names), and the allgather's, alike
        assert got['places'] == got['split'], (rank, got)
        assert got['split'][:2] == [got['node'].index(rank), len(got['node'])], (rank, got)
