"""comm.broadcast (issue 33, seed 004): pipelined, chain and hierarchical broadcast of host
buffers, bitwise equal to flat MPI_Bcast and to numpy.

  chunks          the chunk bounds tile the buffer exactly, the last one short
  2-4 ranks       tests/scenarios/kv_broadcast.py: every root (one a dtype and size, in
                  turn), 8 dtypes, odd sizes and zero, odd chunks, windows of 1 and 3;
                  hierarchical on the real host and
                  on hosts split from COMM_WORLD (blocks, interleaved, uneven), so that
                  ranks per host differ and both of its shapes run; bad input raises
  test bed        the same across 2 hosts of 2 ranks (real hosts: Hierarchical.build
                  active) and 2 + 1 ranks (a host lacks local rank 1: the leaders shape)
About 10 s in all (the test bed's needs root).
"""
import pytest

import testbed

from mpi_harness import parametrize_sizes, result, run_mpi

TIMEOUT = 240
TESTBED, WHY_NO_TESTBED = testbed.available(rate=True, mpi=True)


@pytest.mark.parametrize('nbytes, chunk', [(0, 4), (1, 4), (10, 4), (12, 4), (1 << 20, 997)])
def test_chunks_tile_the_buffer(nbytes, chunk):
    from mpi_kvstore.comm.broadcast import _chunks
    bounds = _chunks(nbytes, chunk)
    assert [lo for lo, _ in bounds] == list(range(0, nbytes, chunk))
    assert all(hi - lo == chunk for lo, hi in bounds[:-1])
    assert not bounds or bounds[-1][1] == nbytes
    assert sum(hi - lo for lo, hi in bounds) == nbytes


def _verified(out, nprocs, hosts):
    """Each rank's count of broadcasts that came out bitwise equal to a flat MPI_Bcast and to
    numpy, by way: 8 dtypes x 5 sizes x 3 chunkings, less the 8 of 25013 elements in 997-byte
    chunks that the scenario skips. Then each bad argument raised."""
    assert 'kv_broadcast: OK at %d ranks' % nprocs in out, out[-3000:]
    ranks = result(out, 'kv_broadcast')['ranks']
    assert len(ranks) == nprocs
    for rank in ranks:
        verified = rank['verified']
        assert rank['hosts'] == hosts
        ways = ['flat', 'pipelined', 'chain'] + [
            'hierarchical (%s)' % layout for layout in ('real hosts', 'blocks of 2',
                                                         'interleaved', 'uneven')] + [
            'hierarchical Ibcasts (%s)' % layout for layout in ('interleaved', 'uneven')]
        for way in ways:
            assert verified[way] == 8 * 5 * 3 - 8, (way, verified)
        # ByTable over the real hosts, then over split ones (active): each 3 dtypes x 5 sizes
        by_table = {'False': 15, 'True': 15} if hosts == 1 else {'True': 30}
        assert {way.split()[-1][:-1]: n for way, n in verified.items()
                if way.startswith('ByTable')} == by_table, verified
        assert rank['raised'] == ['ValueError'] * 8 + ['TypeError'] * 2 + ['ValueError'] * 2


@parametrize_sizes((2, 3, 4))
def test_broadcasts_equal_flat_and_numpy(nprocs, mpi_available):
    _verified(run_mpi(nprocs, 'kv_broadcast.py', timeout=TIMEOUT), nprocs, hosts=1)


@pytest.fixture(scope='module')
def hosts():
    if not TESTBED:
        pytest.skip(WHY_NO_TESTBED or 'test bed unavailable')
    with testbed.Hosts(2, rate='10gbit') as test_hosts:   # correctness: the fastest link
        yield test_hosts


@pytest.mark.parametrize('nprocs', [4, 3])
def test_broadcasts_across_test_hosts(hosts, nprocs):
    out = run_mpi(nprocs, 'kv_broadcast.py', 'active', launcher=hosts.launcher_for(ppn=2),
                  timeout=TIMEOUT)
    _verified(out, nprocs, hosts=2)
