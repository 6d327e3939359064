"""A survivor's reads of a step whose exchange a lost peer failed: every parameter's read
raises HorovodInternalError (elastic.exceptions.LostWorldRead, an MXNetError too), and a
later read gives NaN (or that error again), never a plausible value (the
step's weights were not updated); the elastic run then restores the commit and finishes
equal to one process on the whole batches (tests/scenarios/elastic_step_read.py, 2 workers
under ``python -m mpi_kvstore run --elastic``, every job under a timeout)."""
import os
import subprocess
import sys

import numpy as np
import pytest

import mpi_harness
from mpi_harness import REPO_ROOT, SCENARIOS_DIR, npz_arrays

SCRIPT = os.path.join(SCENARIOS_DIR, 'elastic_step_read.py')
STEPS = 4
PARAMS = 4   # two Dense layers: weight and bias each


def reference(tmp_path):
    out = tmp_path / 'w'
    subprocess.run([sys.executable, SCRIPT, str(out), '--reference', '--steps', str(STEPS)],
                   check=True, timeout=120, cwd=REPO_ROOT,
                   env=dict(os.environ, OMP_NUM_THREADS='1'))
    return npz_arrays('%s.ref.npz' % out)


@pytest.mark.parametrize('api', ['kvopt', 'hvd'])
def test_every_read_of_a_failed_step_raises_then_gives_nan(tmp_path, api, mpi_available):
    out = mpi_harness.run_elastic(SCRIPT, tmp_path / 'w', '--api', api, '--steps', STEPS,
                                  workers=2, timeout=90)
    for index in range(PARAMS):
        assert ('worker 0: first read %d raised LostWorldRead (HorovodInternalError True)'
                % index) in out, out[-4000:]
        # NaN, or its error once more where the first read took the failed exchange's
        # error and the poisoning came after it
        assert ('worker 0: second read %d gave NaN values' % index in out
                or 'worker 0: second read %d raised LostWorldRead (HorovodInternalError True)'
                % index in out), out[-4000:]
    assert 'gave finite' not in out and 'gave mixed' not in out, out[-4000:]
    assert 'worker 0: reset at step 1, rank 0 of 1' in out, out[-4000:]
    assert 'worker 0: finished at rank 0 of 1' in out, out[-4000:]
    mine, want = npz_arrays(tmp_path / 'w.0.npz'), reference(tmp_path)
    for got, single in zip(mine, want):
        assert np.allclose(got, single, rtol=1e-5, atol=1e-6), np.abs(got - single).max()
        assert np.abs(single).max() > 1e-3
