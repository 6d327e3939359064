"""Workers that join a running job training through the store, then a worker lost
(tests/scenarios/elastic_join.py under ``python -m mpi_kvstore run --host-discovery-script
S``, every job under a timeout, nothing left running).

2 hosts train; the test lists a third, whose worker joins at a commit (the two wait after
step 6 for it) while their store, their trainer's first-step broadcast and their optimizer
states are long under way; then worker 1 is SIGKILLed after its backward pass of step 10,
the survivors restore the commit of step 9 and finish at 2. The update does not depend on
the number of workers, so the survivors end bitwise equal to each other and equal, within
float32 rounding, to one process trained on every step's whole batch (the scenario's
--reference). Through hvd.DistributedTrainer (SGD with momentum on the ranks) with the
supervisor's --state-dir (the newcomer takes the state from rank 0, not from the disk); and
through gluon.Trainer with Adam in the store, its states sharded (cut anew for 3 ranks, then
for 2, from the states carried over the reset and from the commit).
"""
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from test_elastic_hosts import Job

from mpi_harness import REPO_ROOT, SCENARIOS_DIR, npz_arrays

SCRIPT = os.path.join(SCENARIOS_DIR, 'elastic_join.py')
STEPS = 16
KILL_AT = 10


def reference(tmp_path, *script_args):
    out = tmp_path / 'w'
    subprocess.run([sys.executable, SCRIPT, str(out), '--reference', '--steps', str(STEPS),
                    *script_args], check=True, timeout=120, cwd=REPO_ROOT,
                   env=dict(os.environ, OMP_NUM_THREADS='1'))
    return npz_arrays('%s.ref.npz' % out)


@pytest.mark.parametrize('api,extra', [('hvd', ()), ('kv', ()), ('kvopt', ()),
                                       ('kvopt', ('--shard',))])
def test_a_newcomer_joins_a_job_training_through_the_store_then_a_worker_is_lost(
        tmp_path, api, extra, mpi_available):
    options = ('--min-np', 2, '--max-np', 3)
    if api == 'hvd':
        options += ('--state-dir', tmp_path / 'ckpt')
    job = Job(tmp_path, '127.0.0.1:1\n127.0.0.2:1\n', *options, script=SCRIPT,
              script_args=('--api', api, '--steps', STEPS, '--wait-at', 6, '--wait-for', 3,
                           '--kill-id', 1, '--kill-at', KILL_AT, *extra))
    job.wait_for(r'worker 0: step 2 done')
    job.set_hosts('127.0.0.1:1\n127.0.0.2:1\n127.0.0.3:1\n')
    status, out = job.finish()
    assert status == 0, out[-4000:]
    assert 'worker 2: joined at rank 2 of 3' in out, out[-4000:]
    assert 'worker 0: reset at step 6, rank 0 of 3' in out, out[-4000:]   # no rollback
    assert 'worker 2: step 7 done (2 of 3)' in out, out[-4000:]
    assert 'worker 1 on 127.0.0.2 was lost (status 9)' in out, out[-4000:]
    assert 'worker 0: reset at step 9, rank 0 of 2' in out, out[-4000:]
    assert 'worker 2: reset at step 9, rank 1 of 2' in out, out[-4000:]
    for worker, rank in ((0, 0), (2, 1)):
        assert 'worker %d: finished at rank %d of 2' % (worker, rank) in out, out[-4000:]
    assert not (tmp_path / 'w.1.npz').exists()
    if api == 'hvd':   # commits on disk, which the newcomer did not restore
        assert re.search(r'joining a running job: the state comes from rank 0', out)
        assert 'restored commit' not in out
    if extra:
        for worker in (0, 2):
            assert 'worker %d: sharded keys 3' % worker in out, out[-4000:]
    survivors = [npz_arrays(tmp_path / ('w.%d.npz' % worker)) for worker in (0, 2)]
    want = reference(tmp_path, '--api', api)
    for mine, theirs, single in zip(*survivors, want):
        assert np.array_equal(mine, theirs)
        assert np.allclose(mine, single, rtol=1e-5, atol=1e-6), np.abs(mine - single).max()
        assert np.abs(single).max() > 1e-3


def test_a_slot_dropped_from_a_job_with_sharded_states_in_the_store(tmp_path, mpi_available):
    """localhost:3, then localhost:2, Adam in the store with its states sharded: worker 2
    leaves at the next commit (hosts removed only: no rollback), the store rebuilt for 2 gets
    back the weights and the states of that moment, cut for 2, and both end equal to one
    process."""
    job = Job(tmp_path, 'localhost:3\n', '--min-np', 2, script=SCRIPT,
              script_args=('--api', 'kvopt', '--shard', '--steps', STEPS, '--step-seconds', 0.2))
    job.wait_for(r'worker 0: step 2 done')
    job.set_hosts('localhost:2\n')
    status, out = job.finish()
    assert status == 0, out[-4000:]
    assert 'worker 2 on localhost left the job' in out, out[-4000:]
    found = re.search(r'worker 0: reset at step (\d+), rank 0 of 2', out)
    assert found and int(found.group(1)) % 3 == 0, out[-4000:]
    assert 'worker 1: reset at step %s, rank 1 of 2' % found.group(1) in out, out[-4000:]
    for worker in (0, 1):
        assert 'worker %d: sharded keys 3' % worker in out, out[-4000:]
        assert 'worker %d: finished at rank %d of 2' % (worker, worker) in out, out[-4000:]
    assert not (tmp_path / 'w.2.npz').exists()
    survivors = [npz_arrays(tmp_path / ('w.%d.npz' % worker)) for worker in (0, 1)]
    for mine, theirs, single in zip(*survivors, reference(tmp_path, '--api', 'kvopt')):
        assert np.array_equal(mine, theirs)
        assert np.allclose(mine, single, rtol=1e-5, atol=1e-6), np.abs(mine - single).max()


def test_a_job_of_one_grows_to_two(tmp_path, mpi_available):
    """One host, then two: hvd.DistributedTrainer made in a world of one exchanges from the
    start, so the newcomer's gradients meet rank 0's; both end equal to one process."""
    job = Job(tmp_path, '127.0.0.1:1\n', '--min-np', 1, '--max-np', 2, script=SCRIPT,
              script_args=('--api', 'hvd', '--steps', STEPS, '--wait-at', 6, '--wait-for', 2))
    job.wait_for(r'worker 0: step 2 done')
    job.set_hosts('127.0.0.1:1\n127.0.0.2:1\n')
    status, out = job.finish()
    assert status == 0, out[-4000:]
    assert 'worker 1: joined at rank 1 of 2' in out, out[-4000:]
    assert 'worker 0: reset at step 6, rank 0 of 2' in out, out[-4000:]
    survivors = [npz_arrays(tmp_path / ('w.%d.npz' % worker)) for worker in (0, 1)]
    for mine, theirs, single in zip(*survivors, reference(tmp_path, '--api', 'hvd')):
        assert np.array_equal(mine, theirs)
        assert np.allclose(mine, single, rtol=1e-5, atol=1e-6), np.abs(mine - single).max()
