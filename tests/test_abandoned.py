"""A request given up on because its peer is lost stays alive, and so does its buffer.

MPI keeps moving what surviving peers send into such a request's buffers; mpi4py frees the
handle and drops the buffers when the Request object is collected, and MPI then wrote into
freed memory: survivors crashed inside MPI_Comm_accept / MPI_Intercomm_merge while re-forming
(comm/abandoned.py). A receive from this process itself with a tag nobody sends stands in
for a collective whose peer is gone: it never completes.
"""
import gc
import weakref

import numpy as np
import pytest

from mpi_kvstore.comm import abandoned, progress
from mpi_kvstore.comm.mpiabi import MPI
from mpi_kvstore.elastic.exceptions import HorovodInternalError
from mpi_kvstore.elastic.world import World

pytestmark = pytest.mark.unit

NEVER_SENT = 4242


class _Lost(Exception):
    pass


def _pending_receive():
    """A receive that never completes, and a weak reference to its buffer."""
    buf = np.zeros(1024, dtype=np.float32)
    comm = MPI.COMM_SELF.Dup()   # not the builtin one, which MPICH reports pending at exit
    return comm.Irecv(buf, source=0, tag=NEVER_SENT), weakref.ref(buf)


def _world():
    world = World('/nonexistent', 'secret', 0, 1, deadline=0.05)
    world.comm = MPI.COMM_SELF
    world.ids = [0]
    return world


def test_a_world_wait_past_its_deadline_keeps_the_request_and_its_buffer():
    before = abandoned.count()
    request, buf = _pending_receive()
    with pytest.raises(HorovodInternalError, match=r'no answer in 0\.05 s'):
        _world()._wait(request, 'allreduce')
    del request
    gc.collect()
    assert buf() is not None and buf().shape == (1024,)
    assert abandoned.count() == before + 1


def test_a_polled_wait_ended_by_the_abort_check_keeps_the_request_and_its_buffer():
    def lost():
        raise _Lost('a peer is gone')

    before = abandoned.count()
    request, buf = _pending_receive()
    progress.set_abort_check(lost)
    try:
        with pytest.raises(_Lost):
            progress.wait_polling(request, 50)
    finally:
        progress.set_abort_check(None)
    del request
    gc.collect()
    assert buf() is not None
    assert abandoned.count() == before + 1


def test_a_completed_wait_keeps_nothing():
    before = abandoned.count()
    buf = np.arange(8, dtype=np.float64)
    out = np.zeros_like(buf)
    request = MPI.COMM_SELF.Iallreduce(buf, out, op=MPI.SUM)
    _world()._wait(request, 'allreduce')
    progress.wait_polling(MPI.COMM_SELF.Iallreduce(buf, out, op=MPI.SUM), 50)
    np.testing.assert_array_equal(out, np.arange(8))
    assert abandoned.count() == before
