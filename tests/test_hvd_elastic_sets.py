"""hvd's process sets on an elastic world, on workers that are each their own launch (every
job under a timeout, through test_elastic_run.run_world, which leaves nothing running;
scenarios/hvd_elastic_sets.py):

- 3 workers: a set of ranks [0, 2] and one built from a communicator of ranks 1 and 2 sum
  each member's values as numpy does; init gathers the hosts on the world once, for its
  store and for hvd's ranks alike, and a reset of the world once again;
- 3 workers, worker 2 SIGKILLed 1 s after the others enter add_process_set([0, 2]): rank
  0's Create_group of the set (blocking in MPI) waits for it in a thread of its own, which
  the announced loss ends with HorovodInternalError, not the world's timeout (rank 1, outside
  the set, makes no MPI call); the survivors re-form the world past the abandoned
  Create_group, and allreduce and a set of one sum right there.
"""
import os
import re

import numpy as np
from test_elastic_run import run_world

from mpi_harness import SCENARIOS_DIR

SCRIPT = os.path.join(SCENARIOS_DIR, 'hvd_elastic_sets.py')


def _values(rank):   # the scenario's values of each rank
    return np.array([10.0 * (rank + 1), rank - 0.5, 3.0], np.float32)


def _sums(out, worker, name):
    found = re.search(r'worker %d: set %s ranks \[[\d, ]+\] sums \[([^\]]*)\]'
                      % (worker, re.escape(name)), out)
    assert found, out[-4000:]
    return np.array([float(v) for v in found.group(1).split(',')])


def test_process_sets_on_an_elastic_world_sum_right(tmp_path, mpi_available):
    statuses, out, _ = run_world(tmp_path, 3, script=SCRIPT)
    assert statuses == {0: 0, 1: 0, 2: 0}, (statuses, out[-4000:])
    pair = _values(0) + _values(2)
    other = _values(1) + _values(2)
    for worker in (0, 2):
        assert np.array_equal(_sums(out, worker, '[0, 2]'), pair), out[-4000:]
    for worker in (1, 2):
        assert np.array_equal(_sums(out, worker, 'from a communicator'), other), out[-4000:]
    assert 'worker 1: set [0, 2]' not in out and 'worker 0: set from' not in out
    for worker in range(3):
        assert ('worker %d: rank %d of 3, hosts gathered 1 time(s) by init' % (worker, worker)
                in out), out[-4000:]
        assert ('worker %d: reset, rank %d of 3, hosts gathered 1 time(s) by the reset'
                % (worker, worker) in out), out[-4000:]


def test_a_worker_lost_in_add_process_set_ends_it_and_the_survivors_go_on(tmp_path,
                                                                           mpi_available):
    statuses, out, _ = run_world(tmp_path, 3, '--die-id', 2, script=SCRIPT)
    assert statuses == {0: 0, 1: 0, 2: 9}, (statuses, out[-4000:])
    assert 'worker 2: dies before add_process_set' in out, out[-4000:]
    both = _values(0) + _values(1)
    assert np.array_equal(_sums(out, 1, '[1]'), _values(1)), out[-4000:]
    # by the loss the launcher announced (the message), not the timeout
    assert re.search(r'worker 0: add_process_set ended in [\d.]+ s: the process set \[0, 2\]: '
                     r'worker\(s\) \[2\] lost', out), out[-4000:]
    assert 'worker 1: add_process_set returned' in out, out[-4000:]   # not a member
    for worker in (0, 1):
        found = re.search(r'worker %d: re-formed, rank %d of 2, sums \[([^\]]*)\]'
                          % (worker, worker), out)
        assert found, out[-4000:]
        assert np.array_equal([float(v) for v in found.group(1).split(',')], both)
        assert 'worker %d: done' % worker in out
