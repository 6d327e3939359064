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

import mpi_harness
from mpi_harness import SCENARIOS_DIR, npz_arrays, workers_agree

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


@pytest.fixture(scope='module')
def two_workers(tmp_path_factory, mpi_available):
    """The weights of an uninterrupted 2-worker run of elastic_store.py (hvd, 10 steps)."""
    out = tmp_path_factory.mktemp('ref') / 'ref'
    mpi_harness.run_elastic(os.path.join(SCENARIOS_DIR, 'elastic_store.py'), out,
                            '--api', 'hvd', '--steps', 10, workers=2, timeout=150)
    return workers_agree(out, range(2))


@pytest.mark.parametrize('step', ['formed', 'hosts'])
def test_a_worker_lost_during_the_stores_reset_is_re_formed_without(tmp_path, step,
                                                                    two_workers):
    """hvd.elastic.run under ``run --elastic``, 4 workers, worker 1 SIGKILLed after its
    backward pass of step 6 (commits every 4): worker 3 dies once the world re-formed, before
    the stores' reset (agreed options, host count, communicators), or inside the store's
    reset, between the two requests of its host count (the survivors wait in the second:
    with MPI's Split_type there, they would wait forever). The survivors' reset ends
    with HorovodInternalError, re-forms again, and workers 0 and 2 finish with hvd and the
    store at 2 ranks, bitwise equal to each other and equal to an uninterrupted 2-worker run
    (the update does not depend on the number of workers) within float32 rounding."""
    out = mpi_harness.run_elastic(SCRIPT, '--die-id', 3, '--die-step', step, '--script',
                                  'elastic_store.py', tmp_path / 'w', '--api', 'hvd', '--steps',
                                  10, '--kill-id', 1, '--kill-at', 6, workers=4, timeout=150)
    assert 'worker 3: dies at %s of generation 1' % step in out, out[-4000:]
    assert 'the reset lost the world too' in out, out[-4000:]
    if step == 'hosts':   # the store's build saw the loss, in its host count
        assert "the store's build: worker(s) [3] lost" in out, out[-4000:]
    for rank, worker in enumerate((0, 2)):
        assert ('worker %d: reset at step 4, rank %d of 2, kv %d of 2' % (worker, rank, rank)
                in out), out[-4000:]
        assert 'worker %d: finished at rank %d of 2' % (worker, rank) in out, out[-4000:]
    survivors = [npz_arrays(tmp_path / ('w.%d.npz' % worker)) for worker in (0, 2)]
    for mine, theirs, want in zip(*survivors, two_workers):
        assert np.array_equal(mine, theirs)
        assert np.allclose(mine, want, rtol=1e-5, atol=1e-6), np.abs(mine - want).max()
        assert np.abs(want).max() > 1e-3
