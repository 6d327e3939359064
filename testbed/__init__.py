"""A multi-host test bed on one Linux machine: network namespaces joined by shaped links.

Each test host is a network namespace with a hostname of its own (a UTS namespace),
joined by a veth pair to a bridge that lives in a namespace of its own; nothing is
added to the root namespace but the namespaces' files. Addresses come only from the
benchmarking range 198.18.0.0/15 (RFC 2544), and nothing is routed out. MPICH's hydra
reaches the hosts through a launcher script that stands in for ssh, and
``MPICH_CH4_NETMOD=ucx UCX_TLS=tcp`` makes ranks on different hosts talk real TCP
over the (optionally rate-limited) links.

    import testbed

    ok, why = testbed.available(rate=True, mpi=True)
    with testbed.Hosts(2, rate='3gbit') as hosts:
        result = hosts.mpirun(4, ['python', 'script.py'], ppn=2, timeout=300)
        print(result.returncode, result.output)

Needs root, ``ip``, ``nsenter`` and ``unshare`` (and ``tc`` for a rate). Not part of
the installed library (setup.py packages mpi_kvstore only). See testbed/README.md
for what each module holds.
"""
from .hosts import Hosts
from .jobs import TCP_ENV, RunResult, run_job
from .machine import TestbedError, available, find_mpiexec
from .network import IFACE, NAME_BASE, artifacts, parse_rate
from .registry import cleanup_stale, list_runs, teardown

__all__ = ['IFACE', 'NAME_BASE', 'TCP_ENV', 'Hosts', 'RunResult', 'TestbedError', 'artifacts',
           'available', 'cleanup_stale', 'find_mpiexec', 'list_runs', 'parse_rate', 'run_job',
           'teardown']
