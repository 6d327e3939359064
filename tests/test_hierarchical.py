"""Hierarchical allreduce (the ``hierarchical`` option; comm.Comm): right sums, and active
exactly where it applies.

  option parsing      auto/on/off and booleans; a bad value raises ConfigError
  one host            2 ranks: one node, so the hierarchy stays off (and chained keeps its
                      compiled op); sums still right
  two hosts (testbed) 4 ranks, 2 a host, every design: the reduce-scatter shape, active on
                      every Comm of the store; the same with 4 KB pieces (partition_bytes);
                      3 ranks (2 + 1): the leaders shape; 4 ranks with hierarchical=off:
                      flat, nothing built
The scenario (tests/scenarios/kv_hierarchical.py) checks pushpull of single keys (sizes that
2 ranks cannot split evenly, and one over the fusion threshold), fused key lists, per-device
lists, float32/float64/int32/float16, average=True and broadcast, against numpy, exactly; and
that ranks given different modes all raise ConfigError. About 2 minutes on 2 idle cores.
"""
import numpy as np
import pytest

import testbed
from mpi_kvstore import ConfigError
from mpi_kvstore import config as cfg
from mpi_kvstore.designs import NAMES as DESIGNS

from mpi_harness import result, run_designs, run_joint, run_mpi

OK, WHY = testbed.available(rate=True, mpi=True)
RATE = '10gbit'       # correctness only: the fastest shaped link
TIMEOUT = 150
SCENARIO = 'kv_hierarchical.py'


def _values(rank, n, dtype, salt=0):
    """What rank RANK pushes in scenarios/kv_hierarchical.py: small integers, so that every
    sum is exact, float16's included."""
    i = np.arange(n, dtype=np.int64)
    return (((i * 7 + rank * 3 + salt) % 11) - 5).astype(dtype)


def _summed(n, nprocs, salt=0):
    """numpy's sum over the ranks' values, summed over its N elements (as reported)."""
    return float(sum(_values(r, n, np.float64, salt) for r in range(nprocs)).sum())


def _ok(output, design, expect, nprocs):
    """The scenario's sums against numpy's here, and its Comms hierarchical exactly where
    EXPECT ('scatter': 2 hosts alike, 'leaders': uneven hosts) says."""
    name = 'kv_hierarchical[%s, %s]' % (design, expect)
    assert '%s: OK at %d ranks' % (name, nprocs) in output, output[-3000:]
    ranks = result(output, name)['ranks']
    assert len(ranks) == nprocs
    active = expect in ('scatter', 'leaders')
    for rank in ranks:
        assert rank['comms'] and all(c['hierarchical'] == active for c in rank['comms'])
        if active:    # two hosts; uniform where they hold as many ranks each
            assert all(c['nodes'] == 2 and c['uniform'] == (expect == 'scatter')
                       for c in rank['comms']), rank['comms']
        seen = rank['checked']
        for dtype in ('float32', 'float64', 'int32', 'float16'):
            for n in (1, 3, 1001, 300_001):
                assert seen['pushpull single_%s_%d' % (dtype, n)] == [
                    [n], pytest.approx(_summed(n, nprocs))], (dtype, n)
            for i, n in enumerate((5, 1, 1000, 33, 4097)):      # one fused bucket
                assert seen['fused fused_%s_%d' % (dtype, i)] == [
                    [n], pytest.approx(_summed(n, nprocs, salt=i))], (dtype, i)
            # rank 0's values
            assert seen['broadcast %s' % dtype] == [
                [1001], pytest.approx(float(_values(0, 1001, np.float64).sum()))]
        for n in (3, 300_001):
            assert seen['average float64 %d' % n] == [
                [n], pytest.approx(_summed(n, nprocs) / nprocs)]
        # ranks given different modes: a ConfigError on every rank
        assert rank['raised'] == (['ConfigError'] if nprocs > 1 else [])


# -- the option ---------------------------------------------------------------------------

@pytest.mark.parametrize('raw, value', [('auto', 'auto'), ('ON', 'on'), (' off ', 'off'),
                                        ('1', 'on'), ('0', 'off'), (True, 'on'),
                                        (False, 'off')])
def test_hierarchical_values(raw, value):
    assert cfg.Config(hierarchical=raw, environ={}).hierarchical == value


def test_hierarchical_default_is_auto():
    assert cfg.Config(environ={}).hierarchical == 'auto'


def test_bad_hierarchical_value_raises_config_error():
    with pytest.raises(ConfigError, match="hierarchical='maybe'"):
        cfg.Config(hierarchical='maybe', environ={})
    with pytest.raises(ConfigError, match='MPI_KVSTORE_HIERARCHICAL'):
        cfg.Config(environ={'MPI_KVSTORE_HIERARCHICAL': 'maybe'})
    with pytest.raises(ConfigError):
        cfg.from_environment('hierarchical', {'MPI_KVSTORE_HIERARCHICAL': 'sometimes'})


# -- one host: nothing to be hierarchical about -------------------------------------------

@pytest.mark.parametrize('design', ['funneled', 'chained'])
def test_one_host_stays_flat(design, designs):
    _ok(run_designs(2, SCENARIO, design, designs, 'inactive', timeout=TIMEOUT), design, 'inactive', 2)


# -- two hosts ----------------------------------------------------------------------------

@pytest.fixture(scope='module')
def hosts():
    if not OK:
        pytest.skip(WHY or 'test bed unavailable')
    with testbed.Hosts(2, rate=RATE) as test_hosts:
        yield test_hosts


# (script, args, designs, sizes) of the tests below at 4 ranks over the hosts with no
# environment of their own: one job runs them all (mpi_harness.run_joint), instead of one
# a test, each paying the ranks' start-up
JOINT = (
    (SCENARIO, ('scatter',), DESIGNS, (4,)),
    ('kv_sharded.py', ('grid',), ('funneled',), (4,)),
    (SCENARIO, ('inactive', 'off'), ('funneled',), (4,)),
)


def joint_across(hosts, script, design, designs, *args, timeout=TIMEOUT):
    """run_joint at 4 ranks, 2 a host: the one job of JOINT's scenarios."""
    return run_joint(4, script, design, designs, *args, joint=JOINT,
                     launcher=hosts.launcher_for(ppn=2), timeout=timeout)


def run_across(hosts, nprocs, *args):
    """NPROCS ranks in blocks of 2 over the hosts: h0 gets ranks 0 and 1."""
    return run_mpi(nprocs, SCENARIO, *args, launcher=hosts.launcher_for(ppn=2), timeout=TIMEOUT)


@pytest.mark.parametrize('design', DESIGNS)
def test_two_hosts_two_ranks_each(hosts, design, designs):
    _ok(joint_across(hosts, SCENARIO, design, designs, 'scatter'), design, 'scatter', 4)


def test_partitioned_pieces_go_through_the_hierarchy(hosts):
    """Priority scheduling cuts the scenario's arrays into 4 KB pieces, taken 8 KB at a time
    (schedule.py); each piece goes through the hosts, and the sums are still numpy's."""
    out = run_mpi(4, SCENARIO, 'funneled', 'scatter', launcher=hosts.launcher_for(ppn=2),
                  timeout=TIMEOUT, env={'MPI_KVSTORE_PARTITION_BYTES': '4K',
                                        'MPI_KVSTORE_CREDIT_BYTES': '8K'})
    _ok(out, 'funneled', 'scatter', 4)


def test_uneven_hosts_go_through_leaders(hosts):
    _ok(run_across(hosts, 3, 'concurrent', 'leaders'), 'concurrent', 'leaders', 3)


def test_sharded_collectives_go_through_the_hosts(hosts):
    """shard_optimizer's reduce-scatter and allgather (hierarchy.Grid), whole and in pieces:
    the weights equal the flat unsharded store's and one process's."""
    out = joint_across(hosts, 'kv_sharded.py', 'funneled', ['funneled'], 'grid', timeout=300)
    assert 'kv_sharded[funneled] grid: OK at 4 ranks' in out, out[-3000:]
    for rank in result(out, 'kv_sharded[funneled] grid')['ranks']:
        # SGD and Adam, whole and in pieces: every parameter equals one process's
        names = [what for what in rank['checked'] if what.endswith(' vs one process')]
        assert len(names) >= 2 * 2 * 2, names
        for what in names:
            (shape, got), (want_shape, want) = rank['checked'][what], rank['expected'][what]
            assert shape == want_shape and got == pytest.approx(
                want, rel=1e-3, abs=1e-3 * np.prod(shape)), what


@pytest.mark.parametrize('nprocs, local', [(4, 2), (6, 3), (6, 2)])
def test_grid_of_split_hosts_on_one_box(nprocs, local, mpi_available):
    """hierarchy.Grid against numpy, its "hosts" split from COMM_WORLD in blocks and
    interleaved: uneven shares, zeros, gaps between them in the allgather."""
    out = run_mpi(nprocs, 'grid_shares.py', str(local), timeout=120)
    assert 'grid_shares[%d a host]: OK at %d ranks' % (local, nprocs) in out, out[-3000:]
    ranks = result(out, 'grid_shares[%d a host]' % local)['ranks']
    assert len(ranks) == nprocs
    # the scenario's cases again, here: its counts (seeded) and numpy's sums of its values
    for layout in ('blocks', 'interleaved'):
        rng = np.random.RandomState(11)
        for dtype in ('float32', 'float64', 'int32'):
            for trial in range(4):
                counts = list(rng.randint(0, 6 if trial < 2 else 400, size=nprocs))
                counts[trial % nprocs] = 0
                starts = np.concatenate([[0], np.cumsum(counts)])
                want = sum(((np.arange(starts[-1]) * 7 + r * 1000 + 3) % 97 - 40).astype(dtype)
                           for r in range(nprocs))
                what = '%s: reduce-scatter, %s, counts %s' % (layout, dtype, counts)
                for rank, report in enumerate(ranks):   # each rank's share of numpy's sum
                    assert report['checked'][what] == [
                        [counts[rank]], float(want[starts[rank]:starts[rank + 1]].astype(float).sum())], what


def test_off_across_hosts_is_flat(hosts):
    _ok(joint_across(hosts, SCENARIO, 'funneled', ['funneled'], 'inactive', 'off'),
        'funneled', 'inactive', 4)
