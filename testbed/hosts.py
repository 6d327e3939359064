"""Hosts: N test hosts on this machine, from up to down.

The class puts the modules together: network builds the namespaces and links,
registry names, records and removes a test bed, jobs (the HostJobs part of the
class) runs commands and MPI jobs on the hosts.
"""
import os
import sys
import time

from mpi_kvstore.launch.processes import start_time

from . import network, registry
from .jobs import DEFAULT_TIMEOUT, HostJobs
from .machine import TestbedError, available

MAX_HOSTS = 64


class Hosts(HostJobs):
    """N test hosts with their own network and hostname, joined by (shaped) links.

        with Hosts(2, rate='3gbit') as hosts:
            hosts.mpirun(4, ['python', 'x.py'], ppn=2).check()

    ``up()`` builds, ``down()`` (or leaving the ``with``) removes everything, as does
    exit or SIGTERM/SIGHUP of this process; a test bed whose process was killed is
    removed by the next ``up()`` on the machine.
    """

    def __init__(self, count=2, rate=None, timeout=DEFAULT_TIMEOUT):
        if not 1 <= int(count) <= MAX_HOSTS:
            raise ValueError('hosts: 1 to %d, not %r' % (MAX_HOSTS, count))
        self.count = int(count)
        self.rate = rate
        self.rate_bits = network.parse_rate(rate) if rate else None
        self.timeout = timeout
        self.names = ['h%d' % i for i in range(self.count)]
        self.prefix = None
        self._owned = False

    # -- naming ------------------------------------------------------------------------

    def _index(self, host):
        if isinstance(host, int) and 0 <= host < self.count:
            return host
        for i, name in enumerate(self.names):
            if host in (name, self.namespace(i) if self.prefix else None, self.address(i)):
                return i
        raise TestbedError('%r is not a host of test bed %s' % (host, self.prefix))

    def namespace(self, host):
        """The network namespace of HOST (an index or a name), as ``ip netns`` knows it."""
        return network.namespace(self._need_prefix(), self.names[self._index(host)])

    @property
    def bridge_namespace(self):
        return network.bridge_namespace(self._need_prefix())

    def address(self, host):
        """HOST's address: 198.18.0.<index+1>."""
        return network.address(host if isinstance(host, int) else self.names.index(host))

    def uts_file(self, host):
        return network.uts_file(self._need_prefix(), self.names[self._index(host)])

    def hosts_file(self):
        return network.hosts_file(self.prefix, self.names)

    def _need_prefix(self):
        if self.prefix is None:
            raise TestbedError('the test bed is not up')
        return self.prefix

    # -- life cycle --------------------------------------------------------------------

    def __enter__(self):
        return self.up()

    def __exit__(self, *exc):
        self.down()
        return False

    def up(self, owner=None, keeper=False):
        """Build the test bed; return self.

        OWNER: the pid whose life the test bed lasts (default: this process, and
        teardown at its exit). KEEPER: that pid is a keeper process, killed on down.
        """
        if self.prefix is not None:
            raise TestbedError('test bed %s is already up' % self.prefix)
        ok, why = available(rate=self.rate_bits is not None)
        if not ok:
            raise TestbedError(why)
        registry.cleanup_stale(log=lambda msg: print(msg, file=sys.stderr))
        owner = os.getpid() if owner is None else owner
        with registry.LOCK:
            self.prefix = registry.claim_prefix(owner)
            self._owned = owner == os.getpid()
            if self._owned:
                registry.guard(self)
        try:
            registry.write_state(self.prefix, {
                'prefix': self.prefix, 'owner': owner, 'owner_start': start_time(owner),
                'keeper': bool(keeper), 'hosts': self.names, 'rate': self.rate,
                'rate_bits': self.rate_bits, 'created': time.time()})
            network.build(self.prefix, self.names, self.rate_bits)
            self._write_scripts()
        except BaseException:
            self.down()
            raise
        return self

    @classmethod
    def attach(cls, prefix):
        """A Hosts for test bed PREFIX, already up (``python -m testbed up``); not owned."""
        state = registry.read_state(prefix)
        if not state:
            raise TestbedError('no test bed %s (see python -m testbed list)' % prefix)
        hosts = cls(len(state['hosts']), state.get('rate'))
        hosts.prefix = prefix
        return hosts

    def cut(self, host):
        """Cut HOST's link: its bridge port goes down, as if its cable were pulled."""
        network.set_link(self._need_prefix(), self.names[self._index(host)], up=False)

    def mend(self, host):
        """Put HOST's link back (a no-op on a link that is up; never raises)."""
        if self.prefix is not None:
            try:
                network.set_link(self.prefix, self.names[self._index(host)], up=True)
            except TestbedError:
                pass

    def down(self):
        """Remove the test bed (idempotent)."""
        prefix = self.prefix
        if prefix is None:
            return
        try:
            registry.teardown(prefix)
        finally:
            self.prefix = None
            if self._owned:
                registry.unguard(self)
            self._owned = False

    def __repr__(self):
        return '<Hosts %s: %s%s>' % (self.prefix or '(down)', ', '.join(self.names),
                                     ' at %s' % self.rate if self.rate else '')
