"""The hosts of an elastic job: what a host discovery script prints, and which hosts failed.

A discovery script prints one host a line, ``host:slots`` or ``host`` (then ``--slots``
slots), Horovod's format; it is run again every second or so, and its output is the job's
hosts from then on. A host on which a worker failed is blacklisted: no new worker starts
there (its other workers keep running). Hosts keep the order in which they first appeared,
so that the oldest hosts hold the lowest ranks.

No MPI here.
"""
import logging
import socket
import subprocess

__all__ = ['parse', 'run_script', 'is_local', 'Hosts']

log = logging.getLogger(__name__)

SCRIPT_TIMEOUT = 30.0   # s a discovery script may take


def parse(text, default_slots=1):
    """[(host, slots)] of a discovery script's output, in order; a host named twice keeps
    its last line. Raises ValueError on a line that is not ``host[:slots]``."""
    found = {}
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        host, colon, slots = line.partition(':')
        try:
            count = int(slots) if colon else int(default_slots)
            if not host or count < 0 or ' ' in host:
                raise ValueError
        except ValueError:
            raise ValueError('host discovery: %r is not host:slots' % line) from None
        found.pop(host, None)
        found[host] = count
    return list(found.items())


def run_script(script, default_slots=1, timeout=SCRIPT_TIMEOUT):
    """Run the discovery ``script`` (a shell command) and parse what it printed; RuntimeError
    when it fails or runs past ``timeout`` seconds."""
    try:
        done = subprocess.run(script, shell=True, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError('host discovery: %s ran past %g s' % (script, timeout)) from None
    if done.returncode != 0:
        raise RuntimeError('host discovery: %s exited with status %d: %s'
                           % (script, done.returncode, done.stderr.strip()[-500:]))
    return parse(done.stdout, default_slots)


def is_local(host):
    """Whether ``host`` names this machine (its workers start without a remote launch)."""
    return (host in ('localhost', '::1') or host.startswith('127.')
            or host in (socket.gethostname(), socket.getfqdn()))


class Hosts:
    """The job's hosts: ``find()`` gives [(host, slots)] (a discovery script, or fixed)."""

    def __init__(self, find):
        self.find = find
        self.order = []          # hosts in the order they first appeared
        self.slots = {}          # the latest discovery: host -> slots
        self.blacklisted = set()

    def update(self):
        """Run the discovery; whether the hosts or their slots changed."""
        found = dict(self.find())
        changed = found != self.slots
        self.slots = found
        self.order.extend(host for host in found if host not in self.order)
        return changed

    def blacklist(self, host):
        if host not in self.blacklisted:
            log.warning('mpi_kvstore elastic: host %s blacklisted: a worker failed there; no '
                        'new worker starts on it', host)
            self.blacklisted.add(host)

    def wanted(self, held, limit=None):
        """The slots [(host, index)] the job should use, oldest hosts first, at most
        ``limit``: every listed slot of a host not blacklisted, and on a blacklisted host
        only those ``held`` (a set of slots whose workers still run)."""
        slots = [(host, index) for host in self.order
                 for index in range(self.slots.get(host, 0))
                 if host not in self.blacklisted or (host, index) in held]
        return slots if limit is None else slots[:limit]
