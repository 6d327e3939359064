"""A worker that dies while the survivors re-form their world (every job under a timeout,
through test_elastic_run.run_world, which leaves nothing running).

4 workers, commits every 5 steps; worker 1 SIGKILLed in the middle of step 12. While workers
0, 2 and 3 re-form the world, one of them SIGKILLs itself at a step of the forming
(scenarios/elastic_reform.py): a member once every member is in ('admitted'), the new root
right after it opened its port ('joined': the others wait to be admitted), a member right
after it was merged while the root waits for the next one ('joined'). Every step of the
forming is bounded, so the survivors' re-forming ends with HorovodInternalError, elastic.run
re-forms again without the second lost worker, and the two left finish the 30 steps, bitwise
equal to each other and equal to a numpy run without the losses within float32 rounding.
"""
import os

import numpy as np
import pytest
from test_elastic_run import run_world, world_reference

from mpi_harness import SCENARIOS_DIR

SCRIPT = os.path.join(SCENARIOS_DIR, 'elastic_reform.py')


@pytest.mark.parametrize('dies, step, survivors', [
    (3, 'admitted', (0, 2)),
    (0, 'joined', (2, 3)),
    (2, 'joined', (0, 3)),
])
def test_a_worker_lost_during_the_re_forming_is_re_formed_without(tmp_path, mpi_available,
                                                                  dies, step, survivors):
    statuses, out, _ = run_world(tmp_path, 4, '--die-id', dies, '--die-step', step,
                                 str(tmp_path / 'w'), '--kill-id', 1, '--kill-at', 12,
                                 script=SCRIPT)
    want = {worker: 0 for worker in survivors}
    want.update({1: 9, dies: 9})
    assert statuses == want, (statuses, out[-4000:])
    assert 'worker %d: dies at %s of generation 1' % (dies, step) in out, out[-4000:]
    assert 'the reset lost the world too' in out, out[-4000:]
    for rank, worker in enumerate(survivors):
        assert 'worker %d: reset at step 10, rank %d of 2' % (worker, rank) in out, out[-4000:]
        assert 'worker %d: finished at rank %d of 2' % (worker, rank) in out, out[-4000:]
    got = [np.load(tmp_path / ('w.%d.npy' % worker)) for worker in survivors]
    assert np.array_equal(got[0], got[1])
    want_w = world_reference(30)
    assert np.allclose(got[0], want_w, rtol=1e-5, atol=1e-6), np.abs(got[0] - want_w).max()
    for worker in (1, dies):
        assert not (tmp_path / ('w.%d.npy' % worker)).exists()
