"""What this machine offers a test bed: root, the tools, namespaces, tbf, MPICH's hydra.

Also how the test bed runs a tool while building (sh): a failure is a TestbedError
that names the command and what it said.
"""
import functools
import os
import shlex
import shutil
import subprocess
import sys


class TestbedError(RuntimeError):
    """The test bed could not be built, used or torn down."""

    __test__ = False   # not a pytest test class


def which(tool):
    """The path of TOOL, from the sbin directories first (root's tools), else PATH; or None."""
    for directory in ('/usr/sbin', '/sbin', '/usr/bin', '/bin'):
        path = os.path.join(directory, tool)
        if os.access(path, os.X_OK):
            return path
    return shutil.which(tool)


def need_tool(tool):
    """The path of TOOL, or TestbedError."""
    path = which(tool)
    if path is None:
        raise TestbedError('the test bed needs %s on PATH' % tool)
    return path


def sh(*argv):
    """Run ARGV; its stdout, or TestbedError with what it said on failure."""
    proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0:
        raise TestbedError('%s: %s' % (shlex.join(argv), (proc.stderr or proc.stdout).strip()))
    return proc.stdout


def find_mpiexec():
    """mpiexec beside this interpreter (the venv's 'mpich' wheel), else on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), 'mpiexec')
    if os.access(beside, os.X_OK):
        return beside
    return shutil.which('mpiexec')


@functools.cache
def is_hydra(mpiexec):
    try:
        out = subprocess.run([mpiexec, '--version'], stdin=subprocess.DEVNULL,
                             capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return 'HYDRA' in out


def _probe(argv):
    """'' when ARGV runs, else why not."""
    try:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        return str(err)
    if proc.returncode != 0:
        return (proc.stderr or proc.stdout).strip() or 'exit status %d' % proc.returncode
    return ''


@functools.cache
def available(rate=False, mpi=False):
    """(True, '') where a test bed can be built here, else (False, why not).

    RATE: links will be shaped (needs tc and the tbf qdisc). MPI: jobs will be
    launched across the hosts (needs MPICH's hydra mpiexec). Probes in throwaway
    namespaces, which vanish with the probe.
    """
    if not sys.platform.startswith('linux'):
        return False, 'the test bed needs Linux network namespaces'
    if os.geteuid() != 0:
        return False, 'the test bed needs root (it creates network namespaces)'
    tools = ['ip', 'nsenter', 'unshare', 'umount'] + (['tc'] if rate else [])
    missing = [tool for tool in tools if which(tool) is None]
    if missing:
        return False, 'the test bed needs %s on PATH' % ', '.join(missing)
    unshare, ip = which('unshare'), which('ip')
    probes = [[unshare, '--net', '--uts', '--', ip, 'link', 'add', 'p0', 'type', 'veth',
               'peer', 'name', 'p1'],
              [unshare, '--net', '--', ip, 'link', 'add', 'b0', 'type', 'bridge']]
    if rate:
        probes.append([unshare, '--net', '--', which('tc'), 'qdisc', 'add', 'dev', 'lo',
                       'root', 'tbf', 'rate', '1gbit', 'burst', '32kb', 'latency', '10ms'])
    for argv in probes:
        why = _probe(argv)
        if why:
            return False, 'cannot build a test bed here: %s: %s' % (' '.join(argv[4:]), why)
    if mpi:
        mpiexec = find_mpiexec()
        if mpiexec is None:
            return False, 'no mpiexec beside %s nor on PATH' % sys.executable
        if not is_hydra(mpiexec):
            return False, '%s is not MPICH hydra (the test bed launches with hydra)' % mpiexec
    return True, ''
