"""What ranks tell the supervisor (``python -m mpi_kvstore run``, supervisor.py) about how
they ended, through files in a directory the supervisor names in the environment.

The supervisor must tell a fault (a killed rank, a lost host, a stall, an MPI error:
relaunch) from a bug (a Python exception in the user's code: stop). Exit statuses cannot
say it: MPI_Abort ends every rank with one status, and the launcher reports its own. So a
rank that aborts the job writes first why it does (:func:`record`), and every rank writes
at start-up where it runs (:func:`started`). A rank killed by a signal writes nothing,
which the supervisor reads as a fault too; one that a fatal signal (a segmentation fault
inside MPI) ends writes its last words first (last_words.py, into FATAL; :func:`fatal`).

No MPI and no MXNet here: the supervisor imports this module without starting MPI.
"""
import json
import os

__all__ = ['DIR_ENV', 'LAUNCH_ENV', 'STATE_ENV', 'RESET_LIMIT_ENV', 'FATAL', 'active', 'record',
           'started', 'read', 'fatal', 'launch_index']

DIR_ENV = 'MPI_KVSTORE_SUPERVISION_DIR'   # where ranks write; set by the supervisor
LAUNCH_ENV = 'MPI_KVSTORE_LAUNCH'         # 0 for the first launch, 1 for the first relaunch...
STATE_ENV = 'MPI_KVSTORE_STATE_DIR'       # elastic.State's default directory
RESET_LIMIT_ENV = 'MPI_KVSTORE_RESET_LIMIT'   # elastic.run's resets before it gives up

# causes a rank records
EXCEPTION, STALL = 'exception', 'stall'
FATAL = 'fatal.%d.txt'   # a rank's last words on a fatal signal: one line of text


def active(environ=None):
    """The supervision directory of this job, or None when no supervisor runs it."""
    return (os.environ if environ is None else environ).get(DIR_ENV) or None


def launch_index(environ=None):
    """How many times the supervisor relaunched this job before this launch (0: first)."""
    try:
        return int((os.environ if environ is None else environ).get(LAUNCH_ENV, '0'))
    except ValueError:
        return 0


def _write(name, fields):
    folder = active()
    if folder is None:
        return
    path = os.path.join(folder, name)
    tmp = '%s.tmp.%d' % (path, os.getpid())
    try:
        with open(tmp, 'w') as fh:
            json.dump(fields, fh)
        os.replace(tmp, path)   # whole or absent, whatever kills this process
    except OSError:
        pass                    # the supervisor then reads a silent rank: a fault


def started(rank, size, host):
    """This rank runs, on ``host`` (called once the first store exists)."""
    _write('started.%d.json' % rank, {'rank': rank, 'size': size, 'host': host,
                                      'pid': os.getpid()})


def record(rank, cause, fault, detail='', lost=()):
    """Why this rank is about to abort the job. ``cause``: EXCEPTION or STALL; ``fault``:
    True when a relaunch may help (an MPI error, a stall), False for a bug in the user's
    code; ``lost``: ranks that seem gone (a stall's silent ranks)."""
    _write('ended.%d.json' % rank, {'rank': rank, 'cause': cause, 'fault': bool(fault),
                                    'detail': detail[:2000], 'lost': sorted(lost)})


def read(folder):
    """(started {rank: fields}, ended {rank: fields}) that ranks wrote in ``folder``."""
    found = {'started': {}, 'ended': {}}
    try:
        names = os.listdir(folder)
    except OSError:
        return found['started'], found['ended']
    for name in names:
        kind, _, rest = name.partition('.')
        if kind not in found or not rest.endswith('.json') or '.tmp.' in rest:
            continue
        try:
            with open(os.path.join(folder, name)) as fh:
                fields = json.load(fh)
            found[kind][int(fields['rank'])] = fields
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return found['started'], found['ended']


def fatal(folder):
    """{rank: last words} of the ranks that a fatal signal ended (last_words.py wrote them
    from its signal handler: plain text, not JSON)."""
    found = {}
    try:
        names = os.listdir(folder)
    except OSError:
        return found
    prefix, suffix = FATAL.split('%d')
    for name in names:
        number = name[len(prefix):-len(suffix)]
        if not (name.startswith(prefix) and name.endswith(suffix) and number.isdigit()):
            continue
        try:
            with open(os.path.join(folder, name), errors='replace') as fh:
                words = ' '.join(fh.read(4000).split())
        except OSError:
            continue
        if words:
            found[int(number)] = words
    return found
