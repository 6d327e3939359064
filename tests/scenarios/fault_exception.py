"""Rank 1 fails inside a Gluon training loop at step 3, as a data-loader bug would.

The other ranks are then waiting in a collective that rank 1 will never join.
Every rank must exit within seconds, non-zero, with a message naming rank 1.
Launched as plain ``python fault_exception.py`` (not ``-m mpi4py``), as users
launch: the hook the store installs has to end the job.

usage: fault_exception.py [MODE]
  main       the loader raises in the training loop's thread (default)
  thread     the loader raises in its prefetch thread; the loop waits for a batch forever
  interrupt  the rank gets SIGINT (KeyboardInterrupt) while training
"""
import os
import queue
import signal
import sys
import threading
import time

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import mpi_kvstore

from common import RANK, SIZE

FAILING_RANK, FAILING_STEP = 1, 3
PER_RANK, FEATURES, CLASSES = 4, 20, 4
STEPS = 1000  # far more than any rank reaches: the job must end through the failure


class LoaderBug(RuntimeError):
    """What a data-loader bug raises."""


def announce(what):
    # The test measures the time from this line to the end of the job.
    print('fault: rank %d %s at t=%.3f' % (RANK, what, time.time()), flush=True)


def batches(fail_at=None):
    """Synthetic batches of this rank's shard; raises at step FAIL_AT."""
    rng = np.random.RandomState(RANK)
    for step in range(STEPS):
        if step == fail_at:
            announce('raises')
            raise LoaderBug('rank %d: corrupt record in batch %d' % (RANK, step))
        yield (mx.nd.array(rng.uniform(-1, 1, (PER_RANK, FEATURES))),
               mx.nd.array(rng.randint(0, CLASSES, PER_RANK)))


def prefetched(source):
    """Batches made in a thread, as a prefetching loader does: when that thread
    dies, the loop waits for the next batch forever."""
    ready = queue.Queue(maxsize=2)

    def fill():
        for item in source:
            ready.put(item)

    threading.Thread(target=fill, name='loader', daemon=True).start()
    while True:
        yield ready.get()


def train(source, before_step=lambda step: None):
    net = gluon.nn.Dense(CLASSES, in_units=FEATURES)
    net.initialize(mx.init.Xavier())
    kv = mpi_kvstore.create('dist_mpi')
    mpi_kvstore.broadcast_parameters(net.collect_params(), store=kv)
    trainer = gluon.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1}, kvstore=kv)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    for step, (data, label) in enumerate(source):
        before_step(step)
        with autograd.record():
            loss = loss_fn(net(data), label)
        loss.backward()
        trainer.step(PER_RANK * SIZE)
        # Reading the loss waits for this step's forward, which needs the previous step's
        # summed gradients: the healthy ranks block here once the failing rank is gone.
        value = loss.mean().asscalar()
        if RANK == 0:
            print('fault: step %d loss %.4f' % (step, value), flush=True)


def interrupt_at(step):
    if RANK == FAILING_RANK and step == FAILING_STEP:
        announce('is interrupted')
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)  # the KeyboardInterrupt arrives during this sleep


def main(mode):
    fail_at = FAILING_STEP if RANK == FAILING_RANK else None
    if mode == 'main':
        train(batches(fail_at))
    elif mode == 'thread':
        train(prefetched(batches(fail_at)))
    elif mode == 'interrupt':
        train(batches(), interrupt_at)
    else:
        raise SystemExit('unknown mode %r' % mode)


if __name__ == '__main__':
    main(sys.argv[1] if len(sys.argv) > 1 else 'main')
