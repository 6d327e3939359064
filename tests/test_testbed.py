"""The multi-host test bed itself (testbed/): hosts, placement, shaping, teardown.

Skipped, with the reason, where the test bed cannot be built (not root, no ip or
tc, no namespaces). The pure parts run everywhere.
"""
# The project formats with '%' throughout (as testbed/ruff.toml says for testbed/);
# rewriting every format string here would be churn with no defect behind it.
import os
import re
import signal
import subprocess
import sys
import time

import pytest

import testbed
from testbed import network

from mpi_harness import REPO_ROOT, run_mpi

OK, WHY = testbed.available(rate=True, mpi=True)
needs_testbed = pytest.mark.skipif(not OK, reason=WHY or 'test bed available')

SHAPED = '200mbit'
PROBE_MB = 4            # 4 MB: 168 ms a way at 200 Mbit/s, 5 to 15 ms over unshaped TCP


def _allreduce(hosts, nprocs, ppn=None, tcp=True, megabytes=PROBE_MB, repeats=5):
    """(ms, {rank: host}) of the probe scenario across HOSTS."""
    out = run_mpi(nprocs, 'testbed_allreduce.py', megabytes, repeats, timeout=120,
                  launcher=hosts.launcher_for(ppn=ppn, tcp=tcp))
    placed = {int(r): h for r, h in re.findall(r'testbed: rank (\d+) on (\S+)', out)}
    ms = float(re.search(r'median ([0-9.]+) ms', out).group(1))
    return ms, placed


def _gone(prefix):
    """Nothing of test bed PREFIX is left: namespace, bridge, veth, mount, file, process."""
    assert testbed.artifacts(prefix) == []
    netns = subprocess.run(['ip', 'netns', 'list'], capture_output=True, text=True,
                           check=False).stdout
    assert prefix not in netns
    assert not os.path.exists(os.path.join(network.STATE_ROOT, prefix))
    if os.path.isdir(network.NETNS_ETC):
        assert not [n for n in os.listdir(network.NETNS_ETC) if n.startswith(prefix)]
    links = subprocess.run(['ip', '-o', 'link'], capture_output=True, text=True,
                           check=False).stdout
    assert prefix not in links
    with open('/proc/self/mountinfo') as f:
        assert prefix not in f.read()


# -- pure parts ---------------------------------------------------------------------------

def test_parse_rate():
    assert testbed.parse_rate('3gbit') == 3 * 10 ** 9
    assert testbed.parse_rate('500mbit') == 5 * 10 ** 8
    assert testbed.parse_rate('1.5Gbit') == 15 * 10 ** 8
    assert testbed.parse_rate('125mbps') == 10 ** 9
    assert testbed.parse_rate(10 ** 9) == 10 ** 9
    for bad in ('fast', '3 parsecs', '10bit', -1):
        with pytest.raises(ValueError):
            testbed.parse_rate(bad)


def test_tbf_bucket_holds_two_milliseconds_and_a_packet():
    assert network.tbf_args(10 ** 9)[:4] == ['tbf', 'rate', '1000000000bit', 'burst']
    assert int(network.tbf_args(10 ** 9)[4]) == 250000
    assert int(network.tbf_args(10 ** 6)[4]) == network.TBF_MIN_BURST


def test_not_a_package_of_the_library():
    from setuptools import find_packages
    assert 'testbed' not in find_packages(where=REPO_ROOT, include=['mpi_kvstore',
                                                                   'mpi_kvstore.*'])


# -- hosts ------------------------------------------------------------------------------------

@needs_testbed
def test_hosts_have_their_own_hostname_and_address_and_teardown_leaves_nothing():
    with testbed.Hosts(3) as hosts:
        prefix = hosts.prefix
        assert re.fullmatch(r'mkvtb%d(n\d+)?' % os.getpid(), prefix)
        for i, name in enumerate(hosts.names):
            out = hosts.run(['sh', '-c', ('hostname; ip -o -4 addr show dev eth0; '
                                          'getent hosts h0 h1 h2')],
                            host=name, timeout=30).check().output
            lines = out.split('\n')
            assert lines[0] == name
            assert ' 198.18.0.%d/24 ' % (i + 1) in lines[1]
            assert re.findall(r'^198\.18\.0\.(\d) +h(\d)', out, re.MULTILINE) == [
                ('1', '0'), ('2', '1'), ('3', '2')]
        # h0 reaches h2 over the bridge; nothing outside 198.18.0.0/24 is routed.
        routes = hosts.run(['ip', '-4', 'route'], host='h0', timeout=30).check().output
        assert routes.strip().split('\n') == [
            '198.18.0.0/24 dev eth0 proto kernel scope link src 198.18.0.1']
        reach = hosts.run([sys.executable, '-c', ('import socket; socket.create_connection('
                                                  '("h2", 9), timeout=5)')],
                          host='h0', timeout=30)
        assert 'ConnectionRefused' in reach.output, reach.output   # h2 answered: reachable
        assert os.uname().nodename not in hosts.names
    _gone(prefix)


@needs_testbed
def test_ranks_land_on_hosts_and_a_shaped_link_is_slower(mpi_available):
    # Timings at 2 ranks, one a host: 4 ranks on 2 cores measure the CPU, not the link.
    with testbed.Hosts(2) as fast:
        _, placed = _allreduce(fast, 4, megabytes=0.01, repeats=1)
        assert placed == {0: 'h0', 1: 'h1', 2: 'h0', 3: 'h1'}   # round-robin
        fast_ms, _ = _allreduce(fast, 2)
    with testbed.Hosts(2, rate=SHAPED) as slow:
        _, placed = _allreduce(slow, 4, ppn=2, megabytes=0.01, repeats=1)
        assert placed == {0: 'h0', 1: 'h0', 2: 'h1', 3: 'h1'}
        slow_ms, _ = _allreduce(slow, 2)
        # MPICH's default transports bypass the link (shared memory): the reason for TCP_ENV.
        shm_ms, _ = _allreduce(slow, 2, tcp=False)
    print('allreduce of %d MB at 2 ranks: unshaped TCP %.1f ms, TCP at %s %.1f ms, '
          'default transports at %s %.1f ms' % (PROBE_MB, fast_ms, SHAPED, slow_ms, SHAPED, shm_ms))
    # 2 ranks at 200 Mbit/s exchange 4 MB each way: about 168 ms, which the shaper holds as
    # a floor whatever the load. Unshaped TCP and shared memory take 5-15 ms on a quiet
    # machine: below half that floor even when a busy one slows them several times over,
    # where a ratio between the timings of two moments would hang on the load at each.
    floor_ms = PROBE_MB * 2 ** 20 * 8 / testbed.parse_rate(SHAPED) * 1e3
    assert slow_ms > 0.5 * floor_ms
    assert fast_ms < 0.5 * floor_ms and shm_ms < 0.5 * floor_ms


@needs_testbed
def test_job_timeout_kills_every_process_of_the_job():
    with testbed.Hosts(2) as hosts:
        start = time.monotonic()
        result = hosts.run(['sh', '-c', 'sleep 60 & sleep 60'], host='h1', timeout=2)
        assert result.timed_out and time.monotonic() - start < 10
        assert network.processes_inside(hosts.prefix) == []


@needs_testbed
@pytest.mark.parametrize('how', ['SIGTERM', 'SIGKILL'])
def test_owner_killed_leaves_nothing(how):
    """SIGTERM: the owner tears down on its way out. SIGKILL: the next up finds it stale."""
    code = ('import sys, time, testbed\n'
            'with testbed.Hosts(2) as hosts:\n'
            '    print(hosts.prefix, flush=True)\n'
            '    hosts.run(["sleep", "60"], host="h1", timeout=120)\n')
    proc = subprocess.Popen([sys.executable, '-c', code], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                            text=True)
    prefix = proc.stdout.readline().strip()
    assert prefix.startswith('mkvtb%d' % proc.pid)
    deadline = time.monotonic() + 10
    while not network.processes_inside(prefix) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(getattr(signal, how))
    status = proc.wait(timeout=30)
    if how == 'SIGTERM':
        assert status == 128 + signal.SIGTERM
    else:
        assert testbed.artifacts(prefix)            # still there, with its sleep
        assert testbed.list_runs()[prefix]['live'] is False
        assert prefix in testbed.cleanup_stale()
    _gone(prefix)


@needs_testbed
def test_cli_run_returns_the_job_status_and_tears_down(mpi_available):
    code = ('import sys; from mpi4py import MPI; '
            'sys.exit(3 if MPI.COMM_WORLD.rank == 1 else 0)')
    before = set(testbed.list_runs())
    proc = subprocess.run([sys.executable, '-m', 'testbed', 'run', '--hosts', '2', '--rate',
                           '1gbit', '-n', '2', '--timeout', '60', '--', sys.executable, '-c',
                           code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                           check=False)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert set(testbed.list_runs()) <= before
