"""Jobs on a test bed: one command with a hard timeout, and MPI jobs across the hosts.

Every job runs in a session of its own and carries RUN_VAR in its environment: at
the end, SIGTERM then SIGKILL to its group, then SIGKILL to any process still
carrying its id (ranks that hydra started in sessions of their own).

MPICH's hydra reaches the hosts through a launcher script that stands in for ssh
(``mpiexec -launcher ssh -launcher-exec PREFIX/launch``); TCP_ENV makes ranks on
different hosts talk real TCP over the links.
"""
import contextlib
import functools
import os
import shlex
import subprocess
import tempfile
import time
import uuid

from mpi_kvstore.launch.processes import kill_marked, marked_environ, start_group, wait_or_stop

from .machine import TestbedError, find_mpiexec, is_hydra, need_tool
from .network import IFACE, run_dir

# Real TCP between ranks on different hosts: MPICH's default (UCX with every
# transport) finds the shared memory of the one kernel even across namespaces.
TCP_ENV = {'MPICH_CH4_NETMOD': 'ucx', 'UCX_TLS': 'tcp', 'UCX_NET_DEVICES': IFACE}

DEFAULT_TIMEOUT = 600.0      # seconds for one job run through the test bed
KILL_GRACE = 5.0             # seconds a job gets after SIGTERM before SIGKILL
LEFTOVER_GRACE = 1.0         # seconds processes of an ended job get to exit
RUN_VAR = 'MKVTB_RUN_ID'     # every process of one job carries it: finds leftovers


class RunResult:
    """How a job run through the test bed ended."""

    def __init__(self, argv, returncode, output, timed_out, elapsed, leftovers):
        self.argv, self.returncode, self.output = argv, returncode, output
        self.timed_out, self.elapsed, self.leftovers = timed_out, elapsed, leftovers

    @property
    def ok(self):
        return self.returncode == 0 and not self.timed_out

    def check(self, tail=4000):
        """Self, or TestbedError with the tail of the output when the job failed."""
        if not self.ok:
            what = ('timed out after %.0f s' % self.elapsed if self.timed_out
                    else 'exited with status %d' % self.returncode)
            raise TestbedError('%s %s\n--- output tail ---\n%s'
                               % (shlex.join(self.argv), what, (self.output or '')[-tail:]))
        return self

    def __repr__(self):
        return '<RunResult status=%s timed_out=%s %.1f s>' % (
            self.returncode, self.timed_out, self.elapsed)


def run_job(argv, timeout=DEFAULT_TIMEOUT, env=None, stream=False, cwd=None):
    """Run ARGV in a session of its own with a hard TIMEOUT; no process of it survives.

    ENV overrides the environment (a value of None removes a variable). STREAM:
    output goes to ours as it comes, else it is collected into the result.
    """
    run_id = uuid.uuid4().hex
    child = marked_environ(os.environ, env, RUN_VAR, run_id)
    start = time.monotonic()
    # A file, not a pipe: a process that outlived the job would keep a pipe open.
    # Streamed output goes to ours: no file (None).
    with contextlib.nullcontext() if stream else tempfile.TemporaryFile() as log:
        proc = start_group(argv, stdin=subprocess.DEVNULL, stdout=log,
                           stderr=None if stream else subprocess.STDOUT, env=child, cwd=cwd)
        try:
            returncode, timed_out = wait_or_stop(proc, timeout, KILL_GRACE)
        finally:
            leftovers = kill_marked(RUN_VAR, run_id, LEFTOVER_GRACE)
        output = ''
        if log is not None:
            log.seek(0)
            output = log.read().decode('utf-8', 'replace')
    if leftovers:
        output += '\n[testbed] killed %d leftover process(es)\n' % len(leftovers)
    return RunResult(list(argv), returncode, output, timed_out,
                     time.monotonic() - start, len(leftovers))


_LAUNCH_SCRIPT = '''#!/bin/sh
# Stand-in for ssh, for MPICH's hydra: mpiexec -launcher ssh -launcher-exec THIS ...
# Runs a command line on one host of test bed {prefix}, that is inside its
# namespaces. Called as: THIS [-x] HOST WORDS...; as with ssh, the words are
# joined by spaces and run by a shell "on the host".
while [ $# -gt 0 ]; do
  case $1 in
    -o|-p|-l|-i|-F) shift 2 ;;
    -*) shift ;;
    *) break ;;
  esac
done
if [ $# -lt 2 ]; then
  echo "$0: usage: $0 [-x] HOST COMMAND..." >&2
  exit 255
fi
host=$1
shift
case $host in
{cases}
  *) echo "$0: $host is not a host of test bed {prefix}" >&2; exit 255 ;;
esac
exec {nsenter} --uts="$uts" -- {ip} netns exec "$ns" /bin/sh -c "$*"
'''

_MPIEXEC_SCRIPT = '''#!/bin/sh
# mpiexec across the hosts of test bed {prefix}, started on {first} over real TCP.
# Usage: THIS [-ppn K] -n N PROGRAM ARGS...  (any hydra options)
exec {argv} "$@"
'''


def _write_executable(path, text):
    with open(path, 'w') as f:
        f.write(text)
    os.chmod(path, 0o755)


class HostJobs:
    """Running commands and MPI jobs on the hosts of a test bed: the part of Hosts.

    Needs from the class it is mixed into: prefix, names, timeout, namespace(),
    address(), uts_file(), _index() and _need_prefix().
    """

    @property
    def launcher(self):
        """The ssh stand-in for ``mpiexec -launcher ssh -launcher-exec``."""
        return os.path.join(run_dir(self._need_prefix()), 'launch')

    @property
    def mpiexec_wrapper(self):
        """A script: mpiexec over TCP across all hosts, started on h0; None without mpiexec."""
        path = os.path.join(run_dir(self._need_prefix()), 'mpiexec')
        return path if os.path.exists(path) else None

    def _write_scripts(self):
        cases = '\n'.join('  %s|%s|%s) ns=%s uts=%s ;;' % (
            name, self.namespace(i), self.address(i), self.namespace(i), self.uts_file(i))
            for i, name in enumerate(self.names))
        _write_executable(self.launcher, _LAUNCH_SCRIPT.format(
            prefix=self.prefix, cases=cases, nsenter=need_tool('nsenter'), ip=need_tool('ip')))
        mpiexec = find_mpiexec()
        if mpiexec and is_hydra(mpiexec):
            argv = self.mpiexec_argv(None, mpiexec=mpiexec)
            _write_executable(os.path.join(run_dir(self.prefix), 'mpiexec'),
                              _MPIEXEC_SCRIPT.format(prefix=self.prefix, first=self.names[0],
                                                     argv=shlex.join(argv)))

    def exec_argv(self, host, argv=()):
        """ARGV run on HOST: in its network namespace (and /etc/hosts) and hostname."""
        return [need_tool('nsenter'), '--uts=%s' % self.uts_file(host), '--',
                need_tool('ip'), 'netns', 'exec', self.namespace(host)] + [str(a) for a in argv]

    def mpiexec_argv(self, nprocs, ppn=None, hosts=None, tcp=True, mpiexec=None, extra=()):
        """The argv that starts NPROCS ranks across HOSTS (default: all), program not included.

        mpiexec runs on the first of HOSTS and reaches the others through the ssh
        stand-in. Ranks go round-robin over the hosts, or PPN to a host in turn.
        TCP: inter-host traffic is real TCP over the links (TCP_ENV); otherwise
        MPICH's defaults, which use shared memory between the namespaces.
        NPROCS None leaves ``-n`` out (for wrappers).
        """
        hosts = [self.names[self._index(h)] for h in (hosts or self.names)]
        mpiexec = mpiexec or find_mpiexec()
        if mpiexec is None or not is_hydra(mpiexec):
            raise TestbedError('the test bed launches with MPICH hydra; mpiexec: %s' % mpiexec)
        argv = self.exec_argv(hosts[0], [mpiexec, '-launcher', 'ssh', '-launcher-exec',
                                         self.launcher, '-hosts', ','.join(hosts)])
        if ppn:
            argv += ['-ppn', str(ppn)]
        if tcp:
            for name, value in TCP_ENV.items():
                argv += ['-genv', name, value]
        argv += [str(a) for a in extra]
        if nprocs is not None:
            argv += ['-n', str(nprocs)]
        return argv

    def hydra_argv(self, tcp=True, mpiexec=None):
        """mpiexec with the ssh stand-in (and TCP_ENV), without ``-hosts`` or ``-n``: for a
        launcher that names each launch's host itself, such as ``python -m mpi_kvstore run
        --elastic --launcher ...`` (``-hosts H`` for a host other than its own). Run it on a
        host of the test bed (``exec_argv``): hydra's proxies connect back to its host."""
        mpiexec = mpiexec or find_mpiexec()
        if mpiexec is None or not is_hydra(mpiexec):
            raise TestbedError('the test bed launches with MPICH hydra; mpiexec: %s' % mpiexec)
        argv = [mpiexec, '-launcher', 'ssh', '-launcher-exec', self.launcher]
        for name, value in TCP_ENV.items() if tcp else ():
            argv += ['-genv', name, value]
        return argv

    def launcher_for(self, ppn=None, **kwargs):
        """A function of nprocs giving mpiexec_argv (for tests/mpi_harness.run_mpi)."""
        return functools.partial(self.mpiexec_argv, ppn=ppn, **kwargs)

    def run(self, argv, host=None, timeout=None, env=None, stream=False, cwd=None):
        """Run ARGV (on HOST when given, else as is) with a timeout; a RunResult."""
        if host is not None:
            argv = self.exec_argv(host, argv)
        return run_job(argv, timeout=self.timeout if timeout is None else timeout,
                       env=env, stream=stream, cwd=cwd)

    def mpirun(self, nprocs, argv, ppn=None, hosts=None, tcp=True, timeout=None, env=None,
               stream=False, cwd=None):
        """ARGV on NPROCS ranks across the hosts (see mpiexec_argv); a RunResult."""
        return self.run(self.mpiexec_argv(nprocs, ppn=ppn, hosts=hosts, tcp=tcp) + list(argv),
                        timeout=timeout, env=env, stream=stream, cwd=cwd)
