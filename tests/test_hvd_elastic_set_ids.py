"""hvd's process sets on an elastic world after a re-forming (scenarios/hvd_elastic_set_ids.py,
every job under a timeout through test_elastic_run.run_world): a set's Create_group takes
the set's number as its tag (process_sets._members_comm), so every member must number it alike.
4 workers, worker 3 SIGKILLed while the others are in add_process_set([0, 3]): rank 0 (a
member) fails and registers nothing, ranks 1 and 2 (outside it) register it, so their next
numbers differ; the re-forming drops every set, and the set [0, 1] made after it sums both
ranks' values as numpy does on both (before the fix its members' tags differed: the
Create_group never matched and ended at the world's timeout)."""
import os
import re

import numpy as np
from test_elastic_run import run_world

from mpi_harness import SCENARIOS_DIR

SCRIPT = os.path.join(SCENARIOS_DIR, 'hvd_elastic_set_ids.py')


def _values(rank):   # the scenario's values of each rank
    return np.array([10.0 * (rank + 1), rank - 0.5, 3.0], np.float32)


def test_a_set_made_after_a_reforming_is_numbered_alike_on_its_members(tmp_path,
                                                                       mpi_available):
    statuses, out, _ = run_world(tmp_path, 4, script=SCRIPT)
    assert statuses == {0: 0, 1: 0, 2: 0, 3: 9}, (statuses, out[-4000:])
    assert 'worker 0: add_process_set failed' in out, out[-4000:]
    assert 'worker 1: add_process_set returned' in out, out[-4000:]
    for worker in (0, 1):
        found = re.search(r'worker %d: set \[0, 1\] ranks \[0, 1\] sums \[([^\]]*)\]' % worker,
                          out)
        assert found, out[-4000:]
        assert np.array_equal([float(v) for v in found.group(1).split(',')],
                              _values(0) + _values(1))
    for worker in (0, 1, 2):
        assert 'worker %d: done' % worker in out, out[-4000:]
