"""How much of each trainer's exchange hides behind compute: the trainers side by side, one job.

    mpiexec -n 2 python -m benchmarks.overlap [--model resnet50_v1] [--rounds 4] [--p3]
    python -m testbed run --hosts 2 --rate 3gbit -n 2 --timeout 900 -- \\
        python -m benchmarks.overlap --topology "2 hosts x 1 rank, 3gbit"

gpu_like's model, trained by every column, each a trainer over a store of its own, all
created before anything is timed: fifo (DistributedTrainer on funneled, no partitions or
credits: Horovod's order), priority (DistributedTrainer on the default store, untuned),
gluon (gluon.Trainer, one pushpull a key), dist_sync (gluon.Trainer on ps-lite; --p3: its
P3 van, a job of its own) and horovod (when it imports; its polling thread loads the CPU of
every other column, hence --columns). By name only: autotuned (priority with autotune=1;
the rest run with autotune=0) and best (priority with --best-options fixed).
--compression fp16 applies to every column that has it (not dist_sync).

autotuned settles in untimed, weight-checked warm-up runs, up to its settle bound
(docs/tuning.md); the JSON and the table say after how many steps it settled, on what.

Timing: rounds (harness.interleaved) in which every column makes one run of --chain steps
(gpu_like.train, one wait at the end, every weight checked against numpy; a failing column
is reported failed and timed no more), beside compute alone and then each column's exchange
alone (trainer.allreduce_grads of ready gradients). Each run is a harness.timed_run, with
the machine's busy share of every core and each rank's CPU ms a step. From the medians: the
hidden share (harness.hidden_share), step / max(compute, exchange) and vs fifo (fifo's step
/ this step). --layers custom and --host-load (gpu_like's) apply to every entry alike.

Rank 0 prints Markdown tables and writes them (.md), a JSON and a bar plot to --out.
"""
import functools
import gc
import math
import os
import shlex
import sys

import mxnet as mx
from mpi4py import MPI

from benchmarks import gpu_like, harness, peers, report
from mpi_kvstore.designs import autotune

FIFO = 'funneled+partition_bytes=0+credit_bytes=0'
COLUMNS = ('fifo', 'priority', 'autotuned', 'best', 'gluon', 'dist_sync', 'horovod')
DEFAULT_COLUMNS = ('fifo', 'priority', 'gluon', 'dist_sync', 'horovod')
COMPRESSIONS = ('none', 'fp16')
STEPS = {'warmups': 1, 'trials': 4}         # untimed and timed rounds
DEFAULT_OUT = os.path.join(harness.DEFAULT_OUT, 'overlap')
PSLITE_LIFETIME = 3600                      # s: the ps-lite servers' own safety alarm
COMPUTE = 'compute alone'


def parse_args(argv=None):
    parser = harness.parser(__doc__)
    add = parser.add_argument
    add('--model', default='resnet50_v1', choices=gpu_like.MODELS)
    add('--images-per-s', type=float,
        help='of one emulated GPU (default: 125 for resnet50_v1, others at its FLOP rate)')
    add('--batch', type=int, default=gpu_like.BATCH, help='images per rank per step')
    add('--chain', type=int, default=3, help='steps per timed run, no waitall between them')
    add('--lr', type=float, default=0.1)
    add('--optimizer', default='sgd', choices=('sgd', 'gpulikesgd'),
        help='gpulikesgd: every column\'s update an op on the emulated GPU (gpu_like.GPULikeSGD)')
    add('--layers', default='compiled', choices=tuple(gpu_like.LAYERS),
        help="compiled: every layer an op in machine code (numba); custom: Python CustomOps under "
             "autograd, as users' custom layers are (every entry alike)")
    add('--host-load', type=float, default=0.0, metavar='FRACTION',
        help='a Python thread in each rank holds the GIL this share of the time (busy, then asleep, '
             f'every {gpu_like.HOST_LOAD_PERIOD_S * 1e3:.0f} ms), as a data pipeline does')
    parser.add_argument('--topology', help='a free label, e.g. "2 hosts x 1 rank, 3gbit"')
    harness.add_common_args(parser, default_out=DEFAULT_OUT, sizes=False, quick=False, full=STEPS)
    parser.add_argument('--rounds', dest='trials', type=int, help='the same as --trials')
    peers.add_args(parser)
    parser.add_argument('--columns', type=harness.names, default=list(DEFAULT_COLUMNS),
                        help=f'the trainers to time, comma-separated, of {",".join(COLUMNS)}: a '
                             "job of Horovod alone is one whose CPU no other column's threads share")
    parser.add_argument('--best-options', type=gpu_like.fixed_options, default={},
                        help="the best column's store options, e.g. 'partition_bytes=4M,credit_bytes=16M'")
    parser.add_argument('--compression', default='none', choices=COMPRESSIONS,
                        help='fp16: every mpi_kvstore column and horovod send fp16; dist_sync float32')
    parser.add_argument('--autotune-steps', type=int,
                        help="the autotuned column's autotune_steps (default: the store's, 10)")
    args = harness.resolve_quick(parser.parse_args(argv), STEPS)
    if not 0 <= args.host_load <= 1:
        parser.error(f'--host-load {args.host_load}: a share of the time, in [0, 1]')
    unknown = sorted(set(args.columns) - set(COLUMNS))
    if unknown or not args.columns:
        parser.error(f'--columns {",".join(args.columns)}: use some of {",".join(COLUMNS)}')
    if ('best' in args.columns) != bool(args.best_options):
        parser.error('--best-options goes with --columns ...,best, and best needs it')
    if args.autotune_steps is not None and args.autotune_steps < 1:
        parser.error(f'--autotune-steps {args.autotune_steps}: at least 1')
    if 'dist_sync' not in args.columns:
        args.no_dist_sync = True            # no ps-lite processes started for nothing
    return args


class Column:
    """One trainer to time; step_batch: trainer.step's argument (the batch the summed
    gradients stand for)."""

    def __init__(self, name, trainer, step_batch, kv=None, options=None):
        self.name, self.trainer, self.step_batch, self.kv = name, trainer, step_batch, kv
        self.options = options or {}
        self.failed = None           # why the weight check failed, once it has


def _store_options(kv):
    config = kv.config
    return {'design': kv.design, **{name: getattr(config, name) for name in (
        'partition_bytes', 'credit_bytes', 'fusion_threshold', 'progress_sleep_us', 'compression',
        'autotune')}}


def make_columns(run, model, dist_sync):
    """Every column's trainer (collective, harness.make_trainer); what cannot run goes to
    run.skip."""
    import mpi_kvstore
    args, comm, params = run.args, harness.world(), model.collect_params()
    optimizer = (args.optimizer, {'learning_rate': args.lr})
    # dist_sync's trainer first: a Parameter keeps the last trainer made on it, and ps-lite
    # stops only once nothing holds its store (DistSync.stop).
    columns = [] if dist_sync.kv is None else [Column(dist_sync.name, *_batch(args, harness.make_trainer(
        'gluon', params, optimizer, dist_sync.kv)), options={
            'store': dist_sync.kv.type, 'ps_root': dist_sync.pslite.root, 'compression': 'none'})]
    wire = {} if args.compression == 'none' else {'compression': args.compression}
    tuned = dict(wire, autotune=1, **({'autotune_steps': args.autotune_steps}
                                      if args.autotune_steps else {}))
    ours = [('fifo', FIFO, 'distributed', wire), ('priority', None, 'distributed', wire),
            ('autotuned', None, 'distributed', tuned),
            ('best', None, 'distributed', dict(wire, **args.best_options)),
            ('gluon', None, 'gluon', wire)]
    for name, design, kind, options in ours:
        if name in args.columns:
            kv, why = harness.create_store(design, args.timeout, **options)
            if why:
                raise SystemExit(f'no store for {name}: {why}')
            if kind == 'gluon':
                mpi_kvstore.broadcast_parameters(params, store=kv)
            columns.insert(len(columns) - (dist_sync.kv is not None), Column(
                name, *_batch(args, harness.make_trainer(kind, params, optimizer, kv)), kv, _store_options(kv)))
    _, why = peers.horovod(comm) if 'horovod' in args.columns else (None, None)
    if why:
        run.skip('horovod', why)
    elif 'horovod' in args.columns:
        columns.append(Column('horovod', *_batch(args, harness.make_trainer(
            'horovod', params, optimizer, compression=args.compression)),
            options={'compression': 'hvd.Compression.fp16' if args.compression == 'fp16' else 'none'}))
    # gluon.Trainer initialises its keys on the store in its first step, and there dist_sync
    # (MXNet 1.9.1) sometimes leaves a weight set to its first summed gradient (seen: the
    # 2.4M-element stage4_conv4_weight of ResNet-18, first run only, 2 jobs in 6): do it
    # now, outside the runs, which start from weights written afresh.
    for column in columns:
        column.trainer.allreduce_grads()
    mx.nd.waitall()
    return columns


def _batch(args, made):
    """(trainer, step's batch) of harness.make_trainer's (trainer, ranks)."""
    trainer, ranks = made
    return trainer, args.batch * ranks


def reset_weights(model):
    """gpu_like's initial values, written in place: the trainers keep the same arrays (no
    re-initialisation, which would make new ones) and the check knows where they start."""
    for index, param in enumerate(model.collect_params().values()):
        param.data()[:] = gpu_like.initial_value(index)
    mx.nd.waitall()


def train_run(args, model, column, comm):
    """One timed run of --chain steps: (seconds a step, the slowest rank's, and the run's
    CPU sample), or None when the weights come out wrong on any rank: then column.failed
    says why. The sample covers the run, not the reset or the check."""
    if column.failed:
        return None
    reset_weights(model)
    _, sample = harness.timed_run(lambda: gpu_like.train(model, column.trainer, args.chain, column.step_batch,
                                                         comm.rank), comm, args.chain, machine=True)
    try:
        gpu_like.check_trained(model, args.lr, args.batch, args.chain, comm.size, column.name)
        if column.name != 'horovod':    # Horovod averages its gradients
            gpu_like.check_gradients(model, args.chain - 1, comm.size)
        error = None
    except RuntimeError as exc:
        error = str(exc)
    column.failed = harness.agree(error, comm)
    if column.failed:
        harness.rank0_print(f'  {column.name}: weight check failed, no more runs: {column.failed}')
        return None
    return sample['wall_s'] / args.chain, sample


def settle(args, model, columns, comm):
    """Train the autotuned column, if any, untimed, until its search settles (every rank
    agrees), at most ceil(bound / chain) + 1 runs (module docstring); what it chose goes
    into its options['autotune']. (A function: a loop in main would keep a column, and
    with it dist_sync's store, alive past close().)"""
    column = next((c for c in columns if c.name == 'autotuned'), None)
    if column is None:
        return
    state = column.kv.autotune_state
    if state is None:
        column.failed = f'design {column.kv.design} does not autotune'
        return
    runs, steps = math.ceil(state.bound / args.chain) + 1, 0
    while steps < runs * args.chain and comm.allreduce(column.kv.autotune_state.active,
                                                       op=MPI.LOR):
        train_run(args, model, column, comm)
        steps += args.chain
    # the last switch happens on the negotiation thread, after some rank's loop test
    state = column.kv.autotune_state
    settled = not comm.allreduce(state.active, op=MPI.LOR)
    column.options['autotune'] = {'settled': settled, 'steps': steps, 'bound': state.bound,
                                  'chose': autotune.describe(state.values),
                                  'switches': len(state.switches), **state.values}
    harness.rank0_print(f'  autotuned: {"settled" if settled else "NOT settled"} after {steps} '
                        f'steps (bound {state.bound}): {autotune.describe(state.values)}')


def exchange_run(column, comm):
    """The column's exchange of ready gradients, waited for: (seconds, CPU sample)."""
    if column.failed:
        return None
    _, sample = harness.timed_run(lambda: (column.trainer.allreduce_grads(), mx.nd.waitall()), comm,
                                  machine=True)
    return sample['wall_s'], sample


def compute_run(args, model, comm):
    """Compute alone as a run: --chain steps of forward and backward with no trainer, each
    waited for; (seconds a step, the slowest rank's, and the run's CPU sample)."""
    _, sample = harness.timed_run(lambda: gpu_like.compute(model, args.chain, comm.rank), comm,
                                  args.chain, machine=True)
    return sample['wall_s'] / args.chain, sample


def rounds(args, ops):
    """({name: [seconds of each timed round]}, {name: CPU summary}) of {name: op},
    interleaved; an op returns None once its column failed (not kept)."""
    timed = harness.interleaved(ops, args.trials, args.warmups, lambda name, op: op())
    kept = {name: [v for v in values if v is not None] for name, values in timed.items()}
    return ({name: [seconds for seconds, _ in values] for name, values in kept.items()},
            {name: harness.cpu_summary([sample for _, sample in values]) for name, values in kept.items()})


def summarize(columns, compute, steps, exchanges, cpu):
    """The rows of the table: medians and spreads in seconds, the ratios (docstring) and
    the CPU of the training runs ('cpu_step') and of the exchange alone ('cpu_exchange')."""
    rows = []
    for column in columns:
        row = {'column': column.name, 'options': column.options, 'check': column.failed or 'ok',
               'cpu_step': cpu[0].get(column.name), 'cpu_exchange': cpu[1].get(column.name)}
        if column.failed:
            rows.append(row)
            continue
        step, exchange = harness.spread(steps[column.name]), harness.spread(exchanges[column.name])
        row.update(step_s=steps[column.name], exchange_s=exchanges[column.name],
                   step=step, exchange=exchange)
        s, e = step['median'], exchange['median']
        row['hidden_share'] = harness.hidden_share(compute, e, s)
        row['step_over_max'] = s / max(compute, e)
        rows.append(row)
    fifo = next((r for r in rows if r['column'] == 'fifo' and 'step' in r), None)
    for row in rows:
        if 'step' in row and fifo:
            row['vs_fifo'] = fifo['step']['median'] / row['step']['median']
    return rows


def close(columns, model):
    """Close the mpi_kvstore stores (raising what one deferred) and drop every trainer:
    dist_sync stops only once nothing holds its store, and each Parameter holds the last
    trainer made on it (dist_sync's, in a job of dist_sync or P3 alone)."""
    for column in columns:
        if column.kv is not None:
            column.kv.wait()
            column.kv.close()
    columns.clear()
    for param in model.collect_params().values():
        param._set_trainer(None)
    gc.collect()


def _busy(cpu):
    return '-' if not cpu or cpu['machine_busy'] is None else f'{cpu["machine_busy"] * 100:.0f}'


def _rank_ms(cpu):
    """Each rank's CPU ms a step (or an exchange), over the runs together, rank 0 first."""
    return '-' if not cpu else '/'.join(f'{ms:.0f}' for ms in cpu['rank_cpu_ms_per_unit'])


def table(rows, compute, skipped, compute_cpu=None):
    cells = [['compute alone', report.spread_text(compute, 1e3), '', '', '', '', _busy(compute_cpu),
              _rank_ms(compute_cpu), '']]
    for row in rows:
        if 'step' not in row:
            cells.append([row['column'], 'failed', '', '', '', '', '', '', row['check']])
            continue
        step_cpu, exchange_cpu = row.get('cpu_step'), row.get('cpu_exchange')
        cells.append([row['column'], report.spread_text(row['step'], 1e3), report.spread_text(row['exchange'], 1e3),
                      f'{row["hidden_share"]:.2f}',
                      f'{row["step_over_max"]:.2f}', f'{row["vs_fifo"]:.2f}x' if 'vs_fifo' in row else '-',
                      f'{_busy(step_cpu)}; {_busy(exchange_cpu)}',
                      f'{_rank_ms(step_cpu)}; {_rank_ms(exchange_cpu)}', 'ok'])
    cells += [[name, 'skipped', '', '', '', '', '', '', why] for name, why in skipped.items()]
    return '\n'.join([report.markdown(
        ['column', 'step ms (min-max)', 'exchange alone ms (min-max)', 'hidden share',
         'step / max(compute, exchange)', 'vs fifo', 'machine busy %: step; exchange',
         'rank CPU ms/step: step; exchange', 'weights'], cells), *notes(rows)])


def notes(rows):
    """The lines under the table: what autotuned chose, best's options, the wire."""
    lines = []
    for row in rows:
        tuned, options = row['options'].get('autotune'), row['options']
        if isinstance(tuned, dict):
            lines.append(f'- {row["column"]}: {"settled" if tuned["settled"] else "NOT settled"} '
                         f'after {tuned["steps"]} untimed steps (bound {tuned["bound"]}) on '
                         f'{tuned["chose"]}; timed with those values')
        elif row['column'] == 'best':
            lines.append(f'- best: fixed {autotune.describe(options)} (--best-options)')
    wires = {row['column']: row['options'].get('compression', 'none') for row in rows}
    if any(wire != 'none' for wire in wires.values()):
        lines.append('- wire: ' + ', '.join(f'{name} {wire}' for name, wire in wires.items())
                     + ' (ps-lite has no fp16 cast)' * any(n.startswith('dist_sync') for n in wires))
    return [''] + lines if lines else []


def plot(path, rows, compute, title):
    """A panel per column: compute alone, its exchange alone and its training step (medians)."""
    return report.plot_bars(path, {r['column']: {
        'compute alone': compute * 1e3, 'exchange alone': r['exchange']['median'] * 1e3,
        'training step': r['step']['median'] * 1e3} for r in rows if 'step' in r}, 'ms', title)


def main(argv=None):
    args = parse_args(argv)
    comm = harness.world()
    plan_ = gpu_like.plan(args.model, args.images_per_s, args.batch)
    model = gpu_like.make_model(plan_, args.layers)
    model.initialize()
    where = harness.topology(comm, args.topology)
    label = args.topology or f'{where["hosts"]} host(s), {comm.size} ranks in all'
    load_start = os.getloadavg()
    run = harness.Run('overlap', args, comm=comm, label=f'{args.model}_h{where["hosts"]}'
                      + ('_p3' if args.p3 else '')
                      + ('' if args.compression == 'none' else f'_{args.compression}')
                      + ('' if args.layers == 'compiled' else f'_{args.layers}')
                      + (f'_load{args.host_load:g}' if args.host_load else ''))
    harness.rank0_print(
        f'overlap: {args.model}, {plan_.grad_bytes / 1e6:.1f} MB of gradients, '
        f'{plan_.images_per_s:.1f} images/s at batch {args.batch} ({plan_.compute_s * 1e3:.1f} ms '
        f'of compute a step); {label}; {args.warmups} + {args.trials} rounds of {args.chain} steps; '
        f'{args.layers} layers; host load {args.host_load:g}')
    dist_sync = peers.DistSync(run, lifetime=PSLITE_LIFETIME)
    with harness.deadline(args.timeout, 'overlap', lambda: run.on_expire and run.on_expire()):
        why = dist_sync.start()
        if why and 'dist_sync' in args.columns:     # not asked for: nothing to say
            run.skip(dist_sync.name, why)
        columns = make_columns(run, model, dist_sync)
        with gpu_like.HostLoad(args.host_load) as load:    # the timed rounds only
            settle(args, model, columns, comm)      # under the same load as it is timed
            steps, step_cpu = rounds(args, {COMPUTE: lambda: compute_run(args, model, comm), **{
                c.name: functools.partial(train_run, args, model, c, comm) for c in columns}})
            compute_s = steps.pop(COMPUTE)
            for param in model.collect_params().values():
                if param.grad_req != 'null':
                    # sums of zeros: repeated in-place sums neither grow to inf nor change the work
                    param.grad()[:] = 0
            exchanges, exchange_cpu = rounds(args, {c.name: functools.partial(exchange_run, c, comm)
                                                    for c in columns})
            compute = harness.spread(compute_s)
            rows = summarize(columns, compute['median'], steps, exchanges, (step_cpu, exchange_cpu))
            compute_cpu = step_cpu[COMPUTE]
        close(columns, model)
    dist_sync.stop()
    text = table(rows, compute, run.skipped, compute_cpu)
    harness.rank0_print(f'\n{text}\n')
    payload = {'model': args.model, 'images_per_s': plan_.images_per_s, 'batch': args.batch,
               'chain': args.chain, 'grad_bytes': plan_.grad_bytes,
               'compute_stated_s': plan_.compute_s,
               'topology': where, 'compute_alone': {'step_s': compute_s, **compute,
                                                    'cpu': compute_cpu},
               'layers_mode': args.layers, 'host_load': {'fraction': args.host_load, 'period_s': load.period_s,
                             'busy_share': load.busy_share},
               'columns': rows, 'table': text,
               'machine': {'cores': os.cpu_count(), 'loadavg_start': load_start,
                           'loadavg_end': os.getloadavg()}}
    run.write(payload, topology=label)
    if comm.rank == 0:
        command = shlex.join(['python', '-m', 'benchmarks.overlap', *sys.argv[1:]])
        with open(run.json_path[:-len('.json')] + '.md', 'w') as handle:
            handle.write(f'{args.model}, {label}, {run.started}:\n'
                         f'`{command}`\n\n{text}\n')
        message = plot(run.png_path, rows, compute['median'], f'{args.model}, {label}')
        print(f'written to {run.json_path}\n{message}', flush=True)


if __name__ == '__main__':
    harness.run_main(main)
