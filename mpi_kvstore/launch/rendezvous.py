"""What the launcher and the workers of an elastic job tell each other, signed with the job's
secret: where to meet (an MPI port), and which workers were lost.

Every message is a small JSON file in the job's rendezvous directory, written whole (a
temporary file renamed into place) and signed with HMAC-SHA256 under a per-job secret that
only the launcher and its workers hold (in their environment). A file whose signature does
not verify is refused and logged, never acted on. The port itself is MPI's; a process that
connects to it must still answer a challenge with the secret (mpi_kvstore.elastic.world)
before it is merged into the world.

No MPI and no MXNet here: the launcher imports this module without starting MPI.
"""
import hashlib
import hmac
import json
import logging
import os
import secrets

__all__ = ['SECRET_ENV', 'DIR_ENV', 'ID_ENV', 'NP_ENV', 'JOIN_ENV', 'MIN_NP_ENV', 'TIMEOUT_ENV',
           'GUARD_ENV',
           'new_secret', 'sign', 'verify', 'write_signed', 'read_signed', 'announce_lost',
           'lost_path', 'port_path', 'current_port_path', 'hosts_path', 'formed_path',
           'ready_path', 'announce_hosts', 'read_hosts', 'gave_up_path', 'gave_up', 'is_lost']

log = logging.getLogger(__name__)

SECRET_ENV = 'MPI_KVSTORE_ELASTIC_SECRET'   # the job's secret, hex
DIR_ENV = 'MPI_KVSTORE_ELASTIC_DIR'         # the rendezvous directory
ID_ENV = 'MPI_KVSTORE_ELASTIC_ID'           # this worker's id: 0, 1, ... in launch order
NP_ENV = 'MPI_KVSTORE_ELASTIC_NP'           # how many workers the first world waits for
JOIN_ENV = 'MPI_KVSTORE_ELASTIC_JOIN'       # '1': this worker joins a running world
MIN_NP_ENV = 'MPI_KVSTORE_ELASTIC_MIN_NP'   # below this many workers the world waits
TIMEOUT_ENV = 'MPI_KVSTORE_ELASTIC_TIMEOUT'  # seconds the world waits for workers
HOST_ENV = 'MPI_KVSTORE_ELASTIC_HOST'        # the host a worker runs on (comm.topology splits by it)
# '1': the worker's UCX sends to a lost peer stay pending (comm/sendguard.py reads the same name)
GUARD_ENV = 'MPI_KVSTORE_GUARD_SENDS'


def new_secret():
    """A fresh per-job secret (hex)."""
    return secrets.token_hex(32)


def sign(secret, *parts):
    """HMAC-SHA256 of ``parts`` (joined by '|') under ``secret`` (hex)."""
    message = '|'.join(str(part) for part in parts).encode()
    return hmac.new(bytes.fromhex(secret), message, hashlib.sha256).hexdigest()


def verify(secret, mac, *parts):
    """Whether ``mac`` is the signature of ``parts``."""
    return isinstance(mac, str) and hmac.compare_digest(mac, sign(secret, *parts))


def _fields(payload):
    return [payload[key] for key in sorted(payload)]


def write_signed(path, secret, payload):
    """Write ``payload`` (a dict of str/int values) with its signature, atomically."""
    body = dict(payload, mac=sign(secret, *_fields(payload)))
    tmp = '%s.tmp-%d' % (path, os.getpid())
    with open(tmp, 'w') as fh:
        json.dump(body, fh)
    os.replace(tmp, path)


def read_signed(path, secret, refused=None):
    """The payload of the signed file at ``path``, or None when it is absent or unreadable.
    A file whose signature does not verify is refused: logged once (``refused``, a set of
    paths already named) and returned as None."""
    try:
        with open(path) as fh:
            body = json.load(fh)
    except (OSError, ValueError):
        return None
    if not isinstance(body, dict):
        body = {}
    mac = body.pop('mac', None)
    if not verify(secret, mac, *_fields(body)):
        if refused is None or path not in refused:
            log.warning('mpi_kvstore elastic: refused %s: its signature does not match the '
                        "job's secret", path)
            if refused is not None:
                refused.add(path)
        return None
    return body


def port_path(directory, generation):
    return os.path.join(directory, 'port-%d.json' % generation)


def current_port_path(directory):
    """The port of the forming now under way (the newest ``port-<generation>``): the workers
    that join and the launcher's stand-in read it."""
    return os.path.join(directory, 'port.json')


def hosts_path(directory):
    """The launcher's newest word on the world's members (the host discovery's result)."""
    return os.path.join(directory, 'hosts.json')


def formed_path(directory):
    """The root's word that a world formed: its generation and its workers."""
    return os.path.join(directory, 'formed.json')


def ready_path(directory, worker):
    """A started worker's word that it waits to join."""
    return os.path.join(directory, 'ready-%d.json' % worker)


def gave_up_path(directory, generation, worker):
    """A worker's word that it gave up on the forming of ``generation``: the others in that
    forming give up too, and the launcher's stand-in completes the root's accept for it."""
    return os.path.join(directory, 'gaveup-%d-%d.json' % (generation, worker))


def gave_up(directory, generation):
    """The workers that gave up on the forming of ``generation`` (unsigned names: read the
    files with :func:`read_signed` before acting on them)."""
    prefix = 'gaveup-%d-' % generation
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(int(name[len(prefix):-5]) for name in names
                  if name.startswith(prefix) and name.endswith('.json')
                  and name[len(prefix):-5].isdigit())


def announce_hosts(directory, secret, number, members, removed_only, timestamp):
    """The launcher's notice ``number``: the world's members are now ``members`` (worker
    ids); ``removed_only`` when it only leaves workers out."""
    write_signed(hosts_path(directory), secret, {
        'number': int(number), 'members': ','.join(str(int(m)) for m in members),
        'removed_only': int(bool(removed_only)), 'time': '%.6f' % timestamp})


def read_hosts(directory, secret, refused=None):
    """The launcher's newest notice: {'number', 'members' (a list of ids)}, or None."""
    found = read_signed(hosts_path(directory), secret, refused)
    if not found:
        return None
    try:
        members = [int(word) for word in str(found['members']).split(',') if word]
        return {'number': int(found['number']), 'members': members}
    except (KeyError, ValueError):
        return None


def lost_path(directory, worker):
    return os.path.join(directory, 'lost-%d.json' % worker)


def announce_lost(directory, secret, worker, status):
    """The launcher's word that ``worker`` ended (exit status ``status``)."""
    write_signed(lost_path(directory, worker), secret, {'lost': int(worker),
                                                        'status': int(status)})


def is_lost(directory, secret, worker, refused=None):
    """Whether the launcher announced ``worker`` lost."""
    found = read_signed(lost_path(directory, worker), secret, refused)
    return bool(found) and found.get('lost') == worker
