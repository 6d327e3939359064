"""The root's MPI ports across formings (mpi_kvstore.elastic.forming.open_port) and the
launcher's stand-in that comes too late (elastic/standin.py), with real launches: each worker
and the stand-in is its own ``mpiexec -n 1``, each under a timeout.

A connect sends its request to the port's address and tag at once; with no accept on the
port it waits in the root's queue. MPICH reuses a closed port's name, so the next forming's
accept took that request and crashed the root (SIGSEGV, MPICH 5.0.2); a stand-in's connect
had no bound of its own and waited MPICH's 180 s.
"""
import os
import signal
import subprocess
import sys
import time

import numpy as np
from test_elastic_run import run_world

from mpi_kvstore.launch import rendezvous

from mpi_harness import SCENARIOS_DIR

SCRIPT = os.path.join(SCENARIOS_DIR, 'elastic_world_ports.py')
STANDIN = os.path.join(os.path.dirname(rendezvous.__file__), '..', 'elastic', 'standin.py')


def _sum(generation):
    return sum(np.random.RandomState(worker + 10 * generation).uniform(-1, 1, 8)
               .astype(np.float32) for worker in (0, 1))


def test_a_stand_in_with_no_accept_ends_and_the_next_forming_admits_its_worker(
        tmp_path, mpi_available):
    """Workers 0 and 1 form generation 0 and wait. A stand-in for worker 1's admission to it
    connects to the root's port with nothing to accept it: it ends at its 2 s timeout with
    status 4. The two then re-form (generation 1, worker 0 accepts worker 1 again) and the
    allreduce of each generation equals numpy's sum."""
    log = tmp_path / 'log'
    out = tmp_path / 'w'
    standin = {}

    def before(workers):
        workers.start()
        ends = time.monotonic() + 120
        while log.read_text(errors='replace').count('formed generation 0') < 2:
            assert time.monotonic() < ends and all(
                workers.running(worker) for worker in (0, 1)), log.read_text()[-3000:]
            time.sleep(0.05)
        env = dict(workers.env, **{rendezvous.SECRET_ENV: workers.secret})
        started = time.monotonic()
        with open(tmp_path / 'standin.log', 'wb') as standin_log:
            proc = subprocess.Popen(['mpiexec', '-n', '1', sys.executable, STANDIN,
                                     workers.directory, '0', '1', '2'], env=env,
                                    stdout=standin_log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                status = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:   # MPICH's own 180 s: it never ends in time
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                status = None
        standin.update(status=status, seconds=time.monotonic() - started,
                       output=(tmp_path / 'standin.log').read_text(errors='replace')[-2000:])
        (tmp_path / 'w.go').write_text('')

    statuses, output, _ = run_world(tmp_path, 2, str(out), script=SCRIPT, before=before)
    assert standin['status'] == 4, standin
    assert standin['seconds'] < 30, standin
    assert statuses == {0: 0, 1: 0}, (statuses, output[-3000:])
    assert 'worker 1: re-formed generation 1, rank 1 of 2' in output, output[-3000:]
    for generation in (0, 1):
        want = _sum(generation)
        for worker in (0, 1):
            got = np.load(tmp_path / ('w.%d.%d.npy' % (worker, generation)))
            assert np.allclose(got, want, rtol=1e-6, atol=1e-6), (worker, generation, got, want)
