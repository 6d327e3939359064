"""Training throughput on synthetic data: every mpi_kvstore design against no exchange at all.

    OMP_NUM_THREADS=1 mpiexec -n 2 python -m benchmarks.scaling --quick
    OMP_NUM_THREADS=1 mpiexec -n N python -m benchmarks.scaling [--models resnet20,resnet18_v1]

Per model (resnet20 and resnet18_v1 on 32x32 batches, resnet50_v1 on 224x224), on one net
whose weights every config shares: single (rank 0 alone, no store), none (N ranks, no
exchange: the ceiling), mpi_kvstore:D (gluon.Trainer on a store of design D),
DistributedTrainer:D, horovod (when it imports) and dist_sync (ps-lite; --p3: its P3 van),
in interleaved rounds of --steps-per-round steps (forward, backward, trainer.step), the
slowest rank's; then each store's exchange alone, with --raw-allreduce SIZES of raw MPI in
the same rounds (for cost_model). DEFINITIONS says what each column means.
"""
import gc
import os
import time

import mxnet as mx
import numpy as np
from mpi4py import MPI
from mxnet import autograd, gluon
from mxnet.gluon.model_zoo import vision
from mxnet.kvstore import KVStoreBase

import mpi_kvstore
from benchmarks import harness, peers, report
from examples.cifar_resnet import resnet20  # the net examples/train_cifar10.py trains

COMM = MPI.COMM_WORLD
TARGET_VS_NONE = 0.9          # the best design should reach 90% of the no-exchange ceiling
TARGET_OVERHEAD = 15.0        # ... which is at most 15% more time per step
KEY_STRIDE = 100000           # dist_sync key range per model (see ShiftedKeys)
PSLITE_LIFETIME = 6 * 3600    # s; a safety net only: ps-lite children die with rank 0 anyway
OPTIMIZER = ('sgd', {'learning_rate': 0.01, 'momentum': 0.9, 'wd': 1e-4})


# ---------------------------------------------------------------- models

class Spec:
    """A model to measure: how to build it, its input side and classes, its default batch."""

    def __init__(self, build, image, classes, batch):
        self.build, self.image, self.classes, self.batch = build, image, classes, batch


# resnet18_v1 keeps its ImageNet stem (7x7/2 and max-pooling) at 32x32: little compute for
# 45 MB of gradients, the communication-bound case; resnet20 is the compute-bound one.
MODELS = {'resnet20': Spec(resnet20, 32, 10, 32),
          'resnet18_v1': Spec(lambda: vision.resnet18_v1(classes=10), 32, 10, 32),
          'resnet50_v1': Spec(vision.resnet50_v1, 224, 1000, 4)}
FULL, QUICK = {'warmups': 2, 'trials': 10}, {'warmups': 1, 'trials': 3}    # rounds
QUICK_MODELS, QUICK_BATCH = 'resnet20,resnet18_v1', 16


# ---------------------------------------------------------------- arguments

def parse_args(argv=None):
    parser = harness.parser(__doc__)
    harness.add_common_args(parser, sizes=False, quick=QUICK, full=FULL)
    # The shared options speak of trials; here a trial is a round: one step of every config.
    parser.add_argument('--warmup-steps', dest='warmups', type=int, help='the same as --warmups')
    parser.add_argument('--steps', dest='trials', type=int, help='the same as --trials')
    parser.add_argument('--models', help=f'comma-separated, from {",".join(MODELS)} (default: all)')
    parser.add_argument('--batch-size', type=int, help='images per rank per step (default: '
                                                       '32 at 32x32, 4 for resnet50_v1)')
    parser.add_argument('--designs', help='comma-separated mpi_kvstore designs (default: all)')
    parser.add_argument('--trainer-designs', type=harness.names,
                        help="DistributedTrainer's designs, with store options, group_bytes and "
                             "2-bit's threshold: 'chained,funneled+group_bytes=0,chained+2bit=0.01'")
    parser.add_argument('--steps-per-round', type=int, default=1,
                        help='steps in a row per timed op, one waitall after the last')
    peers.add_args(parser)
    parser.add_argument('--seed', type=int, default=42, help='weights seed, the same on every rank')
    parser.add_argument('--raw-allreduce', type=harness.parse_sizes, metavar='SIZES',
                        help='also time raw MPI Allreduce(IN_PLACE) of these sizes beside the '
                             'exchanges alone')
    return resolve(parser.parse_args(argv))


def resolve(args):
    """Defaults that depend on --quick; explicit options always win."""
    harness.resolve_quick(args, FULL, QUICK)
    if args.quick and args.batch_size is None:
        args.batch_size = QUICK_BATCH
    args.models = harness.names(args.models or (QUICK_MODELS if args.quick else ','.join(MODELS)))
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        raise SystemExit(f'unknown model(s) {",".join(unknown)}: choose from {",".join(MODELS)}')
    if (args.batch_size or 1) < 1 or args.steps_per_round < 1:
        raise SystemExit('--batch-size and --steps-per-round must be >= 1')
    return args


# ---------------------------------------------------------------- one model's state

class Model:
    """A net initialised alike on every rank (the weights every config trains) and this
    rank's synthetic batch."""

    def __init__(self, name, args, store):
        spec = MODELS[name]
        self.name, self.batch = name, args.batch_size or spec.batch
        self.steps_per_op = args.steps_per_round    # training steps per timed op
        self.shape = (self.batch, 3, spec.image, spec.image)
        mx.random.seed(args.seed)          # the same initial weights on every rank ...
        self.net = spec.build()
        self.net.initialize(mx.init.Xavier(rnd_type='gaussian', factor_type='in', magnitude=2))
        # A forward ends deferred initialisation. In inference mode, as users do: it leaves
        # convolution weights in an MKLDNN layout, which the broadcasts below must handle.
        self.net(mx.nd.zeros((1,) + self.shape[1:]))
        # Not static_alloc: see examples/common.py (BatchNorm statistics race in 1.9.1).
        self.net.hybridize()
        self.params = self.net.collect_params()
        # ... and rank 0's, to be certain (mpi_kvstore's helper, as a user would call it).
        mpi_kvstore.broadcast_parameters(self.params, store=store)
        check_same_weights(self.params, name)
        rng = np.random.default_rng([args.seed, COMM.rank])   # ... but each rank its own data
        self.x = mx.nd.array(rng.standard_normal(self.shape, np.float32))
        self.y = mx.nd.array(rng.integers(0, spec.classes, self.batch), dtype=np.float32)
        grads = [p for p in self.params.values() if p.grad_req != 'null']
        self.grad_sizes = [p.data().size * 4 for p in grads]     # bytes, in the Trainer's order
        self.grad_arrays = len(grads)
        self.grad_bytes = sum(self.grad_sizes)

    def info(self):
        return {'batch_per_rank': self.batch, 'global_batch': self.batch * COMM.size,
                'input_shape': list(self.shape), 'gradient_arrays': self.grad_arrays,
                'gradient_bytes': self.grad_bytes, 'gradient_sizes': self.grad_sizes}

    def all_finite(self):
        return all(np.isfinite(p.data().asnumpy()).all() for p in self.params.values())


def check_same_weights(params, name):
    """Every rank must start from rank 0's weights, bit for bit (harness.ranks_differ)."""
    why = harness.ranks_differ([p.data().asnumpy() for _, p in sorted(params.items())], COMM)
    if why:
        raise RuntimeError(f'{name}: after broadcast_parameters, {why}')


def step_op(model, trainer, normalise_by):
    """model.steps_per_op training steps, finished: waitall after the last, so queued work
    is counted (bench_model has rounds() divide the time by it)."""
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    steps = model.steps_per_op

    def op():
        for _ in range(steps):
            with autograd.record():
                loss = loss_fn(model.net(model.x), model.y)
            loss.backward()
            trainer.step(normalise_by)
        mx.nd.waitall()
    return op


def exchange_op(trainer):
    """The trainer's gradient exchange alone, on the gradients the last step left."""
    def op():
        trainer.allreduce_grads()
        mx.nd.waitall()
    return op


# ---------------------------------------------------------------- the configs

class Config:
    """One way to train the model, ready to time: a step, the exchange alone (for a store),
    how many ranks work, and what to release afterwards."""

    def __init__(self, name, step, exchange=None, ranks=None, close=None):
        self.name, self.step, self.exchange = name, step, exchange
        self.ranks = ranks or COMM.size
        self.close = close or (lambda: None)


def trained(run, name, model, kind, kv=None, **extra):
    """A Config of a trainer of harness.make_trainer's kind on kv (an mpi_kvstore store is
    closed once the model is done)."""
    trainer, ranks = harness.make_trainer(kind, model.params, OPTIMIZER, kv, **extra)

    def close():
        with harness.deadline(run.args.timeout, f'closing {kv!r}'):
            kv.wait()       # re-raises any error the store deferred
            kv.close()
    return Config(name, step_op(model, trainer, model.batch * ranks), exchange_op(trainer),
                  close=close if isinstance(kv, mpi_kvstore.MPIKVStore) else None)


def store_config(run, model, design):
    """gluon.Trainer on a store of one design: one pushpull per parameter, as Gluon does."""
    kv, why = harness.create_store(design, run.args.timeout)
    if why:
        return run.skip(f'mpi_kvstore:{design}', why)
    return trained(run, f'mpi_kvstore:{design}', model, 'gluon', kv)


def distributed_trainer_config(run, model, spec=None):
    """The grouped exchange, on a store of design spec (None: the default design,
    MPI_KVSTORE_DESIGN or funneled). The spec may carry '+group_bytes=N' for the trainer."""
    parts = (spec or '').split('+')
    group = [p.split('=', 1)[1] for p in parts if p.startswith('group_bytes=')]
    store_spec = '+'.join(p for p in parts if not p.startswith('group_bytes=')) or None
    kv, why = harness.create_store(store_spec, run.args.timeout)
    name = f'DistributedTrainer:{spec or kv.design if not why else spec}'
    if why:
        return run.skip(name, why)
    extra = {'group_bytes': 0 if group and group[0] == '0' else harness.parse_size(group[0])} if group else {}
    return trained(run, name, model, 'distributed', kv, **extra)


def horovod_config(run, model):
    _, why = peers.horovod()
    if why:
        return None if 'horovod' in run.skipped else run.skip('horovod', why)
    return trained(run, 'horovod', model, 'horovod')


def make_configs(run, model, dist_sync, index):
    """Every config of one model; the stores they hold stay open until the model is done."""
    alone = [harness.make_trainer('gluon', model.params, OPTIMIZER)[0] for _ in range(2)]
    configs = [Config('single', step_op(model, alone[0], model.batch), ranks=1),
               Config('none', step_op(model, alone[1], model.batch))]
    configs += [store_config(run, model, design) for design in harness.designs(run.args.designs)]
    configs += [distributed_trainer_config(run, model, spec)
                for spec in (run.args.trainer_designs or [None])]
    configs += [horovod_config(run, model)]
    if dist_sync.kv is not None:
        configs.append(trained(run, dist_sync.name, model, 'gluon',
                               ShiftedKeys(dist_sync.kv, index * KEY_STRIDE)))
    return [c for c in configs if c is not None]


# ---------------------------------------------------------------- timing

def wait_idle(comm, poll=0.005):
    """A barrier that sleeps instead of spinning: a rank waiting here leaves its core to the
    rank that works (MPICH's blocking Barrier polls at full speed)."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(poll)


def time_once(run, what, op, ranks):
    """harness.timed_run's (seconds, sample) of one run of op on the slowest of `ranks` ranks
    (1: rank 0, others idle), the same on every rank; the machine's busy CPU is counted only
    when every rank runs on one machine (run.one_machine)."""
    with harness.deadline(run.args.timeout, what, run.on_expire):
        if ranks == COMM.size:
            _, sample = harness.timed_run(op, COMM, machine=run.one_machine)
        else:
            sample = harness.timed_run(op, MPI.COMM_SELF, machine=run.one_machine)[1] if COMM.rank == 0 else None
            wait_idle(COMM)
    sample = COMM.bcast(sample, root=0)
    return sample['wall_s'], sample


def rounds(run, model, jobs, phase, per=1):
    """{name: [seconds]} of `trials` timed rounds after `warmups` untimed ones, interleaved
    (harness.interleaved: every round runs every job once, in an order that rotates). `per`:
    what one run of an op does, in the units reported (steps per training op): times are
    divided by it. The CPU of each job's timed runs goes to run.cpu (harness.cpu_summary)."""
    ranks = {name: count for name, _, count in jobs}

    def time_one(name, op):
        seconds, sample = time_once(run, f'{model.name} {name} ({phase})', op, ranks[name])
        return seconds / per, dict(sample, units=per)
    timed = harness.interleaved({name: op for name, op, _ in jobs}, run.args.trials,
                                run.args.warmups, time_one)
    for name, values in timed.items():
        run.cpu[(model.name, phase, name)] = harness.cpu_summary([sample for _, sample in values])
    return {name: [seconds for seconds, _ in values] for name, values in timed.items()}


def bench_model(run, model, dist_sync, index):
    configs = make_configs(run, model, dist_sync, index)
    harness.rank0_print(f'measuring {model.name}: {len(configs)} configs, batch {model.batch} per '
                        f'rank, {run.args.warmups} + {run.args.trials} rounds ...')
    steps = rounds(run, model, [(c.name, c.step, c.ranks) for c in configs], 'training',
                   per=model.steps_per_op)
    raw = [(f'raw_mpi:{n}', peers.raw_allreduce_op(n), COMM.size) for n in run.args.raw_allreduce or []]
    alone = rounds(run, model, [(c.name, c.exchange, COMM.size) for c in configs if c.exchange] + raw,
                   'exchange alone')
    for config in configs:
        config.close()
        run.add(model, config, steps[config.name], alone.get(config.name))
    if raw:
        run.add_raw(model, {n: alone[f'raw_mpi:{n}'] for n in run.args.raw_allreduce})
    if not model.all_finite():     # NaN or inf arithmetic runs at other speeds
        harness.rank0_print(f'  warning: {model.name} has non-finite weights after training')
    gc.collect()


# ---------------------------------------------------------------- dist_sync

class ShiftedKeys(KVStoreBase):
    """One model's view of the shared dist_sync store. ps-lite allows one store per process,
    so every model uses the same one, but each Trainer numbers its parameters from 0: give
    each model a key range of its own. One Python call per key; nothing else changes."""

    def __init__(self, kv, offset):
        self._kv, self._offset = kv, offset

    def _shift(self, key):
        return [k + self._offset for k in key] if isinstance(key, (list, tuple)) else key + self._offset

    def broadcast(self, key, value, out, priority=0):
        self._kv.broadcast(self._shift(key), value, out, priority)

    def pushpull(self, key, value, out=None, priority=0):
        self._kv.pushpull(self._shift(key), value, out, priority)

    @staticmethod
    def is_capable(capability):
        return False        # the optimizer runs in the Trainer, as with the other configs

    @property
    def type(self):
        return self._kv.type

    @property
    def rank(self):
        return self._kv.rank

    @property
    def num_workers(self):
        return self._kv.num_workers


# ---------------------------------------------------------------- one run's bookkeeping

class Run(harness.Run):
    """Results so far; saved after every model so a killed job still leaves them."""

    def __init__(self, args):
        super().__init__('scaling', args)
        self.models = {}
        self.one_machine = harness.one_machine(COMM)
        self.cpu = {}           # (model, phase, config) -> harness.cpu_summary of its runs

    def add(self, model, config, step_times, alone_times=None):
        entry = self.models.setdefault(model.name, {'info': model.info(), 'rows': []})
        entry['rows'].append({'config': config.name, 'ranks': config.ranks,
                              'images_per_step': model.batch * config.ranks,
                              'step_times_s': step_times, 'exchange_alone_times_s': alone_times,
                              'cpu_step': self.cpu.get((model.name, 'training', config.name)),
                              'cpu_exchange': self.cpu.get((model.name, 'exchange alone', config.name))})
        self.save()

    def add_raw(self, model, times):
        """{bytes: [seconds]} of raw MPI Allreduce(IN_PLACE), timed beside the exchanges."""
        entry = self.models.setdefault(model.name, {'info': model.info(), 'rows': []})
        entry['raw_allreduce'] = [{'bytes': n, 'times_s': t, 'median_ms': float(np.median(t)) * 1e3}
                                  for n, t in sorted(times.items())]
        self.save()

    def save(self):
        for entry in self.models.values():
            derive(entry['rows'])
        self.write({'models': self.models, 'definitions': DEFINITIONS}, optimizer=OPTIMIZER)


# ---------------------------------------------------------------- report

DEFINITIONS = {
    'step_ms': "median over timed rounds of the slowest rank's step (forward, backward, "
               'trainer.step, mx.nd.waitall)',
    'step_min_ms': "the fastest timed round's step (the slowest rank's), in ms",
    'step_max_ms': "the slowest timed round's step (the slowest rank's), in ms",
    'spread_pct': 'interquartile range of the step times / their median: the noise',
    'images_per_s': 'images per step of all working ranks together / step time',
    'scaling_efficiency': 'images/s of N ranks / (N x images/s of `single`, one process alone)',
    'vs_none': 'images/s / images/s of `none` (N ranks, no exchange: the ceiling)',
    'overhead_pct': '100 x (step time / step time of `none` - 1)',
    'exchange_alone_ms': "the same trainer's exchange timed by itself, after training: "
                         'trainer.allreduce_grads() then mx.nd.waitall(), median of the slowest rank',
    'hidden': 'harness.hidden_share of the step, the step of `none` (compute) and the exchange '
              'alone: (compute + exchange - step) / min(compute, exchange), 1: the shorter hidden '
              'whole; 0: none of it; < 0: together they took longer than both alone',
    'cpu_step': "harness.cpu_summary of the step's timed runs: each rank's CPU ms a step and, when "
                'every rank runs on one machine (test hosts), its busy share of every core (the '
                "kernel's TCP work too, which no process is charged for); cpu_exchange: the same of "
                'the exchange alone',
}


def _stats(times):
    q1, med, q3 = np.percentile(times, [25, 50, 75])
    return med, 100 * (q3 - q1) / med


def derive(rows):
    """Fill the figures of DEFINITIONS into every row."""
    by_name = {r['config']: r for r in rows}
    single, none = by_name.get('single'), by_name.get('none')
    single_rate = single and single['images_per_step'] / _stats(single['step_times_s'])[0]
    none_step = none and _stats(none['step_times_s'])[0]
    for row in rows:
        step, spread = _stats(row['step_times_s'])
        alone = row['exchange_alone_times_s']
        row.update(step_ms=step * 1e3, step_min_ms=min(row['step_times_s']) * 1e3,
                   step_max_ms=max(row['step_times_s']) * 1e3,
                   spread_pct=spread, images_per_s=row['images_per_step'] / step,
                   exchange_alone_ms=_stats(alone)[0] * 1e3 if alone else None)
        row['scaling_efficiency'] = (row['images_per_s'] / (row['ranks'] * single_rate)
                                     if single_rate else None)
        row['vs_none'] = none_step / step if none_step else None
        row['overhead_pct'] = 100 * (step / none_step - 1) if none_step else None
        row['hidden'] = (harness.hidden_share(none_step, _stats(alone)[0], step)
                         if none_step and alone and row['ranks'] > 1 else None)


def _model_header(name, entry, run):
    info = entry['info']
    return (f'\n{name}: input {"x".join(map(str, info["input_shape"][1:]))}, batch '
            f'{info["batch_per_rank"]} per rank ({info["global_batch"]} global), '
            f'{info["gradient_arrays"]} gradient arrays, {harness.format_size(info["gradient_bytes"])} '
            f'in all; {info["global_batch"] // info["batch_per_rank"]} ranks, median of '
            f'{run.args.trials} interleaved rounds, their min and max '
            f'(each step the slowest rank)')


def _row_cells(row):
    return [row['config'], report.spread_text({'median': row['step_ms'], 'min': row['step_min_ms'],
                                               'max': row['step_max_ms']}),
            report.cell(row['spread_pct'], '.0f', '%'),
            f'{row["images_per_s"]:.1f}', report.cell(row['scaling_efficiency'], '.2f'),
            report.cell(row['vs_none'], '.2f'), report.cell(row['overhead_pct'], '+.1f', '%'),
            report.cell(row['exchange_alone_ms'], '.1f'), report.cell(row['hidden'], '.2f'),
            report.cell((row['cpu_step'] or {}).get('machine_busy'), '.0%')]


def print_model(run, name):
    entry = run.models[name]
    derive(entry['rows'])
    harness.rank0_print(_model_header(name, entry, run))
    harness.rank0_print(report.text(
        ['config', 'step ms (min-max)', 'IQR', 'images/s', 'scaling eff', 'vs none',
         'overhead', 'exch alone(ms)', 'hidden', 'machine busy'], [_row_cells(row) for row in entry['rows']],
        align=['left'] + ['right'] * 9))
    if entry.get('raw_allreduce'):
        harness.rank0_print('raw MPI Allreduce(IN_PLACE) in the exchange-alone rounds, median ms: ' +
                            ', '.join(f'{harness.format_size(r["bytes"])} {r["median_ms"]:.2f}'
                                     for r in entry['raw_allreduce']))
    _print_verdict(entry['rows'])


def _print_verdict(rows):
    ours = [r for r in rows if r['config'].startswith(('mpi_kvstore:', 'DistributedTrainer'))]
    if not ours or COMM.size == 1 or ours[0]['vs_none'] is None:
        return
    best = max(ours, key=lambda r: r['images_per_s'])
    ok = best['vs_none'] >= TARGET_VS_NONE and best['overhead_pct'] <= TARGET_OVERHEAD
    harness.rank0_print(f'best mpi_kvstore config: {best["config"]}, {best["vs_none"]:.2f}x of none, '
                        f'{best["overhead_pct"]:+.1f}% step time (target >= {TARGET_VS_NONE:g}x and '
                        f'<= {TARGET_OVERHEAD:+g}%): {"met" if ok else "NOT met"}')


def print_definitions():
    harness.rank0_print('\nhow to read the tables:')
    for key, text in DEFINITIONS.items():
        harness.rank0_print(f'  {key}: {text}')


def plot(run):
    panels = {name: {r['config']: r['images_per_s'] for r in entry['rows']}
              for name, entry in run.models.items()}
    title = f'training throughput, {COMM.size} ranks, synthetic data (higher is better)'
    return report.plot_bars(run.png_path, panels, 'images/s', title)


def _omp_note():
    threads = os.environ.get('OMP_NUM_THREADS')
    if threads is None:
        return 'OMP_NUM_THREADS is not set: set it to 1 when each rank has one core'
    return f'OMP_NUM_THREADS={threads}'


def main(argv=None):
    args = parse_args(argv)
    run = Run(args)
    harness.rank0_print(f'scaling benchmark: {COMM.size} ranks, models {",".join(args.models)}, '
                        f'{args.warmups} warmup + {args.trials} timed rounds; {_omp_note()}')
    dist_sync = peers.DistSync(run, lifetime=PSLITE_LIFETIME)
    why = dist_sync.start()
    if why:
        run.skip(dist_sync.name, why)
    # A store of the blocking design (no threads) for the first broadcast of every model.
    setup, why = harness.create_store('blocking', args.timeout)
    if why:
        raise RuntimeError(f'cannot create an mpi_kvstore store: {why}')
    for index, name in enumerate(args.models):
        bench_model(run, Model(name, args, setup), dist_sync, index)
    setup.close()
    dist_sync.stop()
    for name in run.models:
        print_model(run, name)
    print_definitions()
    run.save()
    if COMM.rank == 0:
        print(f'\nresults written to {run.json_path}\n{plot(run)}', flush=True)


if __name__ == '__main__':
    harness.run_main(main)
