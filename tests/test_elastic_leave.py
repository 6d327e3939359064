"""A worker whose world lost a peer leaves without MPI_Finalize (elastic/leave.py): its
stores closed, its output flushed, status 0, or 1 after an uncaught exception; the exit
hooks registered before (mpi4py's finalize among them) do not run."""
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.unit

PROGRAM = textwrap.dedent('''
    import atexit, sys
    marker = sys.argv[1]
    atexit.register(lambda: open(marker, 'w').write('ran'))   # runs last, if at all
    import mxnet as mx
    import mpi_kvstore
    from mpi_kvstore.elastic import leave
    kv = mpi_kvstore.create('dist_mpi')
    x = mx.nd.arange(4)
    kv.pushpull(0, x)             # left in flight: the exit must finish it first
    if sys.argv[2] != 'plain':
        leave.without_finalize()
    print('armed', leave.armed(), flush=False)   # flushed by the exit
    print('sum', x.asnumpy().tolist())
    if sys.argv[2] == 'raise':
        raise ValueError('the program failed')
''')


def run(tmp_path, mode):
    marker = tmp_path / ('hook-' + mode)
    proc = subprocess.run([sys.executable, '-c', PROGRAM, str(marker), mode],
                          capture_output=True, text=True, timeout=120)
    return proc, marker.exists()


def test_an_armed_worker_leaves_with_0_without_the_earlier_exit_hooks(tmp_path):
    proc, hook_ran = run(tmp_path, 'armed')
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert 'armed True' in proc.stdout and 'sum [0.0, 1.0, 2.0, 3.0]' in proc.stdout
    assert not hook_ran


def test_an_armed_worker_that_raises_leaves_with_1_and_its_traceback(tmp_path):
    proc, hook_ran = run(tmp_path, 'raise')
    assert proc.returncode == 1
    assert 'ValueError: the program failed' in proc.stderr
    assert 'armed True' in proc.stdout and not hook_ran


def test_a_worker_not_armed_runs_every_exit_hook(tmp_path):
    proc, hook_ran = run(tmp_path, 'plain')
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert 'armed False' in proc.stdout and hook_ran
