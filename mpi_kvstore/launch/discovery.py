"""The hosts of an elastic job: what a host discovery script prints, and which hosts failed.

A discovery script prints one host a line, ``host:slots`` or ``host`` (then ``--slots``
slots), Horovod's format; it is run again every second or so, and its output is the job's
hosts from then on. A host on which a worker failed is blacklisted: no new worker starts
there (its other workers keep running). As in Horovod, the blacklist is for good unless a
cooldown range (low, high) is given: then a host is out for ``low`` seconds after its first
failure, twice as long after each further one, at most ``high``, and takes workers again
once its cooldown ended and the script lists it. Hosts keep the order in which they first
appeared, so that the oldest hosts hold the lowest ranks.

No MPI here.
"""
import logging
import socket
import subprocess
import time

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
    """The job's hosts: ``find()`` gives [(host, slots)] (a discovery script, or fixed);
    ``cooldown``: None (a failed host is out for good) or (low, high) seconds."""

    def __init__(self, find, cooldown=None, clock=time.monotonic):
        if cooldown is not None:
            low, high = (float(x) for x in cooldown)
            if not 0 < low <= high:
                raise ValueError('blacklist cooldown range: 0 < low <= high, not %r'
                                 % (cooldown,))
            cooldown = (low, high)
        self.find, self.cooldown, self.clock = find, cooldown, clock
        self.order = []          # hosts in the order they first appeared
        self.slots = {}          # the latest discovery: host -> slots
        self.failures = {}       # host -> how many times it was blacklisted
        self.until = {}          # blacklisted host -> the clock's time it may come back, or None

    @property
    def blacklisted(self):
        """The hosts out now (a host whose cooldown ended is back)."""
        return {host for host in list(self.until) if self.is_blacklisted(host)}

    def update(self):
        """Run the discovery; whether the hosts or their slots changed."""
        found = dict(self.find())
        changed = found != self.slots
        self.slots = found
        self.order.extend(host for host in found if host not in self.order)
        return changed

    def blacklist(self, host):
        """A worker failed on ``host``: no new worker there, for good or for its cooldown. A
        failure while the host is out (another of its workers) counts once."""
        if self.is_blacklisted(host):
            return
        count = self.failures[host] = self.failures.get(host, 0) + 1
        if self.cooldown is None:
            self.until[host] = None
            log.warning('mpi_kvstore elastic: host %s blacklisted: a worker failed there; no '
                        'new worker starts on it', host)
            return
        seconds = min(self.cooldown[0] * 2 ** (count - 1), self.cooldown[1])
        self.until[host] = self.clock() + seconds
        log.warning('mpi_kvstore elastic: host %s blacklisted for %g s (failure %d): a worker '
                    'failed there; no new worker starts on it until then', host, seconds, count)

    def is_blacklisted(self, host):
        """Whether ``host`` is out now; a host whose cooldown ended leaves the blacklist."""
        if host not in self.until:
            return False
        until = self.until[host]
        if until is None or self.clock() < until:
            return True
        del self.until[host]
        log.info('mpi_kvstore elastic: host %s: its blacklist cooldown ended; it takes workers '
                 'again while the host discovery lists it', host)
        return False

    def wanted(self, held, limit=None):
        """The slots [(host, index)] the job should use, oldest hosts first, at most
        ``limit``: every listed slot of a host not blacklisted, and on a blacklisted host
        only those ``held`` (a set of slots whose workers still run)."""
        slots = [(host, index) for host in self.order
                 for index in range(self.slots.get(host, 0))
                 if not self.is_blacklisted(host) or (host, index) in held]
        return slots if limit is None else slots[:limit]
