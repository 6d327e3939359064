"""One process: what a lost world's drain (mpi_kvstore.store.job) does with the requests
still pending. A request whose engine op MXNet skipped (an op failed on its array first)
never reaches its design: the drain must see that (a fence behind its op) and end it with
the world's error, not wait DRAIN_TIMEOUT for an op that never runs. A request whose
collective went through a staging buffer must pass the error on to what delivers it, so
that a read begun before the loss raises rather than get NaN. The store works after the
reset.
"""
import logging

import mxnet as mx
import pytest
from test_elastic_store import _FakeWorld  # a world of this one process, lost on demand

import mpi_kvstore
from mpi_kvstore.engine import core as engine
from mpi_kvstore.store import job as job_module


def test_a_request_whose_engine_op_mxnet_skipped_ends_with_the_lost_world(monkeypatch, caplog):
    monkeypatch.setattr(job_module, 'DRAIN_TIMEOUT', 20.0)
    world = _FakeWorld()
    with mpi_kvstore.create('dist_mpi', world=world) as kv:
        x = mx.nd.full((5,), 2.0)
        kv.pushpull('g', x)
        assert x.asnumpy().tolist() == [2.0] * 5
        # an op of the failed step fails on x: MXNet skips the store's next op on it
        engine.push(lambda completion: completion.done('mpi_kvstore: the step failed'),
                    mutable=[x], name='test_failed_step')
        kv.pushpull('g', x)
        job = kv._job
        waiting = [req for req in job.pending if not req.done]
        assert len(waiting) == 1 and waiting[0].completion is None
        world.lost = 'worker 1 lost'
        with caplog.at_level(logging.ERROR, logger='mpi_kvstore.store.job'):
            with pytest.raises(RuntimeError, match='worker 1 lost'):
                job.check_world()
            job._join_drainer()
        assert waiting[0].done, 'the drain waited for an op MXNet skipped'
        assert 'worker 1 lost' in str(waiting[0].error)
        assert waiting[0].completion is None   # no engine op of its ever ran
        assert 'never reached their engine op' not in caplog.text
        _goes_on_after_the_reset(world, kv)


def test_a_read_begun_before_the_loss_raises_where_the_collective_went_through_staging():
    """The optimizer in the store: the push reduces the gradient in a staging buffer, then
    the update and the pull deliver it. A read of the pull's output begun before the loss
    (queued before any poisoning) raises the lost world's error, not the poisoned buffer's
    NaN delivered as data."""
    import threading

    from mpi_kvstore.elastic.exceptions import LostWorldRead
    world = _FakeWorld()
    kv = mpi_kvstore.create('dist_mpi', world=world)
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.5))
    kv.init('w', mx.nd.ones((5,)))
    grad, out = mx.nd.ones((5,)), mx.nd.zeros((5,))
    held = []   # the gradient's last op of the step: it completes once the world is lost
    engine.push(held.append, mutable=[grad], name='test_backward')
    kv.push('w', grad)
    kv.pull('w', out=out)
    got = []
    reader = threading.Thread(target=lambda: got.append(_read(out)))
    reader.start()
    world.lost = 'worker 1 lost'
    with pytest.raises(RuntimeError, match='worker 1 lost'):
        kv._job.check_world()
    kv._job._ended._thread.join(10)   # one rank's collective would not wait for the others
    held[0].done()
    reader.join(30)
    kv._job._join_drainer()
    assert got and isinstance(got[0], LostWorldRead), got
    assert 'worker 1 lost' in str(got[0])
    world.lost = None
    kv.reset()
    kv.init('v', mx.nd.full((3,), 2.0))
    y = mx.nd.zeros((3,))
    kv.pull('v', out=y)
    assert y.asnumpy().tolist() == [2.0] * 3
    kv.close()


def _read(array):
    try:
        return array.asnumpy().tolist()
    except Exception as err:   # what the read raised is what is looked at
        return err


def test_a_request_whose_op_is_pushed_after_the_drain_began_is_not_fenced_before_it(
        monkeypatch, caplog):
    """The world is lost while a call is between its request's entry in the pending list and
    its engine op's push (held there): the drain must not push its fence meanwhile. A fence
    before the op passes at once, the drain ends the request as skipped, and the op, pushed
    next onto a design that no longer runs, never completes: the output's read would wait
    forever. The drain fences a request only once no call is pushing its ops: the op runs,
    the drain fails it with the world's error, the read raises it, and the store goes on."""
    import threading

    monkeypatch.setattr(job_module, 'DRAIN_TIMEOUT', 20.0)
    world = _FakeWorld()
    kv = mpi_kvstore.create('dist_mpi', world=world)
    design = kv._job.design
    pushing, go = threading.Event(), threading.Event()
    real_submit = design._submit

    def held_submit(reqs, priority):   # the request is pending, its op not pushed yet
        pushing.set()
        go.wait(30)
        real_submit(reqs, priority)
    monkeypatch.setattr(design, '_submit', held_submit)
    x = mx.nd.full((5,), 2.0)
    caller = threading.Thread(target=kv.pushpull, args=('g', x))
    caller.start()
    assert pushing.wait(30)
    req = kv._job.pending[-1]
    world.lost = 'worker 1 lost'
    with caplog.at_level(logging.ERROR, logger='mpi_kvstore.store.job'):
        with pytest.raises(RuntimeError, match='worker 1 lost'):
            kv._job.check_world()
        drainer = kv._job._drainer
        drainer.join(0.3)   # the drain's passes, with the push still held
        assert drainer.is_alive() and not req.done, 'the drain ended a request not pushed'
        go.set()
        caller.join(30)
        got = []
        reader = threading.Thread(target=lambda: got.append(_read(x)), daemon=True)
        reader.start()
        reader.join(30)
        assert not reader.is_alive(), "the read of the op's output waits forever"
        kv._job._join_drainer()
    assert req.done and 'worker 1 lost' in str(req.error)
    assert req.completion is not None   # its engine op ran, and completed with the error
    assert got and isinstance(got[0], Exception) and 'worker 1 lost' in str(got[0]), got
    assert 'never reached their engine op' not in caplog.text
    _goes_on_after_the_reset(world, kv)
    kv.close()


def _goes_on_after_the_reset(world, kv):
    """The world found again, the store resets and sums (one rank: the value itself)."""
    world.lost = None
    kv.reset()
    y = mx.nd.full((3,), 4.0)
    kv.pushpull('h', y)
    assert y.asnumpy().tolist() == [4.0] * 3
