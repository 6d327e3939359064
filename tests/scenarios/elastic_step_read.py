"""What a survivor reads of a step whose exchange a lost peer failed
(tests/test_elastic_step_read.py): 2 workers under ``python -m mpi_kvstore run --elastic``,
a small Gluon model and Adam, in an elastic run with a State.

usage: elastic_step_read.py OUT --api kvopt|hvd [--steps N] [--reference]

``--api kvopt``: our own API, gluon.Trainer on a store of the world with Adam in the store
(update_on_kvstore); ``--api hvd``: hvd.DistributedTrainer (Adam on the ranks),
hvd.elastic.MXNetState and hvd.elastic.run. Both workers train step 0 and commit; worker 1
then SIGKILLs itself after its backward pass of step 1, so worker 0's exchange of step 1
cannot finish. Worker 0 reads every parameter twice (in order, then in reverse): each read
prints what it raised, or whether the value it got is finite. It then raises the first error
it saw, so that the elastic run restores the commit, and trains steps 1 to N alone; it
writes its weights to OUT.0.npz. The global batch of step s is split over the ranks and the
update does not depend on their number (``--reference``: one process on the whole batches,
OUT.ref.npz).
"""
import argparse
import logging
import os
import signal

import numpy as np
from mxnet import gluon

from common import ElasticModel, elastic_batch, elastic_store

DIM, HIDDEN, GLOBAL, LR = 8, 6, 24, 0.05

parser = argparse.ArgumentParser()
parser.add_argument('out')
parser.add_argument('--api', choices=('kvopt', 'hvd'), default='kvopt')
parser.add_argument('--steps', type=int, default=4)
parser.add_argument('--reference', action='store_true')
args = parser.parse_args()
logging.basicConfig(format='%(message)s')

model = ElasticModel(DIM, HIDDEN)
params = model.params
if args.reference:
    model.reference(args.out, args.steps, 'adam', {'learning_rate': LR}, GLOBAL)
    raise SystemExit(0)

from mpi_kvstore import elastic  # noqa: E402
from mpi_kvstore.elastic import HorovodInternalError  # noqa: E402
from mpi_kvstore.launch import rendezvous  # noqa: E402

worker = int(os.environ[rendezvous.ID_ENV])
if args.api == 'hvd':
    import mpi_kvstore.horovod as hvd
    hvd.init()
    trainer = hvd.DistributedTrainer(params, 'adam', {'learning_rate': LR})
    state = hvd.elastic.MXNetState(params, trainer, step=0)
    kv = hvd.store()
    wrap = hvd.elastic.run
else:
    world, kv, reset = elastic_store()
    trainer = gluon.Trainer(params, 'adam', {'learning_rate': LR}, kvstore=kv,
                            update_on_kvstore=True)
    state = elastic.State(params, trainer, comm=lambda: world.comm,
                          bcast_object=world.bcast_object, directory=False, step=0)

    def wrap(func):
        return elastic.run_fn(func, reset)

state.register_reset_callbacks([lambda: print(
    'worker %d: reset at step %d, rank %d of %d' % (worker, state.step, kv.rank,
                                                    kv.num_workers), flush=True)])


def read_all(order, label):
    """Read every parameter in ``order``: -> the first error raised, or None."""
    first = None
    for index in order:
        array = list(params.values())[index].data()
        try:
            value = array.asnumpy()
        except Exception as err:   # what the read raises is what is looked at
            print('worker 0: %s read %d raised %s (HorovodInternalError %s)'
                  % (label, index, type(err).__name__, isinstance(err, HorovodInternalError)),
                  flush=True)
            first = first or err
            continue
        print('worker 0: %s read %d gave %s values' % (
            label, index, 'finite' if np.isfinite(value).all() else
            'NaN' if np.isnan(value).all() else 'mixed'), flush=True)
    return first


@wrap
def train(state):
    for step in range(state.step, args.steps):
        data, target = elastic_batch(step, kv.rank, kv.num_workers, DIM, GLOBAL)
        model.forward_backward(data, target)
        if step == 1 and worker == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        trainer.step(data.shape[0] if args.api == 'hvd' else GLOBAL)
        if step == 1 and kv.num_workers == 2:   # the step whose exchange failed
            count = len(list(params.values()))
            first = read_all(range(count), 'first')
            again = read_all(reversed(range(count)), 'second')
            raise first or again or RuntimeError('worker 0: no read raised')
        for param in params.values():
            param.data().wait_to_read()
        state.step = step + 1
        print('worker %d: step %d done (%d of %d)' % (worker, state.step, kv.rank,
                                                      kv.num_workers), flush=True)
        state.commit()


train(state)
model.save('%s.%d.npz' % (args.out, worker))
print('worker %d: finished at rank %d of %d' % (worker, kv.rank, kv.num_workers), flush=True)
