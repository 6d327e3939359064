"""The store on a world that loses a worker, in memory (tests/scenarios/elastic_store.py under
``python -m mpi_kvstore run --elastic``, every job under a timeout, nothing left running):

3 workers train a small Gluon model (the global batch of each step split over the ranks, the
gradients averaged, so the update does not depend on the number of workers); worker 1 is
SIGKILLed after its backward pass of step 6, while the others' gradient exchange is in
flight. The store's collectives end with HorovodInternalError on both survivors, which
restore the commit of step 4, re-form a world of 2 and rebuild their store on it: hvd.size()
and kv.num_workers are 2, and both end bitwise equal to each other and equal to an
uninterrupted 3-worker run within float32 rounding. Once through hvd.DistributedTrainer under
hvd.elastic.run, once through gluon.Trainer on kv.pushpull under elastic.run_fn.
"""
import os

import numpy as np
import pytest

import mpi_harness
from mpi_harness import SCENARIOS_DIR, npz_arrays, workers_agree

TIMEOUT = 150
SCRIPT = os.path.join(SCENARIOS_DIR, 'elastic_store.py')
STEPS = 14


def run_elastic(out, *script_args):
    """The scenario's elastic job of 3 workers -> its output (status 0, nothing left)."""
    return mpi_harness.run_elastic(SCRIPT, out, '--steps', STEPS, *script_args, timeout=TIMEOUT)


@pytest.fixture(scope='module')
def uninterrupted(tmp_path_factory, mpi_available):
    """The weights of 3 workers trained without a loss (the same script, the same launcher)."""
    out = tmp_path_factory.mktemp('ref') / 'w'
    run_elastic(out, '--api', 'hvd')
    return workers_agree(out, range(3))


@pytest.mark.parametrize('api', ['hvd', 'kv'])
def test_the_store_survives_a_worker_killed_mid_step(tmp_path, api, uninterrupted):
    out = run_elastic(tmp_path / 'w', '--api', api, '--kill-id', 1, '--kill-at', 6)
    assert 'worker 1 on localhost was lost (status 9)' in out, out[-4000:]
    # the store's own collectives saw the loss, not only the world's
    assert "the store ends its world: the store's collectives: worker(s) [1] lost" in out, \
        out[-4000:]
    assert 'worker 0: reset at step 4, rank 0 of 2, kv 0 of 2' in out, out[-4000:]
    assert 'worker 2: reset at step 4, rank 1 of 2, kv 1 of 2' in out, out[-4000:]
    for worker, rank in ((0, 0), (2, 1)):
        assert 'worker %d: finished at rank %d of 2' % (worker, rank) in out, out[-4000:]
    assert not (tmp_path / 'w.1.npz').exists()
    survivors = [npz_arrays(tmp_path / ('w.%d.npz' % worker)) for worker in (0, 2)]
    for mine, theirs, want in zip(*survivors, uninterrupted):
        assert np.array_equal(mine, theirs)
        assert np.allclose(mine, want, rtol=1e-5, atol=1e-6), np.abs(mine - want).max()
        assert np.abs(want).max() > 1e-3   # weights that trained, not zeros


def test_the_store_survives_a_worker_killed_inside_a_commit(tmp_path, uninterrupted):
    """Worker 2 dies inside the commit of step 8 (after its copy, before the commit's
    broadcast): the world's broadcast sees the loss, the survivors restore step 8, rebuild the
    store on a world of 2 and end equal to the uninterrupted run (float32)."""
    out = run_elastic(tmp_path / 'w', '--api', 'hvd', '--kill-id', 2, '--kill-in-commit', 8)
    assert 'worker 0: reset at step 8, rank 0 of 2, kv 0 of 2' in out, out[-4000:]
    assert 'worker 1: reset at step 8, rank 1 of 2, kv 1 of 2' in out, out[-4000:]
    survivors = [npz_arrays(tmp_path / ('w.%d.npz' % worker)) for worker in (0, 1)]
    for mine, theirs, want in zip(*survivors, uninterrupted):
        assert np.array_equal(mine, theirs)
        assert np.allclose(mine, want, rtol=1e-5, atol=1e-6), np.abs(mine - want).max()


def test_a_survivor_reads_the_error_and_the_store_goes_on_after_the_reset(tmp_path,
                                                                       mpi_available):
    """2 workers; worker 1 dies after the first pushpull, while worker 0's second one waits
    for it: worker 0's read of the output raises MXNet's error naming the loss (no hang), the
    output holds NaN (not a plausible sum), the next pushpull raises HorovodInternalError,
    the store's threads have ended; after world.reform() and kv.reset() the store is rank 0
    of 1 and sums again."""
    out = mpi_harness.run_elastic('elastic_store_read.py', workers=2, timeout=TIMEOUT)
    assert 'worker 1: first sum 3.0' in out and 'worker 0: first sum 3.0' in out, out[-4000:]
    assert 'worker 0: the read raised MXNetError (True)' in out, out[-4000:]
    assert 'worker 0: the output holds [nan nan]' in out, out[-4000:]
    assert ('worker 0: the next pushpull raised HorovodInternalError: the world failed: '
            "the store's collectives: worker(s) [1] lost") in out, out[-4000:]
    assert 'worker 0: store threads alive []' in out, out[-4000:]
    assert 'worker 0: after the reset rank 0 of 1, sum 5.0' in out, out[-4000:]


# -- one process: the options, the refusals and the reset ------------------------------------

class _FakeWorld:
    """A world of this one process whose check() raises once ``lost`` is set (the store's
    build, a world of one, waits for no request: waiter's wait is never called)."""

    timeout = 120.0

    def __init__(self):
        from mpi_kvstore.comm.mpiabi import MPI
        self.comm, self.lost = MPI.COMM_WORLD, None

    def check(self, what='collective'):
        if self.lost:
            raise RuntimeError('%s: %s' % (what, self.lost))

    def waiter(self, what, deadline=None):
        def wait(request, keep=()):
            raise AssertionError('a world of one waited for %s' % what)
        return wait


def test_an_elastic_store_polls_every_wait_on_the_flat_communicator():
    from mpi_kvstore.store.kvstore import elastic_options
    got = elastic_options({'progress_sleep_us': 0, 'hierarchical': 'on', 'fusion_threshold': 7})
    assert got['progress_sleep_us'] == 200.0 and got['progress_min_bytes'] == 0
    assert (got['hierarchical'], got['autotune'], got['tune_table']) == ('off', False, '')
    assert (got['stall_warning'], got['stall_abort'], got['fusion_threshold']) == (0.0, 0.0, 7)
    assert elastic_options({'progress_sleep_us': 50.0})['progress_sleep_us'] == 50.0


def test_an_elastic_store_refuses_a_design_whose_waits_are_not_polled():
    import mpi_kvstore
    from mpi_kvstore.errors import ConfigError
    with pytest.raises(ConfigError, match="design 'chained' cannot run on an elastic world"):
        mpi_kvstore.create('dist_mpi', world=_FakeWorld(), design='chained')


def test_a_lost_world_fails_every_call_until_the_reset_and_the_store_goes_on_after_it():
    import mxnet as mx

    import mpi_kvstore
    world = _FakeWorld()
    with mpi_kvstore.create('dist_mpi', world=world) as kv:
        x = mx.nd.full((5,), 2.0)
        kv.pushpull('g', x)
        assert x.asnumpy().tolist() == [2.0] * 5
        world.lost = 'worker 1 lost'
        with pytest.raises(RuntimeError, match='worker 1 lost'):
            kv._job.check_world()
        for _ in range(2):   # every call fails, with the world's error type
            with pytest.raises(RuntimeError, match=r'the world failed: .*worker 1 lost'):
                kv.pushpull('g', x)
        world.lost = None
        kv.reset()
        assert (kv.rank, kv.num_workers, kv.design) == (0, 1, 'funneled')
        y = mx.nd.full((3,), 4.0)
        kv.pushpull('h', y)
        assert y.asnumpy().tolist() == [4.0] * 3


def test_a_store_without_a_world_needs_the_communicator_to_reset_on():
    import mpi_kvstore
    from mpi_kvstore.comm.mpiabi import MPI
    with mpi_kvstore.create('dist_mpi') as kv:
        with pytest.raises(ValueError, match='give the new communicator'):
            kv.reset()
        kv.reset(MPI.COMM_WORLD)
        assert (kv.rank, kv.num_workers) == (0, 1)
