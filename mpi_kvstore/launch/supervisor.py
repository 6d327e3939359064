"""``python -m mpi_kvstore run``: launch an MPI job and relaunch it when a rank is lost.

    python -m mpi_kvstore run -n 4 [--hostfile F] [--max-restarts 3] [--min-np 1]
                              [--state-dir D] [--restart-on-error] -- python train.py ARGS

The job is started with the MPI launcher (mpiexec beside this Python, else on PATH; or
``--launcher srun`` / any command). When it ends, the supervisor decides from what the
ranks recorded (supervision.py) and from the exit status:

- status 0: done;
- a rank raised a Python exception in the user's code: a bug; the supervisor stops with
  the job's status (``--restart-on-error`` relaunches anyway);
- otherwise a rank was lost (a signal, a killed process, a stall abort, an MPI error): the
  whole job is relaunched after a backoff, up to ``--max-restarts`` times. With a
  hostfile, hosts whose ranks were lost, or that started no rank, are left out of the next
  launch while at least ``--min-np`` ranks remain; the job resumes at the smaller size.
- Ctrl-C (SIGINT) or SIGTERM stops the job and the supervisor, without a relaunch.

The job resumes from what it committed (elastic.State reads ``--state-dir`` through the
environment). Under the supervisor ``stall_abort`` defaults to 300 s, so that a cut link or
a hung rank ends in a relaunch, not a hang. The supervisor itself starts no MPI.

With ``--elastic`` (or ``--host-discovery-script S``) each rank is its own launch instead
(driver.py, workers.py): a lost rank is announced to the survivors, which re-form their world
in memory (mpi_kvstore.elastic.world) and go on; hosts the script adds join at the next
commit, within ``--min-np``/``--max-np``; the host of a lost rank is blacklisted, for good
or for ``--blacklist-cooldown-range``. ``--reset-limit`` bounds the resets of ``elastic.run``
in either mode.
"""
import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from . import processes, supervision
from .console import console
from .driver import Driver

__all__ = ['main', 'parse_hostfile', 'diagnose', 'Outcome']

STALL_ABORT_DEFAULT = 300.0   # s, under the supervisor, unless MPI_KVSTORE_STALL_ABORT is set
BACKOFF_MAX = 60.0            # s between launches, at most
# After a rank recorded why it aborts, the launcher normally ends the job within a second
# or two. A launcher that cannot reach a cut host may wait for it much longer: the
# supervisor ends the launch itself after this.
ABORT_GRACE = 20.0
INTERRUPTED = 128 + signal.SIGINT


class Outcome:
    """How a launch ended: ``kind`` 'ok', 'interrupted', 'error' (a bug: no relaunch) or
    'fault' (a relaunch may help); ``why``, one line; ``lost_hosts``, hosts to leave out."""

    def __init__(self, kind, why, lost_hosts=()):
        self.kind, self.why, self.lost_hosts = kind, why, sorted(set(lost_hosts))

    def __repr__(self):
        return 'Outcome(%r, %r, %r)' % (self.kind, self.why, self.lost_hosts)


def diagnose(status, started, ended, interrupted, size, hosts=None, fatal=None):
    """The :class:`Outcome` of a launch that ended with ``status``, from the records of the
    ranks (supervision.read: ``started`` and ``ended``, {rank: fields}), whether the
    supervisor was interrupted, the launch's ``size``, its ``hosts`` (None: no hostfile)
    and the last words of ranks a fatal signal ended (supervision.fatal: {rank: line})."""
    if interrupted:
        return Outcome('interrupted', 'interrupted (Ctrl-C or SIGTERM)')
    if status == 0:
        return Outcome('ok', 'finished')
    bugs = {r: f for r, f in ended.items() if f['cause'] == supervision.EXCEPTION
            and not f['fault']}
    if bugs:
        rank = min(bugs)
        return Outcome('error', 'rank %d raised %s' % (rank, bugs[rank]['detail']))
    fatal = {r: w for r, w in (fatal or {}).items() if r not in ended}
    stalls = [f for f in ended.values() if f['cause'] == supervision.STALL]
    faults = [f for f in ended.values() if f['cause'] == supervision.EXCEPTION]
    lost = _lost(ended)
    # Without a stall's view, a rank a fatal signal ended is lost, unless every rank was:
    # a cut link can make both sides fault, and no host would be left to relaunch on.
    if not stalls and set(fatal) < set(started):
        lost = set(fatal)
    lost_hosts = {started[r]['host'] for r in lost if r in started}
    if hosts is not None and started:   # a host where no rank started failed to start
        lost_hosts.update(h for h in hosts if h not in {f['host'] for f in started.values()})
    if stalls:
        why = 'stall abort: %s lost' % _ranks(lost)
    elif faults:
        rank = min(r for r, f in ended.items() if f in faults)
        why = 'rank %d failed in MPI: %s' % (rank, faults[0]['detail'])
    elif fatal:
        why = 'a fatal signal: %s' % _last_words(fatal)
    elif len(started) < size:
        why = ('%d of %d ranks started (a host failed to start?); launcher status %s'
               % (len(started), size, status))
    else:
        why = 'a rank was lost (killed by a signal, or its process died); launcher status %s' % (
            status,)
    if lost_hosts:
        why += '; host(s) %s' % ', '.join(sorted(lost_hosts))
    if fatal and (stalls or faults):
        why += '; and a fatal signal: %s' % _last_words(fatal)
    return Outcome('fault', why, lost_hosts)


def _last_words(fatal):
    """The lowest rank's last words (each names its rank), and how many others left some."""
    rank = min(fatal)
    more = len(fatal) - 1
    return fatal[rank] + (' (and %d more rank(s) left last words)' % more if more else '')


def _lost(ended):
    """The ranks lost, in the view of the lowest rank that recorded a stall and is not lost
    in its own view. A cut link splits the job in two, and each side's stall abort names
    the other: the lowest rank's side (rank 0 runs beside the launcher, as a rule) stays."""
    for rank in sorted(ended):
        fields = ended[rank]
        if fields['cause'] == supervision.STALL and rank not in fields.get('lost', ()):
            return set(fields.get('lost', ()))
    return set()


def _ranks(ranks):
    ranks = sorted(ranks)
    return ('rank(s) ' + ', '.join(map(str, ranks))) if ranks else 'no rank named'


def parse_hostfile(path):
    """[(host, slots)] of an MPICH (``host[:slots]``) or Open MPI (``host slots=N``)
    hostfile; '#' starts a comment."""
    hosts = []
    with open(path) as fh:
        for number, line in enumerate(fh, 1):
            words = line.split('#', 1)[0].split()
            if not words:
                continue
            name, slots = words[0], 1
            if ':' in name:
                name, _, count = name.partition(':')
                slots = count
            for word in words[1:]:
                if word.startswith(('slots=', 'max_slots=')):
                    slots = word.split('=', 1)[1]
                    break
            try:
                slots = int(slots)
                if slots < 1:
                    raise ValueError
            except ValueError:
                raise ValueError('%s:%d: slots must be a positive integer: %r'
                                 % (path, number, line.strip())) from None
            hosts.append((name, slots))
    if not hosts:
        raise ValueError('%s names no host' % path)
    return hosts


def _parser():
    parser = argparse.ArgumentParser(
        prog='python -m mpi_kvstore run', description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('-n', '--np', type=int, default=None,
                        help='ranks (default: the hostfile\'s slots, else 1)')
    parser.add_argument('--hostfile', help='hosts, one a line (host[:slots] or host slots=N)')
    parser.add_argument('--max-restarts', type=int, default=3,
                        help='relaunches at most (default 3)')
    parser.add_argument('--min-np', type=int, default=1,
                        help='leave lost hosts out while at least this many ranks remain '
                             '(default 1)')
    parser.add_argument('--state-dir', help='elastic.State\'s directory (the job reads it '
                        'from MPI_KVSTORE_STATE_DIR)')
    parser.add_argument('--restart-on-error', action='store_true',
                        help='relaunch after a Python exception in the user\'s code too')
    parser.add_argument('--launcher', default=None,
                        help='the MPI launcher command: mpiexec (default: beside this Python, '
                             'else on PATH), srun, or any mpiexec-like command')
    parser.add_argument('--backoff', type=float, default=1.0,
                        help='seconds before the first relaunch, doubled each time (at most '
                             '%g; default %%(default)g)' % BACKOFF_MAX)
    parser.add_argument('--elastic', action='store_true',
                        help='each rank its own launch, in one world that the survivors of a '
                             'lost rank re-form in memory and new hosts join '
                             '(mpi_kvstore.elastic.world)')
    parser.add_argument('--host-discovery-script', metavar='S',
                        help='elastic: a command that prints the hosts, host:slots a line '
                             "(Horovod's format), run every second; implies --elastic")
    parser.add_argument('--max-np', type=int, default=None,
                        help='elastic: workers at most (default: every slot found)')
    parser.add_argument('--slots', type=int, default=1,
                        help='elastic: slots of a host listed without :slots (default 1)')
    parser.add_argument('--elastic-timeout', type=float, default=600.0,
                        help='elastic: seconds to wait for --min-np workers, at the start and '
                             'after losses, before the job ends (default %(default)g)')
    parser.add_argument('--blacklist-cooldown-range', type=float, nargs=2, default=None,
                        metavar=('LOW', 'HIGH'),
                        help='elastic: a host where a worker failed is out for LOW seconds, '
                             'twice as long after each further failure, at most HIGH, then '
                             'takes workers again if the script lists it (default: out for '
                             'good)')
    parser.add_argument('--reset-limit', type=int, default=0,
                        help='resets elastic.run allows before it gives up (default 0: no '
                             'limit)')
    parser.add_argument('command', nargs=argparse.REMAINDER,
                        help='-- then the program and its arguments')
    return parser


def _launcher(words):
    if words:
        return shlex.split(words)
    beside = os.path.join(os.path.dirname(sys.executable), 'mpiexec')
    if os.access(beside, os.X_OK):
        return [beside]
    found = shutil.which('mpiexec') or shutil.which('mpirun')
    if found is None:
        raise SystemExit('mpi_kvstore run: no mpiexec beside %s nor on PATH; give --launcher'
                         % sys.executable)
    return [found]


def launch_argv(launcher, nprocs, hosts, hostfile_path, command):
    """The argv of one launch: srun's form or mpiexec's (``-hostfile``, understood by
    MPICH's hydra and by Open MPI)."""
    if os.path.basename(launcher[0]) == 'srun':
        argv = launcher + ['-n', str(nprocs)]
        if hosts is not None:
            argv += ['--nodelist', ','.join(h for h, _ in hosts)]
        return argv + command
    argv = list(launcher)
    if hosts is not None:
        argv += ['-hostfile', hostfile_path]
    return argv + ['-n', str(nprocs)] + command


class _Signals:
    """Ctrl-C and SIGTERM stop the launch (forwarded to its process group) and the loop."""

    def __init__(self):
        self.received = None
        self.job = None
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, sig, frame):
        self.received = sig
        if self.job is not None:
            processes.signal_group(self.job.pid, sig)


# Every process of a launch inherits this variable with the launch's own value: the ranks
# this machine runs are found by it after the launch, even those that MPICH's hydra
# started in sessions of their own (the launcher's process group does not hold them).
_MARK = 'MPI_KVSTORE_SUPERVISED_LAUNCH'


def _run_once(argv, env, folder, signals):
    """Run one launch; -> its status. Ends it itself once a rank recorded why it aborts
    (or left its last words) and the launcher has not ended the job ABORT_GRACE s later;
    afterwards no process of the launch is left on this machine."""
    mark = '%d.%s' % (os.getpid(), os.path.basename(folder))
    env = dict(env, **{_MARK: mark})
    proc = processes.start_group(argv, env=env)
    signals.job = proc
    aborting_since = None
    stopping_since = None
    try:
        while True:
            try:
                return proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if signals.received is not None:
                stopping_since = stopping_since or now
                if now - stopping_since > 10:   # the ranks did not stop on the signal
                    processes.signal_group(proc.pid, signal.SIGKILL)
            elif aborting_since is None:
                # A rank's last words count too: the launcher may not learn of its death
                # from a host that a cut link left unreachable.
                if supervision.read(folder)[1] or supervision.fatal(folder):
                    aborting_since = now
            elif now - aborting_since > ABORT_GRACE:
                console.info('mpi_kvstore run: the launcher did not end the job %g s after a '
                             'rank aborted it or died: killing the launch', ABORT_GRACE)
                processes.signal_group(proc.pid, signal.SIGKILL)
    finally:
        signals.job = None
        processes.signal_group(proc.pid, signal.SIGKILL)   # leftovers of the launch's process group
        proc.wait()
        processes.kill(processes.marked(_MARK, mark))


def _run_elastic(command, launcher, env, root, args):
    """Each rank its own launch, hosts from the discovery script (driver.py): a lost worker
    is announced to the survivors, which re-form their world in memory and go on."""
    if args.max_np is not None and args.max_np < args.min_np:
        _parser().error('--max-np must be at least --min-np')
    if args.slots < 1:
        _parser().error('--slots must be at least 1')
    cooldown = args.blacklist_cooldown_range
    if cooldown is not None and not 0 < cooldown[0] <= cooldown[1]:
        _parser().error('--blacklist-cooldown-range LOW HIGH: 0 < LOW <= HIGH')
    driver = Driver(command, launcher, env, root, np=args.np, min_np=args.min_np,
                    max_np=args.max_np if args.max_np is not None else (
                        None if args.host_discovery_script else args.np),
                    script=args.host_discovery_script, slots=args.slots,
                    timeout=args.elastic_timeout, max_relaunches=args.max_restarts,
                    state_dir=args.state_dir, cooldown=cooldown)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        return driver.run()
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt(sig, frame):
    raise KeyboardInterrupt


def main(argv=None):
    args = _parser().parse_args(argv)
    command = args.command[1:] if args.command[:1] == ['--'] else args.command
    if not command:
        _parser().error('give the program after --, e.g. -- python train.py')
    hosts = parse_hostfile(args.hostfile) if args.hostfile else None
    nprocs = args.np or (sum(s for _, s in hosts) if hosts else 1)
    if nprocs < 1 or args.min_np < 1 or args.max_restarts < 0:
        _parser().error('-n and --min-np must be at least 1, --max-restarts at least 0')
    launcher = _launcher(args.launcher)
    root = args.state_dir or tempfile.mkdtemp(prefix='mpi_kvstore_run_')
    os.makedirs(root, exist_ok=True)
    env = dict(os.environ)
    env.setdefault('MPI_KVSTORE_STALL_ABORT', str(STALL_ABORT_DEFAULT))
    if args.state_dir:
        env[supervision.STATE_ENV] = os.path.abspath(args.state_dir)
    if args.reset_limit:
        env[supervision.RESET_LIMIT_ENV] = str(args.reset_limit)
    if args.elastic or args.host_discovery_script:
        if hosts is not None:
            _parser().error('--elastic takes its hosts from --host-discovery-script, not '
                            '--hostfile')
        return _run_elastic(command, launcher, env, root, args)
    launch = 0
    with _Signals() as signals:
        while True:
            folder = os.path.join(root, '.supervision', 'launch-%d' % launch)
            shutil.rmtree(folder, ignore_errors=True)
            os.makedirs(folder)
            hostfile = os.path.join(folder, 'hostfile')
            if hosts is not None:
                with open(hostfile, 'w') as fh:
                    fh.writelines('%s:%d\n' % host for host in hosts)
            env[supervision.DIR_ENV] = folder
            env[supervision.LAUNCH_ENV] = str(launch)
            where = ' on %s' % ','.join(h for h, _ in hosts) if hosts else ''
            console.info('mpi_kvstore run: launch %d (of at most %d): %d rank(s)%s: %s',
                         launch + 1, args.max_restarts + 1, nprocs, where, shlex.join(command))
            start = time.monotonic()
            status = _run_once(launch_argv(launcher, nprocs, hosts, hostfile, command), env,
                               folder, signals)
            started, ended = supervision.read(folder)
            outcome = diagnose(status, started, ended, signals.received is not None, nprocs,
                               [h for h, _ in hosts] if hosts else None,
                               supervision.fatal(folder))
            took = time.monotonic() - start
            ended_line = 'mpi_kvstore run: launch %d ended after %.1f s: %s' % (
                launch + 1, took, outcome.why)
            if outcome.kind == 'ok':
                console.info('%s', ended_line)
                return 0
            if outcome.kind == 'interrupted':
                console.info('%s; not relaunching', ended_line)
                return INTERRUPTED
            if outcome.kind == 'error' and not args.restart_on_error:
                console.info('%s: a bug, not a fault: not relaunching (--restart-on-error '
                             'would); status %s', ended_line, status)
                return status or 1
            if launch >= args.max_restarts:
                console.info('%s; giving up after %d relaunch(es) (--max-restarts %d); '
                             'status %s', ended_line, launch, args.max_restarts, status)
                return status or 1
            if hosts is not None and outcome.lost_hosts:
                kept = [(h, s) for h, s in hosts if h not in outcome.lost_hosts]
                # lost hosts come from ranks that started (diagnose), so placement is known
                lost_ranks = sum(1 for f in started.values() if f['host'] in outcome.lost_hosts)
                smaller = nprocs - lost_ranks
                if kept and smaller >= args.min_np:
                    hosts, nprocs = kept, smaller
                else:
                    console.info('mpi_kvstore run: leaving out %s would leave %d rank(s), '
                                 'fewer than --min-np %d: keeping every host',
                                 ', '.join(outcome.lost_hosts), smaller, args.min_np)
            wait = min(args.backoff * 2 ** launch, BACKOFF_MAX)
            console.info('%s; relaunching %d rank(s) in %.1f s', ended_line, nprocs, wait)
            if signals.received is None:
                time.sleep(wait)
            if signals.received is not None:
                console.info('mpi_kvstore run: interrupted; not relaunching')
                return INTERRUPTED
            launch += 1
