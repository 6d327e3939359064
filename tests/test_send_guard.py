"""A survivor starting collectives on a world whose peer was SIGKILLed does not crash.

MPICH's UCX endpoints have no error handling: once UCX has seen the dead peer's connection
fail, a send to it fails at once and MPICH 5.0.2 then dereferences the request it never
made (SIGSEGV in MPI_Iallreduce, every run of this scenario without the guard). Elastic
workers get MPI_KVSTORE_GUARD_SENDS=1 from the supervisor, and comm/sendguard.py then makes
such sends stay pending: the survivor's collectives time out, and it re-forms and
allreduces over a new world. Three launches of `mpiexec -n 1`, over UCX's TCP transport.
"""
import re
import threading

import pytest

from mpi_harness import MPIRunError, run_mpi

GUARDED = {'MPICH_CH4_NETMOD': 'ucx', 'UCX_TLS': 'tcp', 'MPI_KVSTORE_GUARD_SENDS': '1'}


def _launch(role, directory, outputs):
    try:
        outputs[role] = run_mpi(1, 'send_guard_peer.py', role, directory, timeout=120,
                                env=GUARDED)
    except MPIRunError as exc:
        outputs[role] = exc


def test_a_survivor_starting_collectives_with_a_killed_peer_goes_on(tmp_path, mpi_available):
    outputs = {}
    threads = [threading.Thread(target=_launch, args=(role, str(tmp_path), outputs))
               for role in ('root', 'victim', 'late')]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(150)
    root, late = outputs['root'], outputs['late']
    assert isinstance(outputs['victim'], MPIRunError)   # it SIGKILLed itself
    assert 'Killed' in str(outputs['victim']) or 'signal 9' in str(outputs['victim'])
    assert isinstance(root, str), str(root)[-3000:]
    assert isinstance(late, str), str(late)[-3000:]
    assert 'root: guarded ucp_am_send_nbx,ucp_tag_send_nbx,ucp_tag_send_sync_nbx' in root
    done, started = map(int, re.search(r'root: (\d+) collectives done, (\d+) started after '
                                       r'the loss', root).groups())
    assert done == 50 and started >= 5, root[-2000:]
    # 1.5 + 0 and 1.5 + 1, summed over the new world of 2
    for out, role in ((root, 'root'), (late, 'late')):
        assert '%s: new world of 2: [4.0, 4.0, 4.0, 4.0]' % role in out, out[-2000:]


if __name__ == '__main__':
    raise SystemExit(pytest.main([__file__, '-q']))
