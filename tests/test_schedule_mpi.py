"""Priority-partitioned scheduling (partition_bytes, credit_bytes) under mpiexec at 2 and 3
ranks, for every design: funneled and concurrent cut and hold back (their debug counters
say so), chained and blocking ignore the options; the sums are numpy's either way.

One job per case runs every part of scenarios/kv_schedule.py, each on stores of its own
(about 3-10 s a job on the 2-core VM): sums under three option sets, fp16 and 2-bit
compression bitwise equal to an unpartitioned store's, a small high-priority request
overtaking a large low-priority one in the timeline (funneled and concurrent), and
join() with uneven steps.
"""
import os

import pytest

from mpi_harness import result, run_joint

PARTS = ('sums', 'compression', 'overtake', 'join')
SCHEDULED = ('funneled', 'concurrent')


def _joint(batch_dir):
    """(script, args, designs, sizes) of the tests below: at 2 ranks one job runs them all
    (mpi_harness.run_joint), instead of one a test, each paying the ranks' start-up."""
    return (('kv_schedule.py', (_trace(batch_dir),), ('funneled', 'concurrent', 'chained',
                                                       'blocking'), (2, 3)),
            ('kv_topology.py', ('1',), ('funneled', 'chained'), (2,)))


def _trace(batch_dir):
    return os.path.join(batch_dir, 'trace-{design}-{size}.json')


@pytest.mark.parametrize('nprocs', [2, 3], ids=lambda n: 'np%d' % n)
@pytest.mark.parametrize('design', ['funneled', 'concurrent', 'chained', 'blocking'])
def test_partitioned_scheduling_sums_compression_overtaking_and_join(design, nprocs, designs,
                                                                     batch_dir):
    out = run_joint(nprocs, 'kv_schedule.py', design, designs, _trace(batch_dir), timeout=180,
                    joint=_joint(batch_dir))
    for part in PARTS if design in SCHEDULED else [p for p in PARTS if p != 'overtake']:
        assert 'kv_schedule[%s] %s: OK at %d ranks' % (design, part, nprocs) in out, out[-2000:]
    ranksum = nprocs * (nprocs + 1) / 2
    for rank in result(out, 'kv_schedule[%s] join' % design)['ranks']:
        # after the join every rank takes part again: 5000 values of the ranks' (rank + 1)
        assert rank['checked']['pushpull after join'] == [[5000], 5000 * ranksum]
        assert rank['checked']['join step 0 jb'] == [     # arange(3000) + rank, every rank
            [3000], nprocs * 2999 * 3000 / 2 + 3000 * (ranksum - nprocs)]
    if design in SCHEDULED:
        # every rank wrote its trace (the overtake part read its own)
        for rank in range(nprocs):
            assert os.path.isfile(os.path.join(
                batch_dir, 'trace-%s-%d.rank%d.json' % (design, nprocs, rank)))
        for rank in result(out, 'kv_schedule[%s] overtake' % design)['ranks']:
            # one 4 MB request cut in 62 pieces of 64 KB a round, the rest held back
            assert rank['counted']['pieces_cut'] == 2 and rank['counted']['held_back'] > 0
            assert rank['checked']['big, iteration 1'] == [[1000000], 1000000 * (ranksum + nprocs)]
            # by iteration, how many pieces the small request went ahead of: the scenario holds
            # it to all that had not started when every rank had it ready, but one or two
            # (how many that is depends on how promptly each rank pushed it)
            assert len(rank['overtaken']) == 2, rank


@pytest.mark.parametrize('design', ['funneled', 'chained'])
def test_on_one_host_the_defaults_cut_nothing(design, batch_dir, mpi_available):
    """The options left 'auto' resolve to 0, 0 and 0 on one host (topology.py), and sums are
    numpy's (tests/test_multihost.py runs the same scenario across two hosts)."""
    out = run_joint(2, 'kv_topology.py', design, [design], '1', timeout=120,
                    joint=_joint(batch_dir))
    assert 'kv_topology[%s, 1 hosts]: OK at 2 ranks' % design in out, out[-2000:]
    for rank in result(out, 'kv_topology[%s, 1 hosts]' % design)['ranks']:
        assert rank['pieces_cut'] == 0                       # the 10 MB array went whole
        assert rank['checked']['small2'] == [[257], 257 * (2 + 3)]      # rank + 2, summed
        # ranks that disagree on partition_bytes, shard_optimizer or window: refused together
        assert rank['raised'] == ['ConfigError'] * 3
