"""The network of a test bed: namespaces, bridge and veth pairs, addresses, shaping.

Layout of one test bed, named by a prefix unique to the run (``mkvtb<pid>``, or
``mkvtb<pid>n<k>`` for the k-th concurrent one of that process)::

    netns PREFIX-br:  bridge br0, ports h0, h1, ...      (no address, no uplink)
    netns PREFIX-h0:  eth0 198.18.0.1/24 (peer h0 on br0), lo; hostname h0
    netns PREFIX-h1:  eth0 198.18.0.2/24 (peer h1 on br0), lo; hostname h1
    /run/mkvtb/PREFIX/        state.json, h<i>.uts (persistent UTS namespaces),
                              launch (the ssh stand-in), mpiexec (a wrapper)
    /etc/netns/PREFIX-h<i>/hosts   names every host; ``ip netns exec`` mounts it on /etc/hosts

The veth pairs are created directly inside their namespaces, so the root network
namespace never holds an interface of the test bed; deleting the namespaces
deletes everything in them. The only route in a host is its connected /24, and
the bridge has no uplink: no packet can leave the test bed. With a rate, each
link is shaped by tbf in both directions (egress of eth0 inside the host, egress
of the bridge port), so a host has a full-duplex link of that rate.
"""
import os
import re
import shutil
import subprocess

from mpi_kvstore.launch.processes import alive, pids

from .machine import need_tool, sh, which

NAME_BASE = 'mkvtb'
STATE_ROOT = '/run/mkvtb'    # a directory per test bed: its state, UTS files and scripts
NETNS_RUN = '/run/netns'     # where ``ip netns add`` mounts a namespace
NETNS_ETC = '/etc/netns'     # what ``ip netns exec`` mounts over /etc
BRIDGE_SUFFIX = 'br'
BRIDGE = 'br0'
IFACE = 'eth0'               # every host's interface has this name, inside its namespace
SUBNET = '198.18.0.'         # 198.18.0.0/24, inside the RFC 2544 range 198.18.0.0/15
SUBNET_BITS = 24
TBF_LATENCY = '20ms'         # how long a packet may wait in the shaper's queue
TBF_BURST_S = 0.002          # bucket size, in seconds at the rate
TBF_MIN_BURST = 16 * 1024    # bytes; above any MTU

PREFIX_RE = re.compile(r'^%s(\d+)(?:n\d+)?$' % NAME_BASE)   # group 1: the owner's pid
NAMED_RE = re.compile(r'^(%s\d+(?:n\d+)?)-' % NAME_BASE)    # group 1: the prefix

_RATE_UNITS = {'': 1, 'k': 10 ** 3, 'm': 10 ** 6, 'g': 10 ** 9, 't': 10 ** 12}


# -- rates ---------------------------------------------------------------------------

def parse_rate(rate):
    """Bits per second from a tc-style rate: '3gbit', '500mbit', '125mbps', or a number."""
    if isinstance(rate, (int, float)) and not isinstance(rate, bool):
        bits = float(rate)
    else:
        match = re.fullmatch(r'\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(bit|bps)?\s*', str(rate).lower())
        if not match:
            raise ValueError('rate %r: expected a number with kbit, mbit, gbit (or bps) units'
                             % (rate,))
        bits = float(match.group(1)) * _RATE_UNITS[match.group(2)]
        if match.group(3) == 'bps':
            bits *= 8
    if bits < 10 ** 5:
        raise ValueError('rate %r is below 100kbit' % (rate,))
    return int(bits)


def tbf_args(rate_bits):
    """The tbf qdisc arguments for RATE_BITS per second."""
    burst = max(int(rate_bits / 8 * TBF_BURST_S), TBF_MIN_BURST)
    return ['tbf', 'rate', '%dbit' % rate_bits, 'burst', str(burst), 'latency', TBF_LATENCY]


# -- names and places ----------------------------------------------------------------

def address(index):
    """The address of host INDEX: 198.18.0.<index+1>."""
    return '%s%d' % (SUBNET, index + 1)


def namespace(prefix, host):
    """The network namespace of host HOST (a name) of test bed PREFIX."""
    return '%s-%s' % (prefix, host)


def bridge_namespace(prefix):
    return namespace(prefix, BRIDGE_SUFFIX)


def run_dir(prefix):
    return os.path.join(STATE_ROOT, prefix)


def uts_file(prefix, host):
    """The file that holds host HOST's UTS namespace (its hostname)."""
    return os.path.join(run_dir(prefix), '%s.uts' % host)


def listdir(path):
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def netns_names(prefix=None):
    """The network namespaces of test bed PREFIX, or of every test bed."""
    names = listdir(NETNS_RUN)
    if prefix is None:
        return [name for name in names if NAMED_RE.match(name)]
    return [name for name in names if name.startswith(prefix + '-')]


def uts_files(prefix):
    directory = run_dir(prefix)
    return [os.path.join(directory, name) for name in listdir(directory) if name.endswith('.uts')]


def mount_points():
    try:
        with open('/proc/self/mountinfo') as f:
            return [line.split()[4].replace('\\040', ' ') for line in f]
    except OSError:
        return []


# -- building ------------------------------------------------------------------------

def build(prefix, names, rate_bits=None):
    """The bridge, and a namespace, link, address and hostname for each of NAMES."""
    ip, tc = need_tool('ip'), which('tc')
    bridge = bridge_namespace(prefix)
    sh(ip, 'netns', 'add', bridge)
    sh(ip, '-n', bridge, 'link', 'add', BRIDGE, 'type', 'bridge')
    sh(ip, '-n', bridge, 'link', 'set', BRIDGE, 'up')
    for i, host in enumerate(names):
        ns = namespace(prefix, host)
        sh(ip, 'netns', 'add', ns)
        # Created in place: the pair never appears in the root namespace.
        sh(ip, '-n', ns, 'link', 'add', IFACE, 'type', 'veth',
           'peer', 'name', host, 'netns', bridge)
        sh(ip, '-n', bridge, 'link', 'set', host, 'master', BRIDGE)
        sh(ip, '-n', bridge, 'link', 'set', host, 'up')
        sh(ip, '-n', ns, 'addr', 'add', '%s/%d' % (address(i), SUBNET_BITS), 'dev', IFACE)
        sh(ip, '-n', ns, 'link', 'set', IFACE, 'up')
        sh(ip, '-n', ns, 'link', 'set', 'lo', 'up')
        if rate_bits:
            for where, dev in ((ns, IFACE), (bridge, host)):
                sh(tc, '-n', where, 'qdisc', 'replace', 'dev', dev, 'root', *tbf_args(rate_bits))
        uts = uts_file(prefix, host)
        open(uts, 'w').close()
        sh(need_tool('unshare'), '--uts=%s' % uts, need_tool('hostname'), host)
        etc = os.path.join(NETNS_ETC, ns)
        os.makedirs(etc, exist_ok=True)
        with open(os.path.join(etc, 'hosts'), 'w') as f:
            f.write(hosts_file(prefix, names))


def set_link(prefix, host, up):
    """Take HOST's port on the bridge down (its cable pulled: eth0 inside HOST loses its
    carrier, keeps its address, and TCP sees silence, not an error) or up again."""
    sh(need_tool('ip'), '-n', bridge_namespace(prefix), 'link', 'set', host,
       'up' if up else 'down')


def hosts_file(prefix, names):
    """/etc/hosts for a host of test bed PREFIX: every host's address, name and namespace."""
    lines = ['# test bed %s' % prefix, '127.0.0.1 localhost',
             '::1 localhost ip6-localhost ip6-loopback']
    lines += ['%s %s %s' % (address(i), name, namespace(prefix, name))
              for i, name in enumerate(names)]
    return '\n'.join(lines) + '\n'


# -- what is in it, and removing it --------------------------------------------------

def _ns_ids(paths):
    ids = set()
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            continue
        ids.add((st.st_dev, st.st_ino))
    return ids


def processes_inside(prefix):
    """Live pids in a network or UTS namespace of test bed PREFIX."""
    ids = _ns_ids([os.path.join(NETNS_RUN, name) for name in netns_names(prefix)]
                  + uts_files(prefix))
    if not ids:
        return []
    me = os.getpid()
    found = []
    for pid in pids():
        if pid == me:
            continue
        for kind in ('net', 'uts'):
            try:
                st = os.stat('/proc/%d/ns/%s' % (pid, kind))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) in ids and alive(pid):
                found.append(pid)
                break
    return found


def _umount_all(path):
    umount = which('umount') or 'umount'
    for _ in range(8):   # a file can carry stacked mounts
        if path not in mount_points():
            return
        subprocess.run([umount, path], stdin=subprocess.DEVNULL, capture_output=True,
                       check=False)


def _rmdir_if_empty(path):
    try:
        os.rmdir(path)
    except OSError:
        pass


def remove(prefix):
    """Delete test bed PREFIX's namespaces, mounts and files (once its processes are gone).

    Works from what is on the machine, so it also clears a half-built test bed.
    """
    ip = which('ip') or 'ip'
    for name in netns_names(prefix):
        subprocess.run([ip, 'netns', 'delete', name], stdin=subprocess.DEVNULL,
                       capture_output=True, check=False)
        _umount_all(os.path.join(NETNS_RUN, name))   # in case ip could not
        try:
            os.remove(os.path.join(NETNS_RUN, name))
        except OSError:
            pass
    for path in uts_files(prefix):
        _umount_all(path)
    shutil.rmtree(run_dir(prefix), ignore_errors=True)
    for name in listdir(NETNS_ETC):
        if name.startswith(prefix + '-'):
            shutil.rmtree(os.path.join(NETNS_ETC, name), ignore_errors=True)
    _rmdir_if_empty(NETNS_ETC)
    _rmdir_if_empty(STATE_ROOT)


def artifacts(prefix):
    """What test bed PREFIX has on this machine: namespaces, mounts, files, processes."""
    found = ['netns ' + name for name in netns_names(prefix)]
    found += ['mount ' + path for path in mount_points()
              if path.startswith((run_dir(prefix) + '/',
                                  os.path.join(NETNS_RUN, prefix + '-')))]
    if os.path.lexists(run_dir(prefix)):
        found.append('dir ' + run_dir(prefix))
    found += ['dir ' + os.path.join(NETNS_ETC, name) for name in listdir(NETNS_ETC)
              if name.startswith(prefix + '-')]
    found += ['pid %d' % pid for pid in processes_inside(prefix)]
    return found
