"""Horovod's rounding and the store's kept apart, and each call scaled by its own factor
(scenarios/hvd_rounding.py, every design at 2 ranks): an integer mean through the
functional API floor-divides and through mpi_kvstore.horovod truncates, in turns under one
name on one store; two postscale factors whose signature marks collide each scale their own
call (chained took the first one's plan); float16 sums scaled bitwise as Horovod 0.28.1
scales them (the factor in float32, not rounded to float16); Min, Max and Product scaled in
their numpy copy, no scale op; a DistributedTrainer's custom compressor prescales the
compressed tensor as Horovod does (float32 folded: no op)."""
import pytest

from mpi_kvstore.designs import NAMES

from mpi_harness import result, run_designs


@pytest.mark.parametrize('design', NAMES)
def test_rounding_and_factors_are_each_calls_own(design, designs):
    out = run_designs(2, 'hvd_rounding.py', design, designs, timeout=180)
    name = 'hvd_rounding[%s]' % design
    assert '%s: OK at 2 ranks' % name in out, out[-3000:]
    for seen in result(out, name)['ranks']:
        first, second = seen['pair']
        assert first != second, seen['pair']
        # 2 dtypes x 2 orders x 4 calls x 2 forms; 2 collide factors (each called twice);
        # 4 half cases x 2 steps; 3 dtypes x 3 extreme ops
        # and 2 custom compressors
        assert len(seen['checked']) == 32 + 2 + 8 + 9 + 2, sorted(seen['checked'])
        assert seen['custom_ops'] == {'UserCopy': 0, 'UserFP16': 1}, seen['custom_ops']
        for what, got in seen['checked'].items():
            if what == 'custom float32':   # folded: Horovod's up to rounding
                assert got[0] == seen['expected'][what][0], what
                assert got[1] == pytest.approx(seen['expected'][what][1], rel=1e-6), what
            else:
                assert got == seen['expected'][what], what   # exact: shape and sum
