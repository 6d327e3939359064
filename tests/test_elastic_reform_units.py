"""The bounds of a re-forming, in one process: a blocking MPI step that World runs in a
thread of its own gives up at its deadline, or when the launcher announces a member of the
forming world lost, and keeps what MPI may still touch; World.check ends the stores' reset
once the re-forming's deadline passes; elastic.run_fn tries a reset that lost the world again.
"""
import threading
import time

import pytest

from mpi_kvstore.comm import abandoned
from mpi_kvstore.comm.mpiabi import MPI
from mpi_kvstore.elastic import ObjectState, run_fn
from mpi_kvstore.elastic.exceptions import HorovodInternalError
from mpi_kvstore.elastic.world import World
from mpi_kvstore.launch import rendezvous

pytestmark = pytest.mark.unit

SECRET = rendezvous.new_secret()


def _world(directory='/nonexistent', deadline=0.05):
    world = World(str(directory), SECRET, 0, 2, deadline=deadline)
    world.comm = MPI.COMM_SELF
    world.ids = [0, 1]
    return world


@pytest.mark.skipif(MPI.Query_thread() != MPI.THREAD_MULTIPLE,
                    reason='World runs blocking steps in a thread only under THREAD_MULTIPLE')
def test_a_blocking_step_past_its_deadline_gives_up_and_keeps_its_thread():
    gate = threading.Event()
    before = abandoned.count()
    started = time.monotonic()
    try:
        with pytest.raises(HorovodInternalError, match=r'merging worker 1: no answer in 0\.05 s'):
            _world().bounded(gate.wait, 'merging worker 1')
        assert time.monotonic() - started < 5.0
        assert abandoned.count() == before + 2   # the thread still in the call, its result box
    finally:
        gate.set()


@pytest.mark.skipif(MPI.Query_thread() != MPI.THREAD_MULTIPLE,
                    reason='World runs blocking steps in a thread only under THREAD_MULTIPLE')
def test_a_blocking_step_ends_when_a_member_of_the_forming_world_is_announced_lost(tmp_path):
    gate = threading.Event()
    world = _world(tmp_path, deadline=60.0)
    world._forming = {0, 1}
    threading.Timer(0.05, rendezvous.announce_lost, (str(tmp_path), SECRET, 1, 9)).start()
    started = time.monotonic()
    try:
        with pytest.raises(HorovodInternalError,
                           match=r'accepting worker 2: worker\(s\) \[1\] lost'):
            world.bounded(gate.wait, 'accepting worker 2')
        assert time.monotonic() - started < 30.0
    finally:
        gate.set()


def test_a_lost_worker_outside_the_forming_world_does_not_end_its_steps(tmp_path):
    world = _world(tmp_path, deadline=5.0)
    rendezvous.announce_lost(str(tmp_path), SECRET, 1, 9)
    world._forming = {0}
    assert world.bounded(lambda: 6 * 7, 'accepting worker 2') == 42
    with pytest.raises(HorovodInternalError, match=r'joining the world failed: refused'):
        world.bounded(_refuse, 'joining the world')
    world._forming = None   # the trained world's own collectives see every loss
    with pytest.raises(HorovodInternalError, match=r'worker\(s\) \[1\] lost'):
        world.check()


def _refuse():
    raise RuntimeError('refused')


def test_the_stores_reset_is_bounded_by_the_re_formings_deadline():
    world = _world(deadline=0.05)
    world.check()
    world._settle_by = time.monotonic() - 1.0   # what reform() sets: its end + deadline
    with pytest.raises(HorovodInternalError, match=r're-formed 0\.05 s ago and its stores '
                                                   r'have not reset yet'):
        world.check("the store's collectives")
    world.settled()
    world.check()


def test_with_two_stores_the_bound_lasts_until_the_second_store_reset():
    """The first store's reset does not lift the bound of the second one's (World.settled
    waits for every store on the world); the second's does, and both then sum right."""
    import mxnet as mx

    import mpi_kvstore
    world = _world(deadline=30.0)
    with mpi_kvstore.create('dist_mpi', world=world) as first, \
            mpi_kvstore.create('dist_mpi', world=world) as second:
        world._bound_resets()   # what reform() does once the world formed
        first.reset()
        assert world._settle_by is not None, "the first store's reset lifted the bound"
        world._settle_by -= 60.0   # the re-forming's deadline passed
        with pytest.raises(HorovodInternalError, match=r'its stores have not reset yet'):
            world.check("the store's collectives")
        world._settle_by += 60.0
        second.reset()
        world._settle_by = None if world._settle_by is None else world._settle_by - 60.0
        world.check()
        for kv, value in ((first, 2.0), (second, 3.0)):
            x = mx.nd.full((4,), value)
            kv.pushpull('g', x)
            assert x.asnumpy().tolist() == [value] * 4
    world._bound_resets()   # closed stores do not hold the bound
    world.settled()
    world._settle_by = None if world._settle_by is None else world._settle_by - 60.0
    world.check()


def test_run_fn_re_forms_again_when_the_reset_loses_the_world():
    resets, calls = [], []

    def reset():
        resets.append(len(resets))
        if len(resets) == 1:
            raise HorovodInternalError('the admission: worker(s) [3] lost')

    def train(state):
        calls.append(state.value)
        if len(calls) == 1:
            state.value = 99   # a step past the commit, undone by the restore
            raise HorovodInternalError('allreduce: worker(s) [1] lost')
        return state.value

    state = ObjectState(lambda obj: obj, lambda: 0, value=7)
    assert run_fn(train, reset, limit=5)(state) == 7
    assert resets == [0, 1] and calls == [7, 7]
    state = ObjectState(lambda obj: obj, lambda: 0, value=7)
    calls.clear()
    resets.clear()
    with pytest.raises(RuntimeError, match='2 resets, more than the limit of 1'):
        run_fn(train, reset, limit=1)(state)
