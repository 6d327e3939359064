"""python -m testbed: build, use and remove multi-host test beds (see testbed/README.md).

    python -m testbed up --hosts 2 [--rate 3gbit]    # stays up until `down`
    python -m testbed list
    python -m testbed exec h1 -- hostname
    python -m testbed mpiexec -n 4 [--ppn 2] -- python script.py
    python -m testbed down [PREFIX...] [--all]
    python -m testbed run --hosts 2 [--rate 3gbit] -n 4 [--ppn 2] -- python script.py
                                                     # up, mpiexec, down; the job's status
"""
import argparse
import subprocess
import sys

from .hosts import Hosts
from .machine import TestbedError, available
from .registry import list_runs, teardown

TIMED_OUT_STATUS = 124
INTERRUPTED_STATUS = 130
KEEPER_ARGV = ['sleep', '2147483647']   # the owner of a test bed from `up`: sleeps until `down`


def _command(words):
    words = list(words)
    if words and words[0] == '--':
        words = words[1:]
    if not words:
        raise SystemExit('testbed: no command given (put it after --)')
    return words


def _add_job_options(parser, timeout):
    parser.add_argument('-n', '--np', type=int, required=True, help='number of ranks')
    parser.add_argument('--ppn', type=int, help='ranks per host, in turn (default: round-robin)')
    parser.add_argument('--timeout', type=float, default=timeout,
                        help='seconds before the job is killed (default %(default)g)')
    parser.add_argument('--shm', action='store_true',
                        help="MPICH's default transports (shared memory between hosts) "
                             'instead of real TCP over the links')
    parser.add_argument('command', nargs=argparse.REMAINDER, help='-- PROGRAM ARGS...')


def _parser():
    parser = argparse.ArgumentParser(prog='python -m testbed', description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest='action', required=True)
    p = sub.add_parser('up', help='build a test bed that stays up until down')
    p.add_argument('--hosts', type=int, default=2)
    p.add_argument('--rate', help="shape every link to this rate, e.g. '3gbit'")
    p = sub.add_parser('down', help='remove test beds brought up with up, and stale ones')
    p.add_argument('prefix', nargs='*', help='only these (default: every one from up)')
    p.add_argument('--all', action='store_true',
                   help='also those owned by running processes (tests, benchmarks)')
    sub.add_parser('list', help='the test beds on this machine')
    p = sub.add_parser('exec', help='run a command on one host of a test bed from up')
    p.add_argument('host')
    p.add_argument('--prefix')
    p.add_argument('--timeout', type=float, default=3600)
    p.add_argument('command', nargs=argparse.REMAINDER)
    p = sub.add_parser('mpiexec', help='an MPI job across the hosts of a test bed from up')
    p.add_argument('--prefix')
    _add_job_options(p, 3600)
    p = sub.add_parser('run', help='up, an MPI job across the hosts, down')
    p.add_argument('--hosts', type=int, default=2)
    p.add_argument('--rate', help="shape every link to this rate, e.g. '3gbit'")
    _add_job_options(p, 1800)
    return parser


def _status(result):
    if result.timed_out:
        print('testbed: the job timed out after %.0f s and was killed' % result.elapsed,
              file=sys.stderr)
        return TIMED_OUT_STATUS
    return result.returncode


def _check_available(rate):
    ok, why = available(rate=bool(rate))
    if not ok:
        raise SystemExit('testbed: %s' % why)


def _attached(prefix):
    if prefix is None:
        ups = [p for p, info in list_runs().items()
               if info['live'] and info['state'] and info['state'].get('keeper')]
        if len(ups) != 1:
            raise SystemExit('testbed: %s; name one with --prefix' % (
                'no test bed is up (python -m testbed up)' if not ups
                else 'several test beds are up: %s' % ', '.join(ups)))
        prefix = ups[0]
    try:
        return Hosts.attach(prefix)
    except TestbedError as err:
        raise SystemExit('testbed: %s' % err) from err


def up(args):
    _check_available(args.rate)
    # The keeper is the owner: the test bed is stale once it is gone.
    keeper = subprocess.Popen(KEEPER_ARGV, stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    hosts = Hosts(args.hosts, args.rate)
    try:
        hosts.up(owner=keeper.pid, keeper=True)
    except BaseException:
        keeper.kill()
        raise
    shaping = (' at %s (tbf, both directions)' % args.rate) if args.rate else ' (unshaped)'
    print('test bed %s up: %d hosts%s' % (hosts.prefix, hosts.count, shaping))
    for i, name in enumerate(hosts.names):
        print('  %-4s %-12s netns %s' % (name, hosts.address(i), hosts.namespace(i)))
    print('ssh stand-in:  mpiexec -launcher ssh -launcher-exec %s -hosts %s'
          % (hosts.launcher, ','.join(hosts.names)))
    if hosts.mpiexec_wrapper:
        print('MPI over TCP:  %s -n %d python script.py' % (hosts.mpiexec_wrapper, hosts.count))
        print('           or  python -m testbed mpiexec -n %d -- python script.py' % hosts.count)
    print('on a host:     python -m testbed exec %s -- hostname' % hosts.names[-1])
    print('tear down:     python -m testbed down %s' % hosts.prefix)
    return 0


def down(args):
    runs = list_runs()
    chosen = []
    for prefix, info in runs.items():
        if args.prefix and prefix not in args.prefix:
            continue
        if (args.prefix or args.all or not info['live']
                or (info['state'] and info['state'].get('keeper'))):
            chosen.append(prefix)
    unknown = set(args.prefix) - set(runs)
    status = 0
    for prefix in sorted(unknown):
        print('testbed: no test bed %s' % prefix, file=sys.stderr)
        status = 1
    for prefix in chosen:
        try:
            teardown(prefix)
            print('test bed %s down' % prefix)
        except TestbedError as err:
            print('testbed: %s' % err, file=sys.stderr)
            status = 1
    if not chosen and not unknown:
        print('no test bed to take down')
    return status


def list_(args):
    runs = list_runs()
    if not runs:
        print('no test bed')
    for prefix, info in runs.items():
        state = info['state'] or {}
        print('%s  %s  owner %s%s  hosts %s  rate %s' % (
            prefix, 'live ' if info['live'] else 'STALE', state.get('owner', '?'),
            ' (keeper, from up)' if state.get('keeper') else '',
            ','.join(state.get('hosts', [])) or '?', state.get('rate') or 'unshaped'))
    return 0


def exec_(args):
    hosts = _attached(args.prefix)
    return _status(hosts.run(_command(args.command), host=args.host, timeout=args.timeout,
                             stream=True))


def mpiexec(args):
    hosts = _attached(args.prefix)
    return _status(hosts.mpirun(args.np, _command(args.command), ppn=args.ppn,
                                tcp=not args.shm, timeout=args.timeout, stream=True))


def run(args):
    command = _command(args.command)
    _check_available(args.rate)
    with Hosts(args.hosts, args.rate) as hosts:
        return _status(hosts.mpirun(args.np, command, ppn=args.ppn, tcp=not args.shm,
                                    timeout=args.timeout, stream=True))


def main(argv=None):
    args = _parser().parse_args(argv)
    action = {'up': up, 'down': down, 'list': list_, 'exec': exec_, 'mpiexec': mpiexec,
              'run': run}[args.action]
    try:
        return action(args)
    except KeyboardInterrupt:
        print('testbed: interrupted', file=sys.stderr)
        return INTERRUPTED_STATUS
    except TestbedError as err:
        print('testbed: %s' % err, file=sys.stderr)
        return 1


if __name__ == '__main__':
    sys.exit(main())
