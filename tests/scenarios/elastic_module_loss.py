"""Module.fit with elastic.State.fit in memory: a worker joins, then a worker is lost
(tests/test_elastic_module.py), under ``python -m mpi_kvstore run --host-discovery-script S``.

usage: elastic_module_loss.py OUT [--epochs E] [--local-updates] [--wait-at S --wait-for N]
                              [--kill-id I --kill-at S] [--reference]

Our own API: World, mpi_kvstore.create(world=...), a Module on it (SGD with momentum in the
store; on the ranks with ``--local-updates``, MXNET_UPDATE_ON_KVSTORE=0), elastic.State of
the Module in memory, elastic.run_fn around State.fit (commits every 3 batches). An epoch is
6 steps; the global batch of step s of an epoch is common.elastic_batch(s), split over the
world's ranks, and the Module's rescale_grad is 1 over the global batch, so the update does
not depend on the number of workers. With --wait-at S --wait-for N the world checks for host
updates after its S-th step until it has N workers. Worker I SIGKILLs itself after its
backward pass of step S (--kill-at, counted over the epochs from 0), before the update;
each survivor then reads every parameter of the Module twice (get_params, in order, then in
reverse), prints what each read raised or gave, and raises the first error, so that the
elastic run restores the commit. Each worker prints its steps and resets, and writes its
weights (sorted by name) to OUT.<id>.npz. ``--reference``: one process, no store, Module.fit
on the whole batches, OUT.ref.npz.
"""
import argparse
import logging
import os
import signal
import time

import mxnet as mx
import numpy as np

from common import elastic_batch, elastic_store

DIM, HIDDEN, GLOBAL, BATCHES, LR = 8, 6, 24, 6, 0.1
OPTIONS = {'learning_rate': LR, 'momentum': 0.9}

parser = argparse.ArgumentParser()
parser.add_argument('out')
parser.add_argument('--epochs', type=int, default=3)
parser.add_argument('--local-updates', action='store_true')
parser.add_argument('--wait-at', type=int, default=None)
parser.add_argument('--wait-for', type=int, default=None)
parser.add_argument('--kill-id', type=int, default=None)
parser.add_argument('--kill-at', type=int, default=None)
parser.add_argument('--reference', action='store_true')
args = parser.parse_args()
logging.basicConfig(format='%(message)s')
if os.environ.get('MPI_KVSTORE_TEST_DEBUG') == '1':   # the forming's steps, timed, by process
    logging.basicConfig(format='%(asctime)s %(process)d %(message)s', level=logging.DEBUG,
                        force=True)
if args.local_updates:
    os.environ['MXNET_UPDATE_ON_KVSTORE'] = '0'


def symbol():
    data = mx.sym.Variable('data')
    net = mx.sym.FullyConnected(data, num_hidden=HIDDEN, name='fc1')
    net = mx.sym.Activation(net, act_type='tanh')
    net = mx.sym.FullyConnected(net, num_hidden=1, name='fc2')
    return mx.sym.LinearRegressionOutput(net, name='lin_reg')


def iterator(rank, size):
    """This rank's part of every step's global batch of an epoch, in step order."""
    parts = [elastic_batch(step, rank, size, DIM, GLOBAL) for step in range(BATCHES)]
    data = np.concatenate([d.asnumpy() for d, _ in parts])
    label = np.concatenate([t.asnumpy() for _, t in parts])
    return mx.io.NDArrayIter(data, label, batch_size=GLOBAL // size, shuffle=False,
                             label_name='lin_reg_label')


def module(data):
    mod = mx.mod.Module(symbol(), context=mx.cpu(), label_names=['lin_reg_label'])
    mod.bind(data_shapes=data.provide_data, label_shapes=data.provide_label)
    mx.random.seed(11)
    mod.init_params(initializer=mx.init.Xavier())
    return mod


def save(mod, path):
    params, _ = mod.get_params()
    np.savez(path, *[params[name].asnumpy() for name in sorted(params)])


if args.reference:
    data = iterator(0, 1)
    mod = module(data)
    mod.fit(data, num_epoch=args.epochs, kvstore=None, optimizer='sgd',
            optimizer_params=OPTIONS, eval_metric='mse')
    save(mod, '%s.ref.npz' % args.out)
    raise SystemExit(0)

from mpi_kvstore import elastic  # noqa: E402
from mpi_kvstore.elastic import HorovodInternalError  # noqa: E402
from mpi_kvstore.launch import rendezvous  # noqa: E402

worker = int(os.environ[rendezvous.ID_ENV])
joining = os.environ.get(rendezvous.JOIN_ENV) == '1'
world, kv, reset = elastic_store()
mod = module(iterator(kv.rank, kv.num_workers))
state = elastic.State(mod, comm=lambda: world.comm, bcast_object=world.bcast_object,
                      directory=False, epoch=0, batch=0)
world.listeners.append(state.on_hosts_updated)
read_once = []   # the step --kill-at once trained


def steps_done():
    return state.epoch * BATCHES + state.batch


if joining:
    print('worker %d: joined at rank %d of %d' % (worker, kv.rank, kv.num_workers), flush=True)
state.register_reset_callbacks([lambda: print(
    'worker %d: reset at step %d, rank %d of %d' % (worker, steps_done(), kv.rank,
                                                    kv.num_workers), flush=True)])


def read_all(order, label):
    """Read every parameter in ``order``: -> the first error raised, or None."""
    first = None
    params, _ = mod.get_params()
    names = sorted(params)
    for index in order:
        try:
            value = params[names[index]].asnumpy()
        except Exception as err:   # what the read raises is what is looked at
            print('worker %d: %s read %d raised %s (HorovodInternalError %s)'
                  % (worker, label, index, type(err).__name__,
                     isinstance(err, HorovodInternalError)), flush=True)
            first = first or err
            continue
        print('worker %d: %s read %d gave %s values' % (
            worker, label, index, 'finite' if np.isfinite(value).all() else
            'NaN' if np.isnan(value).all() else 'mixed'), flush=True)
    return first


update = mod.update


def update_or_die():
    """Module.fit's update; at --kill-at, worker I dies before it, the others read after it
    (once: not when the step is redone after the restore)."""
    failed = steps_done() == args.kill_at and not read_once
    if failed and worker == args.kill_id:
        os.kill(os.getpid(), signal.SIGKILL)
    if failed:
        read_once.append(steps_done())
    update()
    if failed:
        count = len(mod.get_params()[0])
        first = read_all(range(count), 'first')
        again = read_all(reversed(range(count)), 'second')
        raise first or again or RuntimeError('worker %d: no read raised' % worker)


mod.update = update_or_die


def after_batch(param):
    done = steps_done()   # State.fit's commit callback counted this batch
    print('worker %d: step %d done (%d of %d)' % (worker, done, kv.rank, kv.num_workers),
          flush=True)
    while done == args.wait_at and kv.num_workers < args.wait_for:
        time.sleep(0.05)
        state.check_host_updates()   # every rank: it is collective


def train(state):
    state.fit(iterator(kv.rank, kv.num_workers), commit_every=3,
              batch_end_callback=after_batch, num_epoch=args.epochs, kvstore=kv,
              optimizer='sgd', optimizer_params=OPTIONS, eval_metric='mse')


elastic.run_fn(train, reset)(state)
save(mod, '%s.%d.npz' % (args.out, worker))
print('worker %d: finished at rank %d of %d' % (worker, kv.rank, kv.num_workers), flush=True)
