"""Small tensors: one call, a burst of calls and a training step of many small parameters,
through kv.pushpull and mpi_kvstore.horovod, beside raw MPI and Horovod.

    OMP_NUM_THREADS=1 mpiexec -n 2 python -m benchmarks.small [--quick] [--design chained]
    OMP_NUM_THREADS=1 python -m benchmarks.small --horovod-python /path/to/venv/bin/python

Cases: 'single', one synchronous call per size; 'burst', --burst-keys tensors of
--burst-size, one call each back to back (as gluon.Trainer issues a step's gradients), then
a wait for all; 'trainer', a step of --layers Dense(64) on a batch of 8 (two parameters a
layer, 16 KB and 256 B, little compute).

Methods, each checked once: raw_mpi (mpi4py Allreduce), raw_mpi:fused (the burst in one
Allreduce, its reference), pushpull (kv.pushpull in place), hvd (mpi_kvstore.horovod's
allreduce_), hvd:grouped (one grouped_allreduce_) and horovod (horovod.mxnet's, where it
imports). Trainers: no_exchange (the reference), gluon (gluon.Trainer on the store's
defaults), hvd and horovod (each one's DistributedTrainer). Interleaved rounds
(harness.interleaved), a trial the slowest rank's; tables print median (min-max) in us and
the median over the case's reference.

--horovod-python PY (no mpiexec): --jobs pairs of alternating jobs of -n ranks, the store's
methods under this python and Horovod's (--horovod-only) under PY; then the table `small`,
every trial of a method in every job pooled.
"""
import functools
import gc
import json
import os
import subprocess
import sys
import time

from benchmarks import harness, report

SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20]
FULL = {'sizes': SIZES, 'trials': 30, 'warmups': 5}
QUICK = {'sizes': [4 << 10, 64 << 10], 'trials': 5, 'warmups': 2}
BURST_KEY0 = 1000        # burst keys sit apart from the single calls' keys 0, 1, ...
REFERENCE = {'single': 'raw_mpi', 'burst': 'raw_mpi:fused', 'trainer': 'no_exchange'}
# The combined table's columns: a case's methods, first found first (the trainer's in each).
COLUMNS = {'raw MPI': ('raw_mpi:fused', 'raw_mpi', 'no_exchange'), 'kv.pushpull': ('pushpull', 'gluon'),
           'mpi_kvstore.horovod': ('hvd',), 'horovod.mxnet': ('horovod',)}
DRIVER = ('--horovod-python', '--jobs', '-n', '--label')      # what the jobs are not given


def parse_args(argv=None):
    parser = harness.parser(__doc__)
    harness.add_common_args(parser, full=FULL, quick=QUICK)
    parser.add_argument('--design', help='the store design, with options after + as in '
                        'harness.designs (default: the store default)')
    parser.add_argument('--burst-keys', type=int, default=100, help='tensors in the burst')
    parser.add_argument('--burst-size', type=harness.parse_size, default=16 << 10,
                        help='bytes per tensor of the burst')
    parser.add_argument('--layers', type=int, default=100, help='Dense(64) layers of the '
                        "trainer case's model (0: no trainer case)")
    parser.add_argument('--no-horovod', action='store_true',
                        help='leave out horovod.mxnet even where it imports')
    parser.add_argument('--horovod-only', action='store_true',
                        help="time only raw MPI, horovod.mxnet and the step's reference")
    parser.add_argument('--horovod-python', help='a python whose environment has horovod.mxnet: '
                        'run alternating jobs (see above)')
    parser.add_argument('--jobs', type=int, default=2, help='pairs of jobs (--horovod-python)')
    parser.add_argument('-n', type=int, default=2, help='ranks a job (--horovod-python)')
    parser.add_argument('--label', default='', help='suffix of the result file names')
    args = harness.resolve_quick(parser.parse_args(argv), FULL, QUICK)
    harness.check_python(parser, args.horovod_python)
    if args.burst_keys < 1 or args.burst_size < 4 or args.layers < 0 or args.jobs < 1:
        raise SystemExit('--burst-keys and --jobs must be >= 1, --layers >= 0 and '
                         '--burst-size >= 4 bytes')
    return args


# ---------------------------------------------------------------- what is timed

def hvd_op(hvd, nbytes, count, grouped=False, prefix='t'):
    """``count`` tensors of nbytes through ``hvd`` (mpi_kvstore.horovod or horovod.mxnet):
    allreduce_ (op=Sum) of each, or one grouped_allreduce_, then wait for all (checked_once)."""
    import mxnet as mx
    arrays = [mx.nd.ones((nbytes // 4,), dtype='float32') for _ in range(count)]
    names = ['%s%d.%d' % (prefix, nbytes, i) for i in range(count)]

    def op():
        if grouped:
            hvd.grouped_allreduce_(arrays, name='%s%d.g' % (prefix, nbytes), op=hvd.Sum)
        else:
            for name, array in zip(names, arrays):
                hvd.allreduce_(array, name=name, op=hvd.Sum)
        for array in arrays:
            array.wait_to_read()
    return harness.checked_once(op, arrays, harness.world().size, f'{hvd.__name__} allreduce_')


def step_op(kind, layers, kv=None, hvd=None):
    """One training step of `layers` Dense(64) on a batch of 8 with trainer `kind`: the same
    start on every rank (seed 0), SGD; the ranks' weights are checked equal after one step."""
    import mxnet as mx
    from mxnet import autograd, gluon
    mx.random.seed(0)
    net = gluon.nn.HybridSequential()
    for _ in range(layers):
        net.add(gluon.nn.Dense(64, in_units=64))
    net.initialize(mx.init.Xavier())
    params, sgd = net.collect_params(), {'learning_rate': 1e-3}
    if kind in ('no_exchange', 'gluon'):      # gluon: the store sums, step() divides
        trainer, batch = gluon.Trainer(params, 'sgd', sgd, kvstore=kv), 8 * (kv.num_workers if kv else 1)
    else:                                     # a DistributedTrainer averages
        trainer, batch = hvd.DistributedTrainer(params, 'sgd', sgd), 8
    data = mx.nd.ones((8, 64)) * (1 + harness.world().rank)

    def op():
        with autograd.record():
            loss = net(data).mean()
        loss.backward()
        trainer.step(batch)
        mx.nd.waitall()
    op()
    if kind != 'no_exchange':
        why = harness.ranks_differ([p.data().asnumpy() for p in params.values()])
        if why:
            raise SystemExit(f'{kind}: {why}')
    return op


def makers(kv, kvhvd, horovod, keys, nbytes, burst, only_horovod=False):
    """{method: make_op} of one case: ``keys`` tensors of ``nbytes``."""
    from benchmarks import peers
    count = len(keys)
    found = {'raw_mpi': functools.partial(peers.raw_allreduce_op, nbytes, count, in_place=False)}
    if burst:
        found['raw_mpi:fused'] = functools.partial(peers.raw_allreduce_op, nbytes * count,
                                                   in_place=False)
    if not only_horovod:
        found['pushpull'] = functools.partial(harness.pushpull_op, kv, keys, nbytes)
        found['hvd'] = functools.partial(hvd_op, kvhvd, nbytes, count)
    if burst and not only_horovod:
        found['hvd:grouped'] = functools.partial(hvd_op, kvhvd, nbytes, count, grouped=True)
    if horovod is not None:
        found['horovod'] = functools.partial(hvd_op, horovod, nbytes, count, prefix='h')
    return found


# ---------------------------------------------------------------- one run

class Run(harness.Run):
    """Rows so far; saved after every case so a killed job still leaves them."""

    def __init__(self, args):
        super().__init__('small', args, args.label)
        self.rows = []

    def time_case(self, case, nbytes, count, makers_):
        times = self.time_ops(f'{case} {harness.format_size(nbytes)} x {count}', makers_)
        base = harness.median(times[REFERENCE[case]])
        for name, seconds in times.items():
            row = harness.summarize(seconds, nbytes * count, self.comm.size)
            self.rows.append({'method': name, 'case': case, 'keys': count,
                              'tensor_bytes': nbytes, 'vs_reference': row['latency_us'] / 1e6
                              / base, 'reference': REFERENCE[case], **row})
        gc.collect()   # the ops' arrays and keys' buffers go before the next case
        self.save()

    def save(self):
        self.write({'results': self.rows}, sizes=[harness.format_size(n) for n in self.args.sizes],
                   interleaved=True)


def table(rows):
    """The console table: a row per case and method, median (min-max) in us."""
    lines = [[r['case'], f'{harness.format_size(r["tensor_bytes"])} x {r["keys"]}', r['method'],
              report.spread_text({'min': r['min_us'], 'median': r['latency_us'],
                                  'max': r['max_us']}),
              report.cell(r['vs_reference'], '.2f', 'x') + ' ' + r['reference']]
             for r in rows]
    return report.text(['case', 'tensors', 'method', 'median (min-max) us', 'vs'], lines,
                       align=['left', 'right', 'left', 'right', 'left'], indent='  ')


def bench(run):
    args, only = run.args, run.args.horovod_only
    kv = kvhvd = None
    if not only:
        import mpi_kvstore.horovod as kvhvd
        kv, why = harness.create_store(args.design, args.timeout)
        if why:
            raise SystemExit(f'cannot create the store: {why}')
        kvhvd.init(**dict(harness.store_options(args.design), autotune='0'))
    from benchmarks import peers
    horovod, why = (None, 'left out (--no-horovod)') if args.no_horovod else peers.horovod()
    if why:
        run.skip('horovod', why)
    for index, nbytes in enumerate(args.sizes):
        run.time_case('single', nbytes, 1, makers(kv, kvhvd, horovod, [index], nbytes, False, only))
    keys = list(range(BURST_KEY0, BURST_KEY0 + args.burst_keys))
    run.time_case('burst', args.burst_size, len(keys),
                  makers(kv, kvhvd, horovod, keys, args.burst_size, True, only))
    if args.layers:
        steps = {'no_exchange': functools.partial(step_op, 'no_exchange', args.layers)}
        if not only:
            store, why = harness.create_store(args.design, args.timeout)
            if why:
                raise SystemExit(f'cannot create the store: {why}')
            steps['gluon'] = functools.partial(step_op, 'gluon', args.layers, kv=store)
            steps['hvd'] = functools.partial(step_op, 'hvd', args.layers, hvd=kvhvd)
        if horovod is not None:
            steps['horovod'] = functools.partial(step_op, 'horovod', args.layers, hvd=horovod)
        run.time_case('trainer', (64 * 64 + 64) * 4 // 2, 2 * args.layers, steps)
    if not only:       # a job under horovod's python lacks the console table's tabulate
        harness.rank0_print(f'\nsmall tensors, {run.comm.size} ranks, design {kv.design}, '
                            f'{args.trials} interleaved rounds (slowest rank):\n' + table(run.rows))
        kv.wait()
        kv.close()
        kvhvd.shutdown()
    run.save()
    harness.rank0_print(f'results: {run.json_path}')


# ---------------------------------------------------------------- alternating jobs

def job_argv(argv):
    """argv less the driver's own options (and their values)."""
    kept, skip = [], False
    for word in argv:
        if not skip and word.split('=')[0] not in DRIVER:
            kept.append(word)
        skip = not skip and word in DRIVER
    return kept


def alternate(args, argv):
    """--jobs pairs of jobs, store then Horovod, the order swapped every pair; then the table."""
    started, records = time.strftime('%Y-%m-%d, %H:%M'), []
    sides = [('store', sys.executable, ['--no-horovod']),
             ('horovod', args.horovod_python, ['--horovod-only'])]
    for index in range(args.jobs):
        for side, python, extra in harness.rotation(sides, index):
            label = f'{args.label}{side}{index}'
            print(f'job {index + 1}/{args.jobs}: {side}', flush=True)
            subprocess.run([harness.mpiexec_beside(python), '-n', str(args.n), python, '-m', 'benchmarks.small',
                            *job_argv(argv), *extra, '--label', label], check=True,
                           cwd=harness.REPO_ROOT, timeout=args.timeout * (len(args.sizes) + 3))
            with open(os.path.join(args.out, f'small_n{args.n}_{label}.json')) as handle:
                records.append(json.load(handle))
    record = combined(args, records, f'{started}-{time.strftime("%H:%M")} UTC',
                      'python -m benchmarks.small ' + ' '.join(argv))
    print(report.table_markdown(record) + f'\ntable: {report.write_table(args.out, record)}')


def combined(args, records, date, command):
    """The table_record of the jobs' rows: a row per case, every trial of a method pooled."""
    trials, labels = {}, {}
    for record in records:
        for row in record['results']:
            what = (row['case'], row['tensor_bytes'], row['keys'])
            trials.setdefault(what, {}).setdefault(row['method'], []).extend(row['trials_us'])
    for case, nbytes, keys in trials:
        labels[case, nbytes, keys] = (f'train step, {keys // 2} x Dense(64), batch 8' if case == 'trainer'
                                      else f'{case}, {harness.format_size(nbytes)}'
                                      + (f' x {keys}' if keys > 1 else ''))
    rows = [{'label': labels[what], 'hosts': 1, 'rate': None, 'cells': {
        column: next((harness.spread(methods[m]) for m in names if m in methods), None)
        for column, names in COLUMNS.items()}} for what, methods in trials.items()]
    first = records[0]['versions']
    return report.table_record(
        'small', 'Small tensors: one call, a burst, a training step (benchmarks.small)', command,
        date, f'one machine, {first["cpu_count"]} cores, {args.n} ranks', 'us', list(COLUMNS), rows,
        f'{args.trials} interleaved rounds in each of {args.jobs} jobs a side, alternating',
        [('kv.pushpull', 'raw MPI'), ('mpi_kvstore.horovod', 'horovod.mxnet')],
        notes=['raw MPI: an Allreduce a tensor, a burst in one; train step: no exchange',
               "kv.pushpull: a call a key; train step: gluon.Trainer(kvstore=mpi_kvstore.create())",
               'mpi_kvstore.horovod, horovod.mxnet: allreduce_ a tensor; train step: their '
               'DistributedTrainer'])


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.horovod_python:
        return alternate(args, argv)
    bench(Run(args))


if __name__ == '__main__':
    harness.run_main(main)
