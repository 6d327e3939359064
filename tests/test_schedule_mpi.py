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

from mpi_harness import run_designs, run_mpi

PARTS = ('sums', 'compression', 'overtake', 'join')
SCHEDULED = ('funneled', 'concurrent')


@pytest.mark.parametrize('nprocs', [2, 3], ids=lambda n: 'np%d' % n)
@pytest.mark.parametrize('design', ['funneled', 'concurrent', 'chained', 'blocking'])
def test_partitioned_scheduling_sums_compression_overtaking_and_join(design, nprocs, designs,
                                                                     batch_dir):
    out = run_designs(nprocs, 'kv_schedule.py', design, designs,
                      os.path.join(batch_dir, 'trace-{design}-{size}.json'), timeout=180)
    for part in PARTS if design in SCHEDULED else [p for p in PARTS if p != 'overtake']:
        assert 'kv_schedule[%s] %s: OK at %d ranks' % (design, part, nprocs) in out, out[-2000:]
    if design in SCHEDULED:
        # every rank wrote its trace (the overtake part read its own)
        for rank in range(nprocs):
            assert os.path.isfile(os.path.join(
                batch_dir, 'trace-%s-%d.rank%d.json' % (design, nprocs, rank)))


@pytest.mark.parametrize('design', ['funneled', 'chained'])
def test_on_one_host_the_defaults_cut_nothing(design, mpi_available):
    """The options left 'auto' resolve to 0, 0 and 0 on one host (topology.py), and sums are
    numpy's (tests/test_multihost.py runs the same scenario across two hosts)."""
    out = run_mpi(2, 'kv_topology.py', design, '1', timeout=120)
    assert 'kv_topology[%s, 1 hosts]: OK at 2 ranks' % design in out, out[-2000:]
