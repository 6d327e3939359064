"""hvd.DistributedOptimizer's allreduce rejected by the store (a list with something that is
no NDArray; an earlier collective's error raised by it) leaves float16 and integer gradients
unscaled, and the retried call sums them prescaled once, as Horovod's
allreduce_(grad, prescale_factor=1/gradient_predivide_factor) does (exactly, per numpy).
scenarios/hvd_opt_rejected.py, every design at 2 ranks."""
import pytest

from mpi_kvstore.designs import NAMES

from mpi_harness import result, run_designs


@pytest.mark.parametrize('design', NAMES)
def test_a_rejected_optimizer_allreduce_leaves_the_gradients_unscaled(design, designs):
    out = run_designs(2, 'hvd_opt_rejected.py', design, designs, timeout=120)
    name = 'hvd_opt_rejected[%s]' % design
    assert '%s: OK at 2 ranks' % name in out, out[-3000:]
    for seen in result(out, name)['ranks']:
        assert seen['raised'] == ['TypeError', 'CollectiveError'] * 2, seen['raised']
        assert len(seen['checked']) == 6, sorted(seen['checked'])
        for what, got in seen['checked'].items():
            assert got == seen['expected'][what], what   # exact: shape and sum
