"""GPU transports on CuPy arrays, against the device's own copy and NCCL's own allreduce.

    mpiexec -n N python -m benchmarks.gpu_bandwidth [--mb 64] [--repeats 20] [--json PATH]

Needs CuPy and a GPU, not MXNet. For one float32 buffer of --mb MB: the device-to-device
copy, copies down to pageable and pinned host memory, NCCL's allreduce (cupy.cuda.nccl) and
raw MPI_Allreduce of a pinned host copy (the baselines), pushpull through each transport that
runs here (reduce.Reducer on a comm.Comm, on a fresh thread as the store runs it; at one rank
the transport's own allreduce), pushpull compressed on the GPU (fp16, bf16, 2-bit) and the
device fusion threshold (the same bytes as 256 arrays). Rank 0 prints ms, GB/s (bytes /
time) and the ratios to the D2D copy and to the baseline of the same kind, all of medians,
with each row's min and max; --json writes the same rows, every timing kept.
"""
import argparse
import json
import threading

import cupy
import cupyx
import numpy as np
from mpi4py import MPI

from benchmarks import harness, report
from mpi_kvstore import compression
from mpi_kvstore.comm import host as comm_mod
from mpi_kvstore.comm import transports
from mpi_kvstore.comm.collective import Collective
from mpi_kvstore.comm.fusion import plan
from mpi_kvstore.comm.reduce import Reducer
from mpi_kvstore.comm.transports import staged
from mpi_kvstore.errors import ConfigError

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
DEVICE = RANK % cupy.cuda.runtime.getDeviceCount()
cupy.cuda.Device(DEVICE).use()


def timed(fn, repeats):
    """Seconds of each of `repeats` runs of fn() (each the slowest rank's, ranks started
    together), after two warm-ups."""
    return harness.measure(WORLD, fn, 2, repeats)


def on_thread(fn):
    """fn() on a fresh thread, as the store's communication threads run buckets."""
    box = []

    def run():
        try:
            fn()
        except BaseException as err:
            box.append(err)
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if box:
        raise box[0]


def reducer_pushpull(comm, bufs, threshold, codec=None):
    seq = iter(range(1 << 30))

    def failed(*args):
        raise RuntimeError(f'bench: a collective failed: {args}')
    reducer = Reducer(SIZE, failed, failed)

    def run():
        # averaged, so that repeated rounds keep the values (and fp16 never overflows);
        # a collective is numbered once, so each round makes its own
        reqs = [Collective('allreduce', i, np.dtype(buf.dtype), buf.shape, place='gpu',
                           average=True, seq=next(seq), view=buf, codec=codec)
                for i, buf in enumerate(bufs)]
        for bucket in plan(reqs, 1 << 20, threshold):
            on_thread(lambda b=bucket: reducer.allreduce(b, comm))
    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--mb', type=int, default=64)
    parser.add_argument('--repeats', type=int, default=20)
    parser.add_argument('--json', help='also write the rows, every timing kept, to this file')
    args = parser.parse_args()
    nbytes = args.mb << 20
    count = nbytes // 4
    buf = cupy.random.default_rng(RANK).standard_normal(count, dtype='float32')
    rows = []   # (what, seconds of each run, baseline name or None)

    other = cupy.empty_like(buf)
    rows.append(('cupy D2D copy', timed(lambda: (other.__setitem__(Ellipsis, buf),
                                                 cupy.cuda.Device().synchronize()),
                                        args.repeats), None))
    pinned = cupyx.empty_pinned((count,), dtype='float32')
    pageable = np.empty(count, dtype='float32')
    stream = cupy.cuda.Stream(non_blocking=True)
    rows.append(('copy down, pageable', timed(lambda: buf.get(out=pageable, stream=stream),
                                              args.repeats), None))
    rows.append(('copy down, pinned', timed(lambda: buf.get(out=pinned, stream=stream),
                                            args.repeats), 'copy down, pageable'))
    rows.append(('raw MPI_Allreduce, pinned host', timed(
        lambda: WORLD.Allreduce(MPI.IN_PLACE, pinned, op=MPI.SUM), args.repeats), None))
    step = staged.PIECE_BYTES // 4

    def in_pieces():
        for start in range(0, count, step):
            WORLD.Allreduce(MPI.IN_PLACE, pinned[start:start + step], op=MPI.SUM)
    rows.append((f'raw MPI_Allreduce, pinned host, {staged.PIECE_BYTES >> 20} MB pieces',
                 timed(in_pieces, args.repeats), 'raw MPI_Allreduce, pinned host'))

    probe = comm_mod.Comm(WORLD, 'off')
    agreed = transports.agreed(probe, DEVICE)
    runnable = []
    for name in ('nccl', 'cuda_mpi', 'staged'):
        try:
            runnable.append(transports.decide(name, *agreed, concurrent=False))
        except ConfigError:
            pass    # not usable on every rank here (tune prints why)
    if 'nccl' in runnable:
        from cupy.cuda import nccl
        uid = WORLD.bcast(nccl.get_unique_id() if RANK == 0 else None, root=0)
        raw = nccl.NcclCommunicator(SIZE, uid, RANK)
        rows.append(('raw NCCL allreduce', timed(lambda: (raw.allReduce(
            buf.data.ptr, buf.data.ptr, count, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream.ptr),
            stream.synchronize()), args.repeats), None))
    probe.free()

    for name in runnable:
        base = {'nccl': 'raw NCCL allreduce', 'cuda_mpi': 'raw MPI_Allreduce, pinned host',
                'staged': 'copy down, pinned' if SIZE == 1 else 'raw MPI_Allreduce, pinned host'
                }[name]
        comm = comm_mod.Comm(WORLD, 'off', gpu_transport=name)
        if SIZE == 1:
            transport = comm.device_transport(DEVICE)

            def alone(t=transport):
                with t.scope():
                    t.allreduce(buf)
                    t.finish()
            rows.append((f'{name} transport allreduce', timed(alone, args.repeats), base))
        else:
            rows.append((f'{name} pushpull (store path)',
                         timed(reducer_pushpull(comm, [buf], 64 << 20), args.repeats), base))
            if name == 'staged':   # the codecs encode on the GPU; MPI moves their bytes
                for codec in (compression.WireCast('fp16'), compression.WireCast('bf16'),
                              compression.TwoBit(0.5)):
                    rows.append((f'{name} pushpull, {codec.spec[0]} on the GPU',
                                 timed(reducer_pushpull(comm, [buf], 64 << 20, codec),
                                       args.repeats), f'{name} pushpull (store path)'))
            pieces = [buf[i * (count // 256):(i + 1) * (count // 256)] for i in range(256)]
            one = None
            for threshold in (0, 4 << 20, 16 << 20, 64 << 20):
                what = f'{name}, 256 arrays, device fusion {threshold >> 20} MB'
                rows.append((what, timed(reducer_pushpull(comm, pieces, threshold),
                                         max(5, args.repeats // 4)), one))
                one = one or what
        comm.free()

    if RANK == 0:
        seconds = {what: harness.median(runs) for what, runs, _ in rows}
        device = cupy.cuda.runtime.getDeviceProperties(DEVICE)['name'].decode()
        title = (f'GPU bandwidth: {args.mb} MB float32, {SIZE} rank(s), {device}, '
                 f'CuPy {cupy.__version__}, NCCL {_nccl_version()}')
        print(title)
        d2d = seconds['cupy D2D copy']
        print(report.markdown(
            ['what', 'ms', 'GB/s', 'x D2D copy time', 'x baseline time (baseline)',
             'min ms', 'max ms'],
            [[what, f'{seconds[what] * 1e3:.3f}', f'{nbytes / seconds[what] / 1e9:.1f}',
              f'{seconds[what] / d2d:.2f}',
              f'{seconds[what] / seconds[base]:.2f} ({base})' if base else '-',
              f'{min(runs) * 1e3:.3f}', f'{max(runs) * 1e3:.3f}'] for what, runs, base in rows]))
        if args.json:
            with open(args.json, 'w') as out:
                json.dump({'title': title, 'bytes': nbytes, 'ranks': SIZE, 'device': device,
                           'rows': [{'what': what, 'seconds': list(runs), 'baseline': base,
                                     **harness.spread(runs)} for what, runs, base in rows]},
                          out, indent=1)


def _nccl_version():
    try:
        from cupy.cuda import nccl
        return nccl.get_version()
    except Exception:
        return 'none'


if __name__ == '__main__':
    harness.run_main(main)
