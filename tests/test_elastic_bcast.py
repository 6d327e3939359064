"""A worker lost inside the store's broadcast, barrier or object collective, in memory
(tests/scenarios/elastic_bcast.py under ``python -m mpi_kvstore run --elastic``, every job
under a timeout, nothing left running).

3 workers train a small Gluon model; after each update every rank but rank 1 spoils its
weights and the step's collective runs with rank 1 as its root (hvd.broadcast_parameters,
kv.broadcast), or the step broadcasts and gathers objects, or waits at the store's barrier.
Worker 1 is SIGKILLed in step 6 on the store's thread, as that collective's MPI call starts:
the survivors are inside it (a blocking MPI_Bcast or MPI_Barrier would wait for worker 1
forever). They get HorovodInternalError from that call, restore the commit of step 4,
re-form a world of 2 and end bitwise equal to each other and equal, within float32
rounding, to an uninterrupted 3-worker run (and to numpy's replay of its last update).
"""
import os

import numpy as np
import pytest

import mpi_harness
from mpi_harness import SCENARIOS_DIR, npz_arrays, workers_agree

TIMEOUT = 150
SCRIPT = os.path.join(SCENARIOS_DIR, 'elastic_bcast.py')
STEPS = 10


def run_elastic(out, *script_args):
    """The scenario's elastic job of 3 workers -> its output (status 0, nothing left)."""
    return mpi_harness.run_elastic(SCRIPT, out, '--steps', STEPS, *script_args, timeout=TIMEOUT)


@pytest.fixture(scope='module')
def uninterrupted(tmp_path_factory, mpi_available):
    """The weights of 3 workers trained without a loss, broadcasting the weights each step."""
    out = tmp_path_factory.mktemp('ref') / 'w'
    run_elastic(out, '--op', 'params')
    got = workers_agree(out, range(3))
    assert np.abs(got[0]).max() > 1e-3   # weights that trained, not zeros
    return got


@pytest.mark.parametrize('op,where', [('params', 'bcast_host'), ('kv', 'bcast_host'),
                                      ('object', 'run_custom'), ('barrier', 'barrier')])
def test_survivors_of_a_worker_lost_inside_a_blocking_collective_go_on(tmp_path, op, where,
                                                                       uninterrupted):
    out = run_elastic(tmp_path / 'w', '--op', op, '--kill-id', 1, '--kill-at', 6)
    assert 'worker 1: dies in step 6, in %s' % where in out, out[-4000:]
    assert 'worker 1 on localhost was lost (status 9)' in out, out[-4000:]
    for worker, rank in ((0, 0), (2, 1)):
        # the call itself raised: the survivor was inside it when worker 1 died
        assert ("worker %d: %s in step 6 raised HorovodInternalError: the world failed: the "
                "store's collectives: worker(s) [1] lost" % (worker, op)) in out, out[-4000:]
        assert 'worker %d: reset at step 4, rank %d of 2, kv %d of 2' % (worker, rank, rank) \
            in out, out[-4000:]
        assert 'worker %d: finished at rank %d of 2' % (worker, rank) in out, out[-4000:]
    assert not (tmp_path / 'w.1.npz').exists()
    survivors = [npz_arrays(tmp_path / ('w.%d.npz' % worker)) for worker in (0, 2)]
    for mine, theirs, want in zip(*survivors, uninterrupted):
        assert np.array_equal(mine, theirs)
        assert np.allclose(mine, want, rtol=1e-5, atol=1e-6), np.abs(mine - want).max()


def test_the_polled_forms_match_mpi_on_a_world_of_one():
    """One process: comm.host's abortable broadcast and barrier, and PolledComm's object and
    buffer collectives, give what mpi4py's blocking calls give."""
    from mpi_kvstore.comm.host import Comm, PolledComm
    from mpi_kvstore.comm.mpiabi import MPI
    comm = Comm(MPI.COMM_WORLD, 'off', (200.0, 0)).abortable()
    try:
        buf = np.arange(5.0)
        comm.bcast_host(buf, 0)
        comm.barrier()
        assert buf.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
        assert comm.broadcast_choice(40).algorithm == 'polled'
        polled = PolledComm(comm.mpi, 200.0)
        obj = {'a': [1, 2.5], 'b': 'x' * 5000}
        assert polled.bcast(obj, root=0) == comm.mpi.bcast(obj, root=0)
        assert polled.allgather(obj) == comm.mpi.allgather(obj) == [obj]
        assert polled.alltoall([obj]) == comm.mpi.alltoall([obj])
        with pytest.raises(ValueError, match='2 objects for 1 ranks'):
            polled.alltoall([obj, obj])
        send, got, want = np.arange(4.0), np.empty(4), np.empty(4)
        polled.Allreduce(send, got, op=MPI.SUM)
        comm.mpi.Allreduce(send, want, op=MPI.SUM)
        assert got.tolist() == want.tolist()
        polled.barrier()
        assert polled.Get_size() == 1
    finally:
        comm.free()


def test_twenty_store_resets_leave_memory_descriptors_and_threads_flat(tmp_path, mpi_available):
    """3 workers re-form their world and rebuild their store 20 times (a host update at each
    commit), each step a pushpull, a broadcast, an object broadcast and gather and a barrier:
    from the first reset to the last each grows by at most 20 MB of RSS and 10 file
    descriptors, keeps its thread count, and the sum trained is exact (22 steps of 6 x 1000)."""
    out = mpi_harness.run_elastic('elastic_bcast_soak.py', '--resets', 20, timeout=TIMEOUT,
                                  job_timeout=480)
    found = mpi_harness.soak_growth(out)
    assert sorted(f[0] for f in found) == [0, 1, 2], out[-3000:]
    for worker, resets, rss, fds, before, after, total in found:
        assert resets == 20, (worker, resets)
        assert rss <= 20.0 and fds <= 10, (worker, rss, fds)
        assert before == after, (worker, before, after)
        assert total == 22 * 6 * 1000.0, (worker, total)
