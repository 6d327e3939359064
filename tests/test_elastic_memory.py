"""In-memory commits and Horovod's elastic pattern, in this process (one rank):
elastic.State's commit/restore/sync against an independent replay, run_fn's resets,
ObjectState, host updates, the reset limit, hvd.elastic's names, and a commit to a full disk
(the writer fails half-way through): a clear error, the previous commit whole on disk and in
memory, no temporary directory left.

The multi-process runs are in tests/test_elastic.py (the supervisor's relaunch from disk) and
tests/test_elastic_run.py (hvd.elastic.run over 2 ranks, a full tmpfs)."""
import errno
import os

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, gluon

from mpi_kvstore import elastic
from mpi_kvstore.elastic import disk


def make_net(seed=7):
    net = gluon.nn.Dense(3, in_units=4)
    mx.random.seed(seed)
    net.initialize(mx.init.Xavier())
    trainer = gluon.Trainer(net.collect_params(), 'adam', {'learning_rate': 0.05},
                            kvstore=None, update_on_kvstore=False)
    return net, trainer


def step(net, trainer, number):
    rng = np.random.RandomState(100 + number)
    data = mx.nd.array(rng.uniform(-1, 1, (8, 4)))
    label = mx.nd.array(rng.uniform(-1, 1, (8, 3)))
    with autograd.record():
        loss = ((net(data) - label) ** 2).mean()
    loss.backward()
    trainer.step(8)


def weights(net):
    return [p.data().asnumpy().copy() for p in net.collect_params().values()]


def replay(steps):
    """The weights an uninterrupted run reaches after ``steps`` steps."""
    net, trainer = make_net()
    for number in range(steps):
        step(net, trainer, number)
    return weights(net)


def test_restore_goes_back_to_the_commit_with_the_optimizer_states(tmp_path):
    """Adam's moments and update counts come back too: replaying the lost steps after a
    restore ends bitwise equal to a run that never lost them."""
    net, trainer = make_net()
    state = elastic.State(net.collect_params(), trainer, directory=False, step=0)
    assert state.directory is None
    for number in range(3):
        step(net, trainer, number)
    state.step = 3
    np.random.seed(5)
    state.commit()
    draw = np.random.rand()
    for number in range(3, 6):     # lost work
        step(net, trainer, number)
    state.step = 6
    state.restore()
    assert state.step == 3
    assert np.random.rand() == draw          # this rank's committed random state
    for got, want in zip(weights(net), replay(3)):
        assert np.array_equal(got, want)
    for number in range(state.step, 6):
        step(net, trainer, number)
    for got, want in zip(weights(net), replay(6)):
        assert np.array_equal(got, want), np.abs(got - want).max()
    assert os.listdir(tmp_path) == []


def test_memory_only_state_writes_nothing_and_sync_keeps_one_rank(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    arrays = {'w': mx.nd.array(np.arange(4.0))}
    state = elastic.State(arrays, directory=False, epoch=1)
    arrays['w'][:] = 9
    state.sync()               # one rank: its own values become the commit
    arrays['w'][:] = 0
    state.restore()
    assert np.array_equal(arrays['w'].asnumpy(), np.full(4, 9.0))
    assert state.commit() == 1 and os.listdir(tmp_path) == []


def test_run_fn_restores_resets_and_calls_again():
    """A HorovodInternalError after the commit at step 4 of 8: the state goes back to step
    4, the world reset runs, the reset callbacks run, and the function ends as an
    uninterrupted run would."""
    net, trainer = make_net()
    state = elastic.State(net.collect_params(), trainer, directory=False, step=0)
    events = []
    state.register_reset_callbacks([lambda: events.append(('callback', state.step))])
    calls = []

    def train(state):
        calls.append(state.step)
        for number in range(state.step, 8):
            step(net, trainer, number)
            state.step = number + 1
            if state.step % 4 == 0:
                state.commit()
            if state.step == 6 and len(calls) == 1:
                raise elastic.HorovodInternalError('a peer was lost')
        return 'done'

    run = elastic.run_fn(train, lambda: events.append(('reset', state.step)), limit=0)
    assert run(state) == 'done'
    assert calls == [0, 4]
    assert events == [('reset', 4), ('callback', 4)]
    for got, want in zip(weights(net), replay(8)):
        assert np.array_equal(got, want), np.abs(got - want).max()


def test_host_updates_interrupt_at_the_next_commit_without_a_restore():
    values = {'w': mx.nd.zeros((2,))}
    state = elastic.State(values, directory=False, step=0)
    resets, calls = [], []

    def train(state):
        calls.append(state.step)
        while state.step < 4:
            values['w'][:] += 1
            state.step += 1
            if state.step == 2 and len(calls) == 1:
                elastic.notify_hosts_updated(1.0, removed_only=True)
            state.commit()
        return state.step

    assert elastic.run_fn(train, lambda: resets.append(state.step))(state) == 4
    assert calls == [0, 2] and resets == [2]   # no rollback: step 2 was kept
    assert np.array_equal(values['w'].asnumpy(), np.full(2, 4.0))
    state.check_host_updates()   # the update was consumed: nothing raised now


def test_the_reset_limit_ends_the_run():
    state = elastic.ObjectState(lambda obj: obj, lambda: 0, tries=0)

    def train(state):
        state.tries += 1
        raise elastic.HorovodInternalError('lost again')

    with pytest.raises(RuntimeError, match='2 resets, more than the limit of 1'):
        elastic.run_fn(train, lambda: None, limit=1)(state)
    assert state.tries == 0   # restored to the committed value after each failure


def test_object_state_commits_restores_and_syncs():
    sent = []
    state = elastic.ObjectState(lambda obj: sent.append(obj) or {'epoch': 7, 'batch': 1},
                                lambda: 0, epoch=0, batch=0)
    state.epoch = 3
    state.save()
    state.epoch, state.batch = 5, 9
    state.restore()
    assert (state.epoch, state.batch) == (3, 0)
    state.sync()
    assert sent == [{'epoch': 3, 'batch': 0}] and (state.epoch, state.batch) == (7, 1)


def test_hvd_elastic_has_horovods_names():
    import mpi_kvstore.horovod as hvd
    for name in ('run', 'State', 'ObjectState', 'MXNetState', 'HorovodInternalError',
                 'HostsUpdatedInterrupt'):
        assert hasattr(hvd.elastic, name), name
    assert issubclass(hvd.elastic.MXNetState, hvd.elastic.State)
    assert issubclass(hvd.elastic.ObjectState, hvd.elastic.State)
    assert issubclass(hvd.elastic.HorovodInternalError, RuntimeError)
    assert hvd.elastic.HostsUpdatedInterrupt(True).skip_sync is True
    for name in ('commit', 'restore', 'sync', 'check_host_updates',
                 'register_reset_callbacks'):
        assert callable(getattr(hvd.elastic.MXNetState, name)), name


def test_a_reset_store_gets_back_the_restored_weights_and_optimizer_states():
    """The optimizer in the store (gluon.Trainer on an MPIKVStore, update_on_kvstore): 3
    steps, a commit, 2 more steps, then what run_fn does after a lost rank (restore, the
    store's reset, which empties its keys and states, sync): 3 more steps end equal to 6
    uninterrupted steps of Adam on the ranks (a replay without a store)."""
    import mpi_kvstore
    from mpi_kvstore.comm.mpiabi import MPI
    net, _ = make_net()
    with mpi_kvstore.create('dist_mpi') as kv:
        trainer = gluon.Trainer(net.collect_params(), 'adam', {'learning_rate': 0.05},
                                kvstore=kv, update_on_kvstore=True)
        state = elastic.State(net.collect_params(), trainer, directory=False)
        for number in range(3):
            step(net, trainer, number)
        assert trainer._update_on_kvstore
        state.commit()
        for number in range(3, 5):
            step(net, trainer, number)
        state.restore()
        assert state.must_sync_after_reset()
        kv.reset(MPI.COMM_WORLD)
        assert not kv._updater.states   # the reset lost them; the sync gives them back
        state.sync()
        assert not state.must_sync_after_reset()
        assert sorted(kv._updater.states) == [0, 1]
        for number in range(3, 6):
            step(net, trainer, number)
        got = weights(net)
    for mine, want in zip(got, replay(6)):
        assert np.allclose(mine, want, rtol=1e-5, atol=1e-6), np.abs(mine - want).max()
    assert not np.allclose(got[0], replay(5)[0], rtol=1e-5, atol=1e-6)


def _failing_after(limit):
    """A replacement for open() whose files fail with ENOSPC once ``limit`` bytes went
    into commit temporaries (a disk that fills during a commit)."""
    real_open = open
    written = [0]

    class Full:
        def __init__(self, fh):
            self._fh = fh

        def write(self, data):
            if written[0] + len(data) > limit:
                raise OSError(errno.ENOSPC, 'No space left on device')
            written[0] += len(data)
            return self._fh.write(data)

        def __getattr__(self, name):
            return getattr(self._fh, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self._fh.__exit__(*exc)

    def opener(path, mode='r', *args, **kwargs):
        fh = real_open(path, mode, *args, **kwargs)
        if 'w' in mode and disk.TEMPORARY_PREFIX in str(path):
            return Full(fh)
        return fh
    return opener


def test_a_commit_to_a_full_disk_leaves_the_previous_one_and_no_temporary(tmp_path,
                                                                         monkeypatch):
    values = {'w': mx.nd.array(np.arange(1000.0))}
    state = elastic.State(values, directory=str(tmp_path), step=0)
    state.step = 1
    assert state.commit() == 1
    values['w'][:] = -1
    state.step = 2
    monkeypatch.setattr('builtins.open', _failing_after(2000))   # params.pkl is ~8 KB
    for _ in range(10):
        with pytest.raises(OSError, match=r'commit 2 to .* failed on rank 0 \(OSError: '
                                          r'\[Errno 28\] No space left on device\); commit 1 '
                                          r'stays the last'):
            state.commit()
    monkeypatch.undo()
    assert state.number == 1
    assert sorted(os.listdir(tmp_path)) == ['commit-00000001']   # no temporary left
    found = disk.read_commit(os.path.join(tmp_path, 'commit-00000001'))
    assert np.array_equal(found['params'][0][1], np.arange(1000.0))
    assert found['meta']['extra'] == {'step': 1}
    state.restore()            # the in-memory commit is the previous one too
    assert state.step == 1 and np.array_equal(values['w'].asnumpy(), np.arange(1000.0))
    state.step = 2
    assert state.commit() == 2   # space again: training goes on committing
    assert sorted(os.listdir(tmp_path)) == ['commit-00000001', 'commit-00000002']
