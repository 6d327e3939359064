"""A store's build on an elastic world is bounded, in one process: every collective of it
(the agreed options, the host count) is a nonblocking request waited by the world's
World.waiter, so a peer that never comes, or one the launcher announces lost, ends the build
with HorovodInternalError instead of a wait in MPI forever (Split_type, which MPI has in
blocking form only, is not called on an elastic world: topology.host_spread counts the hosts
and the oversubscription from one allgather). The peer here is a rank of a communicator of
2 that is COMM_SELF underneath, whose requests of the missing peer's part never complete.
tests/test_elastic_reform.py has a worker SIGKILLed inside the host count of a real reset.
"""
import threading
import time

import numpy as np
import pytest

import mpi_kvstore
from mpi_kvstore.comm import abandoned, topology
from mpi_kvstore.comm.mpiabi import MPI
from mpi_kvstore.elastic.exceptions import HorovodInternalError
from mpi_kvstore.elastic.world import World
from mpi_kvstore.launch import rendezvous

pytestmark = pytest.mark.unit

SECRET = rendezvous.new_secret()
_TAG = 4242   # the tag of the receives that stand for a peer's part that never comes


class _TwoRanks:
    """Rank 0 of 2 on COMM_SELF: the agreement's allreduce completes (every rank alike: the
    options agree) unless ``agrees`` is false; the host count's allgather never does, as a
    peer's that is gone. Each request left pending is a receive on COMM_SELF, completed by
    :meth:`release` once the test is done (so that MPI ends with none pending)."""

    def __init__(self, agrees=True):
        self.agrees = agrees
        self.pending = []   # the receives left pending, with their buffers

    def Get_size(self):
        return 2

    def Get_rank(self):
        return 0

    def _never(self):
        buf = np.zeros(1, np.uint8)
        request = MPI.COMM_SELF.Irecv([buf, MPI.BYTE], source=0, tag=_TAG)
        self.pending.append((request, buf))
        return request

    def Iallreduce(self, send, recv, op):
        return MPI.COMM_SELF.Iallreduce(send, recv, op=op) if self.agrees else self._never()

    def Iallgather(self, send, recv):
        return self._never()

    def release(self):
        for request, _ in self.pending:
            MPI.COMM_SELF.Send([np.zeros(1, np.uint8), MPI.BYTE], dest=0, tag=_TAG)
            request.Wait()   # freed: MPI ends with no request of COMM_SELF left
        self.pending = []


def _world(directory, deadline=60.0, timeout=60.0):
    world = World(str(directory), SECRET, 0, 2, deadline=deadline, timeout=timeout)
    world.comm, world.ids = MPI.COMM_SELF, [0, 1]
    return world


@pytest.mark.parametrize('agrees, where', [(False, 'the agreed options'),
                                           (True, 'the host count')])
def test_a_peer_that_never_comes_ends_a_first_build_at_the_worlds_timeout(tmp_path, agrees,
                                                                          where):
    """A store's first build waits up to the world's timeout (its ranks may come to it
    apart), then raises HorovodInternalError; the requests it gave up on are kept."""
    comm, world = _TwoRanks(agrees), _world(tmp_path, deadline=60.0, timeout=0.3)
    before = abandoned.count()
    started = time.monotonic()
    try:
        with pytest.raises(HorovodInternalError,
                           match=r"the store's build: no answer in 0\.3 s"):
            mpi_kvstore.create('dist_mpi', comm=comm, world=world)
        # not before the timeout; the message says the timeout, not a loss, ended it (no
        # upper bound on the time: a loaded machine may take long)
        assert time.monotonic() - started >= 0.3, where
        assert abandoned.count() > before   # MPI may still write into the request's buffers
    finally:
        comm.release()


def test_a_peer_announced_lost_ends_the_host_count_before_the_deadline(tmp_path):
    comm, world = _TwoRanks(), _world(tmp_path, deadline=60.0, timeout=60.0)
    announced = threading.Event()

    def announce():   # the flag first: set before the loss can be seen
        announced.set()
        rendezvous.announce_lost(str(tmp_path), SECRET, 1, 9)

    threading.Timer(0.2, announce).start()
    try:
        with pytest.raises(HorovodInternalError,
                           match=r"the store's build: worker\(s\) \[1\] lost"):
            topology.resolve(mpi_kvstore.Config(environ={}), comm, elastic=True,
                             wait=world.waiter("the store's build"))
        # by the loss (the message), not before it: no clock (a timer may fire early
        # against a clock read after it started, as one did at 0.187 s)
        assert announced.is_set()
    finally:
        comm.release()


def test_a_reset_is_bounded_by_the_worlds_deadline_and_the_store_goes_on_after_it(tmp_path):
    """A reset's build waits up to the world's deadline (the re-forming's), not its timeout;
    the store stays on its old world and resets again once the world re-forms."""
    import mxnet as mx
    world = _world(tmp_path, deadline=0.3, timeout=600.0)
    comm = _TwoRanks()
    with mpi_kvstore.create('dist_mpi', world=world) as kv:
        try:
            with pytest.raises(HorovodInternalError,
                               match=r"the store's build: no answer in 0\.3 s"):
                kv.reset(comm)
        finally:
            comm.release()
        kv.reset(MPI.COMM_SELF)
        x = mx.nd.full((3,), 2.0)
        kv.pushpull('g', x)
        assert x.asnumpy().tolist() == [2.0] * 3 and (kv.rank, kv.num_workers) == (0, 1)


@pytest.mark.parametrize('facts, spread', [
    ([('a', [0, 1]), ('a', [0, 1])], (1, False)),         # 2 ranks, 2 cores
    ([('a', [0]), ('a', [0])], (1, True)),                # both on core 0
    ([('a', [0]), ('a', [1]), ('a', [0])], (1, True)),    # 3 ranks, the union is 2 cores
    ([('a', [0]), ('b', [0]), ('c', [0])], (3, False)),   # one rank a host
    ([('a', [0]), ('b', [0]), ('b', [0])], (2, True)),    # host b outnumbers its core
])
def test_the_host_spread_counts_hosts_and_their_cores_as_split_type_would(facts, spread):
    assert topology.spread_of(facts) == spread


def test_one_rank_spans_one_host_with_no_request():
    assert topology.host_spread(MPI.COMM_SELF, wait=_no_wait) == (1, False)
    assert topology.places(MPI.COMM_SELF, wait=_no_wait) == (0, 1, 0, 1)


@pytest.mark.parametrize('hosts, expected', [
    # (local rank, local size, cross rank, cross size) of each rank, worked out by hand
    ('aaa', [(0, 3, 0, 1), (1, 3, 0, 1), (2, 3, 0, 1)]),
    ('abc', [(0, 1, 0, 3), (0, 1, 1, 3), (0, 1, 2, 3)]),
    ('aba', [(0, 2, 0, 2), (0, 1, 1, 2), (1, 2, 0, 1)]),
    ('qpqq', [(0, 3, 0, 2), (0, 1, 1, 2), (1, 3, 0, 1), (2, 3, 0, 1)]),
    ('baab', [(0, 2, 0, 2), (0, 2, 1, 2), (1, 2, 0, 2), (1, 2, 1, 2)]),
    ('abbcab', [(0, 2, 0, 3), (0, 3, 1, 3), (1, 3, 0, 2), (0, 1, 2, 3), (1, 2, 1, 2),
                (2, 3, 0, 1)]),
])
def test_hvd_places_a_rank_by_its_hosts_as_node_comm_and_split_would(hosts, expected):
    """hvd's local and cross ranks on an elastic world, from every rank's host (what the
    one allgather brings): node_comm orders a host's ranks by rank, Split(local rank, rank)
    the ranks of one local rank. tests/test_topology.py compares them with MPI's splits."""
    assert [topology.places_of(list(hosts), me) for me in range(len(hosts))] == expected


@pytest.fixture
def hvd_state():
    """hvd's state (horovod/_state.py: the one dict that init and the process sets share),
    empty for the test, and as it was after it."""
    from mpi_kvstore.horovod._state import _state
    kept = dict(_state)
    _state.clear()
    yield _state
    _state.clear()
    _state.update(kept)


@pytest.mark.parametrize('timeout, lost, why', [
    (0.3, False, r'no answer in 0\.3 s'), (60.0, True, r'worker\(s\) \[1\] lost')])
def test_hvd_init_on_an_elastic_world_ends_when_a_peer_never_comes(monkeypatch, tmp_path,
                                                                    hvd_state, timeout, lost,
                                                                    why):
    """hvd.init's local and cross ranks on an elastic world: one allgather of the hosts,
    waited by the world (no Split_type, no Split: blocking MPI a lost peer leaves waiting
    forever). A peer that never comes ends init at the world's timeout, one announced lost
    before it. The store init builds first is a stand-in (its build: the tests above)."""
    from mpi_kvstore.horovod import basics, process_sets
    comm, world = _TwoRanks(), _world(tmp_path, deadline=60.0, timeout=timeout)
    world.comm = comm
    monkeypatch.setattr(basics, '_elastic_world', lambda: world)
    monkeypatch.setattr(basics, 'MPIKVStore', lambda *args, **kwargs: _Built(kwargs))
    monkeypatch.setattr(basics, '_left_world', [])
    started = time.monotonic()   # before the timer: its 0.2 s counts from after this
    if lost:
        threading.Timer(0.2, rendezvous.announce_lost, (str(tmp_path), SECRET, 1, 9)).start()
    try:
        with pytest.raises(HorovodInternalError, match='the ranks on each host: ' + why):
            basics.init()
        assert time.monotonic() - started >= 0.2   # by the timeout or the loss (the message)
        assert len(comm.pending) == 1   # the lengths' request
        # hvd as before the call, the store it built (on the world) closed, and the world
        # kept for the next init, which re-forms it
        assert hvd_state == {} and not basics.is_initialized()
        assert _BUILT[-1].options['world'] is world and _BUILT[-1].closed
        assert process_sets.global_process_set._store is None
        assert process_sets.global_process_set.ranks == []
        assert basics._left_world == [(world, True)]
    finally:
        comm.release()


_BUILT = []   # every _Built, in order


class _Built:
    timeline = None

    def __init__(self, options):
        self.options, self.closed = options, False
        _BUILT.append(self)

    def close(self):
        self.closed = True


def test_hvd_identifies_a_reset_world_within_the_reforming_deadline(tmp_path, hvd_state):
    """reform_world's identification waits up to the world's deadline (the re-forming's),
    not its timeout."""
    from mpi_kvstore.horovod import basics
    comm, world = _TwoRanks(), _world(tmp_path, deadline=0.3, timeout=600.0)
    try:
        with pytest.raises(HorovodInternalError,
                           match=r'the ranks on each host: no answer in 0\.3 s'):
            basics._identify(comm, world.waiter('the ranks on each host'))
        assert hvd_state == {}   # the message names the deadline, not the timeout
    finally:
        comm.release()


def _no_wait(request, keep=()):
    raise AssertionError('a world of one waited for a request')


class _Members(_TwoRanks):
    """_TwoRanks whose Create_group (a process set's communicator) waits for ``gate`` as for
    a member that never comes (at most 60 s: a test that fails must not hang)."""

    def __init__(self):
        super().__init__()
        self.gate, self.created = threading.Event(), []

    def Get_group(self):
        return _Group()

    def Create_group(self, group, tag):
        self.created.append((group.ranks, tag))
        self.gate.wait(60)
        return MPI.COMM_NULL


class _Group:
    ranks = None

    def Incl(self, ranks):
        group = _Group()
        group.ranks = list(ranks)
        return group

    def Free(self):
        pass


def _hvd_on(hvd_state, comm, world):
    """hvd's state as init leaves it on ``world`` (rank 0 of 2 on ``comm``)."""
    import mpi_kvstore.horovod as hvd
    hvd_state.update(
        store=_Built({}), options={}, world=world, sets={0: hvd.global_process_set},
        next_id=1, comm=comm, rank=0, size=2, local=(0, 1), cross=(0, 2))
    return hvd


def test_add_process_set_on_an_elastic_world_ends_when_a_member_never_comes(hvd_state,
                                                                          tmp_path):
    """A process set's communicator on an elastic world: Create_group (collective over the
    set's members only, blocking in MPI) in a thread of its own, given up on at the world's
    timeout with HorovodInternalError, the thread and the group it reads kept; nothing is
    registered. A rank outside a set makes no MPI call for it."""
    comm, world = _Members(), _world(tmp_path, deadline=60.0, timeout=0.3)
    world.comm = comm
    hvd = _hvd_on(hvd_state, comm, world)
    before = abandoned.count()
    started = time.monotonic()
    try:
        with pytest.raises(HorovodInternalError,
                           match=r'the process set \[0, 1\]: no answer in 0\.3 s'):
            hvd.add_process_set([0, 1])
        assert time.monotonic() - started >= 0.3   # the timeout, not the deadline (60 s)
        assert comm.created == [([0, 1], 1)]   # the set's number is its tag
        assert abandoned.count() == before + 3   # the thread, its result box, the group
        assert list(hvd_state['sets']) == [0] and hvd_state['next_id'] == 1
        outside = hvd.add_process_set([1])
        assert comm.created == [([0, 1], 1)] and outside._store is None
        assert (outside.process_set_id, outside.included(), hvd_state['next_id']) == (
            1, False, 2)
    finally:
        comm.gate.set()


def test_add_process_set_from_a_communicator_is_bounded_on_an_elastic_world(hvd_state,
                                                                           tmp_path):
    """A set built from a communicator learns its members from one allgather on the world,
    waited as the world waits (a peer that never comes: HorovodInternalError at the
    world's timeout), not from a blocking one."""
    comm, world = _Members(), _world(tmp_path, deadline=60.0, timeout=0.3)
    world.comm = comm
    hvd = _hvd_on(hvd_state, comm, world)
    try:
        with pytest.raises(HorovodInternalError,
                           match=r"the process set's members: no answer in 0\.3 s"):
            hvd.add_process_set(hvd.ProcessSet(MPI.COMM_SELF))
        assert len(comm.pending) == 1 and comm.created == []
        assert list(hvd_state['sets']) == [0]
    finally:
        comm.release()


def test_a_store_and_hvd_on_one_world_gather_its_hosts_once(monkeypatch, tmp_path):
    """An elastic init or reset builds its stores (the host count) and places hvd's ranks
    from ONE allgather of the hosts on the world's communicator (World.waiter's memo); a
    communicator not the world's (a process set's) gathers its own, and a re-formed world's
    new one gathers anew."""
    world = _world(tmp_path)
    world.comm = comm = _TwoRanks()
    gathered = []

    def allgather(self, obj):
        gathered.append(self.comm)
        return [obj, ('another host', [0])]
    monkeypatch.setattr(topology._Polled, 'allgather', allgather)
    config, why = topology.resolve(mpi_kvstore.Config(environ={}), comm, elastic=True,
                                   wait=world.waiter("the store's build"))
    assert why.startswith('mpi_kvstore: 2 hosts') and config.design == 'funneled'
    assert topology.host_spread(comm, world.waiter("another store's build")) == (2, False)
    assert topology.places(comm, world.waiter('the ranks on each host')) == (0, 1, 0, 2)
    assert gathered == [comm]
    subset = _TwoRanks()
    for _ in range(2):
        topology.host_spread(subset, world.waiter("a process set's store"))
    assert gathered == [comm, subset, subset]
    world.comm = again = _TwoRanks()   # what a re-forming does
    for _ in range(2):
        assert topology.places(again, world.waiter('the ranks on each host')) == (0, 1, 0, 2)
    assert gathered == [comm, subset, subset, again]


def test_a_failed_elastic_init_leaves_hvd_as_before_and_the_next_one_re_forms(monkeypatch,
                                                                              tmp_path):
    """An elastic init that fails after its world formed and its store was built (here a
    HorovodInternalError injected where it places its ranks) leaves hvd uninitialized, its
    store closed; the next init re-forms the same world (a first forming would meet
    nobody) and runs: a world of one here, whose allreduce is its own values."""
    import mxnet as mx

    from mpi_kvstore.horovod import basics, process_sets
    from mpi_kvstore.store.kvstore import MPIKVStore
    for name, value in ((rendezvous.DIR_ENV, str(tmp_path)), (rendezvous.SECRET_ENV, SECRET),
                        (rendezvous.ID_ENV, '0'), (rendezvous.NP_ENV, '1')):
        monkeypatch.setenv(name, value)
    for name in (rendezvous.JOIN_ENV, rendezvous.MIN_NP_ENV, rendezvous.TIMEOUT_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(basics, '_left_world', [])
    closed, identify = [], basics._identify

    def close(store):
        closed.append(store)
        real_close(store)
    real_close = MPIKVStore.close
    monkeypatch.setattr(MPIKVStore, 'close', close)

    def failing(comm, wait=None):
        monkeypatch.setattr(basics, '_identify', identify)   # once
        raise HorovodInternalError('the ranks on each host: injected')
    monkeypatch.setattr(basics, '_identify', failing)
    with pytest.raises(HorovodInternalError, match='injected'):
        basics.init()
    assert basics._state == {} and not basics.is_initialized() and len(closed) == 1
    assert process_sets.global_process_set._store is None
    [(world, reform)] = basics._left_world
    assert reform and world.generation == 0
    try:
        basics.init()
        assert basics.elastic_world() is world and world.generation == 1
        assert (basics.rank(), basics.size(), basics.store().num_workers) == (0, 1, 1)
        import mpi_kvstore.horovod as hvd
        got = hvd.allreduce(mx.nd.array([1.5, -2.0, 4.0]), op=hvd.Sum)
        assert got.asnumpy().tolist() == [1.5, -2.0, 4.0]
    finally:
        basics.shutdown()
    assert basics._left_world == [] and len(closed) == 2
