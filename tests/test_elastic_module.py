"""A Module trained by elastic.State.fit in memory (tests/scenarios/elastic_module_loss.py
under ``python -m mpi_kvstore run --host-discovery-script S``, every job under a timeout,
nothing left running).

2 hosts train; the test lists a third, whose worker joins at the commit of step 3 (the two
wait there for it): it takes the Module's weights and optimizer states by the State's sync
and its store's keys by init_optimizer, while the others give their rebuilt store the same.
Then worker 1 is SIGKILLed after its backward pass of step 10, before its update: each
survivor's first read of each of the Module's parameters raises HorovodInternalError
(LostWorldRead), even a read begun before the loss poisoned the arrays, and its second read
gives NaN or the error again, never the value of before the step; the survivors restore the
commit of step 9 and finish at 2. The update does not depend on the number of workers, so
they end bitwise equal to each other and equal, within float32 rounding, to one process's
Module.fit on the whole batches. The optimizer runs in the store (MXNet's default for a
distributed store), or on the ranks (``local-updates``, MXNET_UPDATE_ON_KVSTORE=0: the Module
pushpulls each gradient): there a survivor's next step's pushpulls may be skipped by MXNet
(their gradients come from the failed step), and the reset must not wait for them.
"""
import os
import subprocess
import sys

import numpy as np
import pytest
from test_elastic_hosts import Job

from mpi_harness import REPO_ROOT, SCENARIOS_DIR, npz_arrays

SCRIPT = os.path.join(SCENARIOS_DIR, 'elastic_module_loss.py')
KILL_AT = 10
PARAMS = 4   # fc1 and fc2: weight and bias each


def reference(tmp_path):
    out = tmp_path / 'w'
    subprocess.run([sys.executable, SCRIPT, str(out), '--reference'], check=True, timeout=120,
                   cwd=REPO_ROOT, env=dict(os.environ, OMP_NUM_THREADS='1'))
    return npz_arrays('%s.ref.npz' % out)


@pytest.mark.parametrize('local', [False, True], ids=['store-updates', 'local-updates'])
def test_a_module_job_that_a_worker_joins_then_loses_a_worker(tmp_path, mpi_available, local):
    job = Job(tmp_path, '127.0.0.1:1\n127.0.0.2:1\n', '--min-np', 2, '--max-np', 3,
              script=SCRIPT, script_args=('--wait-at', 3, '--wait-for', 3, '--kill-id', 1,
                                          '--kill-at', KILL_AT)
              + (('--local-updates',) if local else ()))
    job.wait_for(r'worker 0: step 2 done')
    job.set_hosts('127.0.0.1:1\n127.0.0.2:1\n127.0.0.3:1\n')
    status, out = job.finish()
    assert status == 0, out[-4000:]
    assert 'worker 2: joined at rank 2 of 3' in out, out[-4000:]
    assert 'worker 0: reset at step 3, rank 0 of 3' in out, out[-4000:]   # no rollback
    assert 'worker 2: step 4 done (2 of 3)' in out, out[-4000:]
    assert 'worker 1 on 127.0.0.2 was lost (status 9)' in out, out[-4000:]
    raised = 'worker %d: %s read %d raised LostWorldRead (HorovodInternalError True)'
    nan = 'worker %d: %s read %d gave NaN values'
    for worker in (0, 2):
        for index in range(PARAMS):
            assert raised % (worker, 'first', index) in out, (worker, index, out[-4000:])
            assert (nan % (worker, 'second', index) in out
                    or raised % (worker, 'second', index) in out), (worker, index, out[-4000:])
    assert 'gave finite' not in out and 'gave mixed' not in out, out[-4000:]
    assert 'never reached their engine op' not in out, out[-4000:]   # the drain's 120 s
    assert 'worker 0: reset at step 9, rank 0 of 2' in out, out[-4000:]
    assert 'worker 2: reset at step 9, rank 1 of 2' in out, out[-4000:]
    for worker, rank in ((0, 0), (2, 1)):
        assert 'worker %d: step 18 done (%d of 2)' % (worker, rank) in out, out[-4000:]
        assert 'worker %d: finished at rank %d of 2' % (worker, rank) in out, out[-4000:]
    assert not (tmp_path / 'w.1.npz').exists()
    survivors = [npz_arrays(tmp_path / ('w.%d.npz' % worker)) for worker in (0, 2)]
    want = reference(tmp_path)
    assert len(want) == PARAMS
    for mine, theirs, single in zip(*survivors, want):
        assert np.array_equal(mine, theirs)
        assert np.allclose(mine, single, rtol=1e-5, atol=1e-6), np.abs(mine - single).max()
        assert np.abs(single).max() > 1e-3
