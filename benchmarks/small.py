"""Small tensors: per-call latency and a burst of many small allreduces, through kv.pushpull and
through mpi_kvstore.horovod, beside raw MPI (and Horovod where horovod.mxnet imports).

    mpiexec -n 2 python -m benchmarks.small --quick
    OMP_NUM_THREADS=1 mpiexec -n 2 python -m benchmarks.small [--sizes 4K,1M] [--design chained]

Cases: 'single' times one synchronous call per size (the call, then wait_to_read); 'burst'
issues --burst-keys tensors of --burst-size back to back, one call each (a step's gradients,
as gluon.Trainer and a custom hvd.allreduce_ loop issue them), then waits for all.

Methods, every one on float32 arrays of ones checked once (the sum over ranks) before timing:
raw_mpi (mpi4py Allreduce(send, recv), one per tensor), raw_mpi:fused (the burst's bytes in
one Allreduce: the reference of the burst), pushpull (kv.pushpull in place), hvd (the
Horovod API of mpi_kvstore: hvd.allreduce_ with op=Sum), hvd:grouped (the burst as one
hvd.grouped_allreduce_) and horovod (horovod.mxnet's allreduce_, when it imports).

Every method of a case runs in interleaved rounds (harness.interleaved), so drifting load on
a shared machine hits all alike; a trial keeps the slowest rank's time. Tables print the
median and (min-max) in us, and each method's median over raw MPI's (per call) or over the
fused reference (burst).
"""
import functools
import gc

import mxnet as mx
from mpi4py import MPI

import mpi_kvstore.horovod as kvhvd
from benchmarks import harness, peers, report

COMM = MPI.COMM_WORLD
SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20]
FULL = {'sizes': SIZES, 'trials': 30, 'warmups': 5}
QUICK = {'sizes': [4 << 10, 64 << 10], 'trials': 5, 'warmups': 2}
BURST_KEY0 = 1000        # burst keys sit apart from the single calls' keys 0, 1, ...


def parse_args(argv=None):
    parser = harness.parser(__doc__)
    harness.add_common_args(parser, full=FULL, quick=QUICK)
    parser.add_argument('--design', help='the store design, with options after + as in '
                        'harness.designs (default: the store default)')
    parser.add_argument('--burst-keys', type=int, default=100, help='tensors in the burst')
    parser.add_argument('--burst-size', type=harness.parse_size, default=16 << 10,
                        help='bytes per tensor of the burst')
    parser.add_argument('--no-horovod', action='store_true',
                        help='leave out horovod.mxnet even where it imports')
    parser.add_argument('--label', default='', help='suffix of the result file names')
    args = harness.resolve_quick(parser.parse_args(argv), FULL, QUICK)
    if args.burst_keys < 1 or args.burst_size < 4:
        raise SystemExit('--burst-keys must be >= 1 and --burst-size >= 4 bytes')
    return args


# ---------------------------------------------------------------- what is timed

def hvd_op(hvd, nbytes, count, grouped=False, prefix='t'):
    """``count`` tensors of nbytes through ``hvd`` (mpi_kvstore.horovod or horovod.mxnet):
    allreduce_ (op=Sum) of each, or one grouped_allreduce_, then wait for all. Checked once
    (ones sum to the rank count), then zeroed, as harness.pushpull_op does."""
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
    op()
    harness.check_sum(arrays[-1].asnumpy(), COMM.size, f'{hvd.__name__} allreduce_')
    for array in arrays:
        array[:] = 0
    mx.nd.waitall()
    return op


def makers(kv, horovod, keys, nbytes, burst):
    """{method: make_op} of one case: ``keys`` tensors of ``nbytes``."""
    count = len(keys)
    found = {'raw_mpi': functools.partial(peers.raw_allreduce_op, nbytes, count, in_place=False)}
    if burst:
        found['raw_mpi:fused'] = functools.partial(peers.raw_allreduce_op, nbytes * count,
                                                   in_place=False)
    found['pushpull'] = functools.partial(harness.pushpull_op, kv, keys, nbytes)
    found['hvd'] = functools.partial(hvd_op, kvhvd, nbytes, count)
    if burst:
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

    def time_case(self, case, nbytes, keys, makers_):
        times = self.time_ops(f'{case} {harness.format_size(nbytes)} x {len(keys)}', makers_)
        reference = 'raw_mpi:fused' if case == 'burst' else 'raw_mpi'
        base = harness.median(times[reference])
        for name, seconds in times.items():
            row = harness.summarize(seconds, nbytes * len(keys), COMM.size)
            self.rows.append({'method': name, 'case': case, 'keys': len(keys),
                              'tensor_bytes': nbytes, 'vs_reference': row['latency_us'] / 1e6
                              / base, 'reference': reference, **row})
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
    args = run.args
    kv, why = harness.create_store(args.design, args.timeout)
    if why:
        raise SystemExit(f'cannot create the store: {why}')
    kvhvd.init(**dict(harness.store_options(args.design), autotune='0'))
    horovod, why = (None, 'left out (--no-horovod)') if args.no_horovod else peers.horovod(COMM)
    if why:
        run.skip('horovod', why)
    run.on_expire = None
    for index, nbytes in enumerate(args.sizes):
        run.time_case('single', nbytes, [index], makers(kv, horovod, [index], nbytes, False))
    keys = list(range(BURST_KEY0, BURST_KEY0 + args.burst_keys))
    run.time_case('burst', args.burst_size, keys,
                  makers(kv, horovod, keys, args.burst_size, True))
    harness.rank0_print(f'\nsmall tensors, {COMM.size} ranks, design {kv.design}, '
                        f'{args.trials} interleaved rounds (slowest rank):\n' + table(run.rows))
    kv.wait()
    kv.close()
    kvhvd.shutdown()
    run.save()
    harness.rank0_print(f'results: {run.json_path}')


def main(argv=None):
    run = Run(parse_args(argv))
    bench(run)


if __name__ == '__main__':
    harness.run_main(main)
