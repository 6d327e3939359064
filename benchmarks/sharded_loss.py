"""What compressing the sharded optimizer's reduce-scatter costs a small model's loss.

    mpiexec -n 2 python -m benchmarks.sharded_loss [--steps 200] [--seeds 3] [--configs ...]

Each rank trains an MLP (64-128-10, ReLU, softmax cross-entropy) on learnable synthetic data
(10 classes, each a random template in 64 dimensions plus Gaussian noise, sigma 1.5), with
Adam in a store of shard_optimizer=1. Configurations: sharded (exact float32 reduce-scatter),
sharded+fp16 and sharded+bf16 (a 16-bit reduce-scatter), sharded+2bit (MXNet's 2-bit
compression with error feedback, --threshold); the weights' allgather stays exact. For a
seed every configuration starts from the same weights and reads the same batches, so they
differ only in the reduce-scatter. Printed per configuration and seed: the mean loss over
the last 20 steps (the mean over every rank's batch, before the step's update), its
relative difference to exact's, and the accuracy on 2000 held-out samples.

Checks (a failure exits 1): every rank holds the same weights after training, and the exact
configuration's losses equal, within REF_RTOL at every step, one process's training of the
same model with gluon.Trainer and no store on every rank's batch together.
"""
import argparse
import os

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

from benchmarks import harness, report

CONFIGS = {
    'sharded': {},
    'sharded+fp16': {'compression': 'fp16'},
    'sharded+bf16': {'compression': 'bf16'},
    'sharded+2bit': {'2bit': None},        # None: --threshold
}
DEFAULT_CONFIGS = ','.join(CONFIGS)
CLASSES, FEATURES, HIDDEN = 10, 64, 128
NOISE = 1.5
HELD_OUT = 2000
LAST = 20                     # the loss is averaged over the last LAST steps
TARGET = 0.02                 # the loss within 2% of uncompressed
REF_RTOL = 1e-4               # exact losses against one process's, relative
DEFAULT_OUT = os.path.join(harness.DEFAULT_OUT, 'sharded_loss')


def configs(text):
    chosen = harness.names(text)
    unknown = [c for c in chosen if c not in CONFIGS]
    if unknown or not chosen or chosen[0] != 'sharded':
        raise argparse.ArgumentTypeError(
            f'configurations {chosen}: the first must be sharded (the exact one the others are '
            f'measured against), the rest of {", ".join(CONFIGS)}')
    return chosen


def parse_args(argv=None):
    parser = harness.parser(__doc__)
    parser.add_argument('--steps', type=int, default=200, help='training steps')
    parser.add_argument('--seeds', type=int, default=3, help='seeds 0..S-1')
    parser.add_argument('--lr', type=float, default=1e-3, help="Adam's learning rate")
    parser.add_argument('--batch', type=int, default=64, help='samples a rank a step')
    parser.add_argument('--threshold', type=float, default=0.5, help="sharded+2bit's threshold")
    parser.add_argument('--configs', type=configs, default=configs(DEFAULT_CONFIGS),
                        help=f'comma-separated, sharded first (default {DEFAULT_CONFIGS})')
    parser.add_argument('--design', help="every store's design, options after '+'")
    parser.add_argument('--out', default=DEFAULT_OUT, help='JSON directory')
    parser.add_argument('--timeout', type=float, default=900.0, help='seconds the job may take')
    args = parser.parse_args(argv)
    if args.steps < 1 or args.seeds < 1 or args.batch < 1:
        raise SystemExit('--steps, --seeds and --batch must be >= 1')
    return args


# ---------------------------------------------------------------- data and model (numpy)

def templates(seed):
    """The classes' templates of a seed, (CLASSES, FEATURES) float32."""
    return np.random.RandomState(seed).uniform(-1, 1, (CLASSES, FEATURES)).astype(np.float32)


def samples(temps, rng, count):
    """(data (count, FEATURES) float32, labels (count,) int64): a template plus noise each."""
    labels = rng.randint(0, CLASSES, count)
    data = temps[labels] + rng.normal(0, NOISE, (count, FEATURES))
    return data.astype(np.float32), labels.astype(np.int64)


def shard(seed, step, rank, batch):
    """Rank `rank`'s batch of step `step` (the same for every configuration and rank count)."""
    return samples(templates(seed), np.random.RandomState([seed, step, rank, 1]), batch)


def held_out(seed):
    return samples(templates(seed), np.random.RandomState([seed, 2]), HELD_OUT)


def initial_weights(seed):
    """[w1 (HIDDEN, FEATURES), b1, w2 (CLASSES, HIDDEN), b2] float32, in gluon Dense's layout:
    weights uniform in +-sqrt(3 / ((fan_in + fan_out) / 2)) (mx.init.Xavier()'s default),
    biases zero."""
    rng = np.random.RandomState([seed, 3])

    def xavier(rows, cols):
        scale = np.sqrt(3.0 / ((rows + cols) / 2.0))
        return rng.uniform(-scale, scale, (rows, cols)).astype(np.float32)
    return [xavier(HIDDEN, FEATURES), np.zeros(HIDDEN, np.float32),
            xavier(CLASSES, HIDDEN), np.zeros(CLASSES, np.float32)]


def make_net(seed, prefix):
    """The MLP with initial_weights(seed)."""
    net = gluon.nn.HybridSequential(prefix=prefix)
    with net.name_scope():
        net.add(gluon.nn.Dense(HIDDEN, activation='relu', in_units=FEATURES),
                gluon.nn.Dense(CLASSES, in_units=HIDDEN))
    net.initialize(mx.init.Zero())
    for param, value in zip(net.collect_params().values(), initial_weights(seed)):
        param.set_data(mx.nd.array(value, dtype='float32'))
    return net


def accuracy(net, seed):
    data, labels = held_out(seed)
    return float((net(mx.nd.array(data)).argmax(axis=1).asnumpy() == labels).mean())


# ---------------------------------------------------------------- training

def store_options(args, name):
    options = dict(CONFIGS[name], shard_optimizer=True)
    if '2bit' in options:
        options['2bit'] = args.threshold
    return options


def train(args, name, seed, comm):
    """Collective: {'losses': [every step's loss over every rank's batch], 'accuracy',
    'check'} of configuration `name` and `seed`, the same on every rank."""
    net = make_net(seed, f'{name.replace("+", "_")}_s{seed}_')
    kv, why = harness.create_store(args.design, args.timeout, **store_options(args, name))
    if kv is None:
        raise SystemExit(f'{name}: no store: {why}')
    trainer = gluon.Trainer(net.collect_params(), 'adam', {'learning_rate': args.lr},
                            kvstore=kv, update_on_kvstore=True)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    local = []
    for step in range(args.steps):
        data, labels = shard(seed, step, comm.rank, args.batch)
        with autograd.record():
            loss = loss_fn(net(mx.nd.array(data)), mx.nd.array(labels))
        loss.backward()
        trainer.step(args.batch * comm.size)
        local.append(loss.mean())
    local = np.array([float(x.asscalar()) for x in local], np.float64)
    kv.wait()
    losses = comm.allreduce(local) / comm.size
    weights = [p.data().asnumpy() for p in net.collect_params().values()]
    finite = all(np.all(np.isfinite(w)) for w in weights) and np.all(np.isfinite(losses))
    error = harness.ranks_differ(weights, comm)
    if error is None and not finite:
        error = 'a weight or loss is not finite'
    result = {'losses': losses.tolist(), 'accuracy': accuracy(net, seed),
              'check': harness.agree(error, comm) or 'ok'}
    kv.close()
    return result


def one_process(args, seed, nranks):
    """Every step's loss of one process training the same model with gluon.Trainer and no
    store on every rank's batch together (what the exact sharded store should give)."""
    net = make_net(seed, f'ref_s{seed}_')
    trainer = gluon.Trainer(net.collect_params(), 'adam', {'learning_rate': args.lr},
                            kvstore=None)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    losses = []
    for step in range(args.steps):
        parts = [shard(seed, step, r, args.batch) for r in range(nranks)]
        data = np.concatenate([d for d, _ in parts])
        labels = np.concatenate([lab for _, lab in parts])
        with autograd.record():
            loss = loss_fn(net(mx.nd.array(data)), mx.nd.array(labels))
        loss.backward()
        trainer.step(args.batch * nranks)
        losses.append(loss.mean())
    return [float(x.asscalar()) for x in losses]


def last_mean(losses):
    return float(np.mean(losses[-LAST:]))


# ---------------------------------------------------------------- main

def main(argv=None):
    args = parse_args(argv)
    comm = harness.world()
    run = harness.Run('sharded_loss', args, comm=comm)
    harness.rank0_print(
        f'sharded_loss: MLP {FEATURES}-{HIDDEN}-{CLASSES}, Adam lr {args.lr:g} in the store, '
        f'shard_optimizer=1, {comm.size} ranks x {args.batch} samples, {args.steps} steps, '
        f'seeds 0-{args.seeds - 1}; 2-bit threshold {args.threshold:g}; '
        f'loss = mean over the last {min(LAST, args.steps)} steps, every rank\'s batch')
    results = {name: [] for name in args.configs}
    reference = []
    with harness.deadline(args.timeout, 'sharded_loss'):
        for seed in range(args.seeds):
            for name in args.configs:
                results[name].append(train(args, name, seed, comm))
            ref = one_process(args, seed, comm.size) if comm.rank == 0 else None
            reference.append(comm.bcast(ref))
    failed = {}
    for name in args.configs:
        for seed, result in enumerate(results[name]):
            if result['check'] != 'ok':
                failed[f'{name} seed {seed}'] = result['check']
    ref_rel = []
    for seed, ref in enumerate(reference):
        exact = np.array(results['sharded'][seed]['losses'])
        rel = float(np.max(np.abs(exact - np.array(ref)) / np.abs(np.array(ref))))
        ref_rel.append(rel)
        if not rel <= REF_RTOL:
            failed[f'sharded seed {seed} against one process'] = (
                f'losses differ by up to {rel:.3g} relative (more than {REF_RTOL:g})')
    rows = []
    cells = []
    for name in args.configs:
        means = [last_mean(r['losses']) for r in results[name]]
        exact = [last_mean(r['losses']) for r in results['sharded']]
        rel = [m / e - 1 for m, e in zip(means, exact)]
        worst = max(rel, key=abs)
        accs = [r['accuracy'] for r in results[name]]
        rows.append({'config': name, 'options': store_options(args, name), 'loss_last': means,
                     'rel_to_exact': rel, 'worst_rel': worst, 'accuracy': accs,
                     'losses': [r['losses'] for r in results[name]],
                     'check': [r['check'] for r in results[name]]})
        cells.append([name, ' / '.join(f'{m:.4f}' for m in means),
                      ' / '.join(f'{r:+.2%}' for r in rel), f'{worst:+.2%}',
                      ' / '.join(f'{a:.3f}' for a in accs)])
    text = report.markdown(['configuration', 'loss, last 20 steps, per seed',
                            'relative to exact, per seed', 'worst', 'held-out accuracy, per seed'],
                           cells)
    harness.rank0_print(f'\n{text}\n')
    for row in rows[1:]:
        met = 'met' if abs(row['worst_rel']) <= TARGET else 'NOT met'
        harness.rank0_print(f'{row["config"]}: worst |relative difference| to exact '
                            f'{abs(row["worst_rel"]):.2%} over {args.seeds} seed(s) '
                            f'(target <= {TARGET:.0%}: {met})')
    harness.rank0_print(f'exact sharded against one process without a store: losses within '
                        f'{max(ref_rel):.2g} relative at every step')
    run.write({'rows': rows, 'table': text, 'one_process_losses': reference,
               'one_process_max_rel': ref_rel, 'check': 'ok' if not failed else failed})
    harness.rank0_print(f'written to {run.json_path}')
    if failed:
        harness.rank0_print(f'CHECK FAILED: {failed}')
        raise SystemExit(1)
    harness.rank0_print('checks: ok (weights equal across ranks, exact sharded equals one process)')
    return None


if __name__ == '__main__':
    harness.run_main(main)
