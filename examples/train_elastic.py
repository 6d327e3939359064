"""Train under the supervisor, committing every few steps, and survive a lost rank.

    python -m mpi_kvstore run -n 2 --state-dir ckpt -- python examples/train_elastic.py

Kill a rank (``pkill -9 -n -f train_elastic.py``): the supervisor relaunches the job, which
goes on from the last commit (docs/elastic.md). The same script runs under plain mpirun; it
then resumes from --state-dir ... only when started again by hand.

The data order is decided by the epoch and the step, so a resumed run trains on the same
batches as an uninterrupted one; --kill-at STEP makes rank 1 kill itself there on the
first launch, to see it happen.
"""
import os
import signal
import sys
import time

import mxnet as mx
from mxnet import autograd, gluon

from mpi_kvstore import elastic
from mpi_kvstore.launch import supervision

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common
from cifar_resnet import resnet20


def main():
    p = common.parser('Gluon training with commits under mpi_kvstore\'s supervisor',
                      batch_size=32, lr=0.1, epochs=2)
    p.add_argument('--commit-every', type=int, default=20, help='steps between commits')
    p.add_argument('--state-dir', default=None,
                   help='where commits go (default: the supervisor\'s --state-dir)')
    p.add_argument('--kill-at', type=int, default=None,
                   help='rank 1 SIGKILLs itself at this global step on the first launch')
    args = p.parse_args()
    kv = common.setup(args)
    images, labels, _, _ = common.synthetic_dataset(4000, 0)
    train = common.ArrayBatches(common.shard(images, kv.rank, kv.num_workers),
                                common.shard(labels, kv.rank, kv.num_workers),
                                args.batch_size, args.steps, args.seed,
                                common.CIFAR_MEAN, common.CIFAR_STD)
    net = resnet20()
    common.init_net(net, kv, (3, 32, 32))
    trainer = common.make_trainer(net, kv, args)

    def resized(old, new):
        # The usual rule: the global batch scales with the ranks (the batch per rank is
        # fixed), and so does the learning rate (Goyal et al., linear scaling).
        trainer.set_learning_rate(trainer.learning_rate * new / old)
        common.say(kv, 'resized from %d to %d ranks: learning rate %.4f'
                   % (old, new, trainer.learning_rate))

    state = elastic.State(net.collect_params(), trainer, directory=args.state_dir,
                          on_resize=resized, epoch=0, step=0)
    common.say(kv, 'launch %d: %s at epoch %d, step %d'
               % (supervision.launch_index(), 'resuming' if state.restored else 'starting',
                  state.epoch, state.step))
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    for epoch in range(state.epoch, args.epochs):
        start, meter = time.perf_counter(), common.Meter()
        for step, (x, y) in enumerate(train.epoch(epoch, kv.rank)):
            if step < state.step:     # trained before the commit this run resumed from
                continue
            with autograd.record():
                out = net(x)
                loss = loss_fn(out, y)
            loss.backward()
            trainer.step(args.batch_size * kv.num_workers)
            meter.update(loss, out, y)
            global_step = epoch * len(train) + step
            if (args.kill_at == global_step and kv.rank == 1
                    and supervision.launch_index() == 0):
                mx.nd.waitall()
                os.kill(os.getpid(), signal.SIGKILL)
            state.step = step + 1
            if (global_step + 1) % args.commit_every == 0:
                state.commit()
        state.epoch, state.step = epoch + 1, 0
        loss_sum, correct, count = common.global_sum(kv, meter.totals())
        common.say(kv, 'epoch %d/%d: loss %.3f, accuracy %.3f, %.1f s'
                   % (epoch + 1, args.epochs, loss_sum / count, correct / count,
                      time.perf_counter() - start))
    state.commit()
    kv.wait()
    common.say(kv, 'done: %d epochs at %d ranks, last commit %d' % (args.epochs, kv.num_workers,
                                                                    state.number))


if __name__ == '__main__':
    main()
