"""Where one pushpull's time goes: its parts, each measured alone in one run.

    OMP_NUM_THREADS=1 mpiexec -n 2 python -m benchmarks.profile_pushpull [--size 4K]
        [--designs funneled,chained,chained+inline_max_bytes=1M]

Parts, each a median over interleaved rounds: raw_mpi (Allreduce(IN_PLACE) of the same bytes
on numpy), raw_mpi:ndarray (the same on an NDArray's own memory), agreement (the MIN-allreduce
of 6 int32 before every chained call), engine_floor (an engine op that writes one element,
then wait_to_read: a hand-off to a worker and back), inline_op (a no-op native op run inline,
kAsync: MXNet's push and wait without a hand-off), queued_op (the same pushed to the priority
worker, as chained pushes it); per design D: submit:D (kv.pushpull() returning: the Python
path, and where the op runs inline the agreement and the collective too), total:D (pushpull
then wait_to_read) and rest:D (total - submit - raw_mpi: hand-offs and waiting). Then a
cProfile of the first design's submit path, by own time.
"""
import cProfile
import io
import pstats
import time

import mxnet as mx
import numpy as np
from mpi4py import MPI

from benchmarks import harness, peers
from mpi_kvstore.engine.arrays import array_pointer, host_view

COMM = MPI.COMM_WORLD


def parse_args(argv=None):
    parser = harness.parser(__doc__)
    parser.add_argument('--size', type=harness.parse_size, default=4 << 10)
    parser.add_argument('--designs', type=harness.designs, default='funneled,chained')
    parser.add_argument('--calls', type=int, default=2000, help='timed calls per part')
    parser.add_argument('--rounds', type=int, default=5)
    parser.add_argument('--top', type=int, default=12, help='profile lines to print')
    return parser.parse_args(argv)


def timed(fn, calls, after=None):
    """Median seconds per call of fn() over ``calls`` calls, after a barrier; after(), when
    given, runs untimed after each call."""
    COMM.Barrier()
    samples = np.empty(calls)
    for i in range(calls):
        start = time.perf_counter()
        fn()
        samples[i] = time.perf_counter() - start
        if after:
            after()
    return float(np.median(samples))


def parts(args):
    count = args.size // 4
    raw, floor = peers.raw_allreduce_op(args.size), peers.engine_floor_op(args.size)
    memory = mx.nd.zeros((count,))
    memory.wait_to_read()
    view = host_view(array_pointer(memory)[0], args.size, np.float32)
    message = np.zeros(6, np.int32)
    dst = mx.nd.zeros((count,))
    inline, queued = _noop_op(dst, True), _noop_op(dst, False)
    stores = {}
    for design in args.designs:
        kv, why = harness.create_store(design, 600)
        if kv is None:
            raise SystemExit(f'{design}: {why}')
        stores[design] = kv
    arrays = {d: mx.nd.ones((count,)) for d in args.designs}
    for design, kv in stores.items():      # warm: keys known, code compiled
        for _ in range(50):
            kv.pushpull('p', arrays[design])
        kv.wait()

    ops = {'raw_mpi': (raw, None),
           'raw_mpi:ndarray': (lambda: COMM.Allreduce(MPI.IN_PLACE, view, op=MPI.SUM), None),
           'agreement': (lambda: COMM.Allreduce(MPI.IN_PLACE, message, op=MPI.MIN), None),
           'engine_floor': (floor, None),
             'inline_op': (lambda: (inline(), dst.wait_to_read()), None),
             'queued_op': (lambda: (queued(), dst.wait_to_read()), None)}
    for design in args.designs:
        kv, arr = stores[design], arrays[design]
        ops['total:' + design] = (lambda kv=kv, arr=arr: (kv.pushpull('p', arr), arr.wait_to_read()),
                                  None)
        # pushpull() returning, its output waited for untimed
        ops['submit:' + design] = (lambda kv=kv, arr=arr: kv.pushpull('p', arr), arr.wait_to_read)
    # Each round times every part (`calls` calls each), in an order that rotates.
    out = harness.interleaved(ops, args.rounds,
                              time_one=lambda name, op: timed(op[0], args.calls, after=op[1]))
    medians = {name: float(np.median(v)) for name, v in out.items()}
    for design in args.designs:
        medians['rest:' + design] = (medians['total:' + design] - medians['submit:' + design]
                                     - medians['raw_mpi'])
    profile = _profile(stores[args.designs[0]], arrays[args.designs[0]], args.calls, args.top)
    for kv in stores.values():
        kv.close()
    return medians, profile


def _profile(kv, arr, calls, top):
    COMM.Barrier()
    prof = cProfile.Profile()
    for _ in range(calls):
        prof.enable()
        kv.pushpull('p', arr)
        prof.disable()
        arr.wait_to_read()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats('tottime').print_stats(top)
    return text.getvalue()


def _noop_op(array, inline):
    """A push of a compiled op that completes at once (inline when ``array`` is ready)."""
    import numba
    from numba import types

    from mpi_kvstore.engine import core as engine
    from mpi_kvstore.engine import native

    complete = native._call_void_3   # the store's own call of the engine's callback

    @numba.cfunc(types.void(types.voidptr, types.voidptr, types.voidptr))
    def complete_at_once(run_ctx, on_complete, param):
        done = numba.carray(on_complete, 3, dtype=np.int64)
        complete(done[0], (done[1], done[2], 0))

    fn = complete_at_once.address
    return lambda: engine.push_native(fn, 0, [array], inline_when_ready=inline)


def main():
    args = parse_args()
    medians, profile = parts(args)
    if COMM.rank:
        return
    print(f'pushpull of {harness.format_size(args.size)} at {COMM.size} ranks: median us per '
          f'call ({args.calls} calls x {args.rounds} rounds)')
    raw = medians['raw_mpi']
    for name, value in medians.items():
        print(f'  {name:<18} {value * 1e6:8.1f} us   {value / raw:6.2f}x raw')
    print(f'\ncProfile of the submit path ({args.designs[0]}), by own time:')
    print(profile)


if __name__ == '__main__':
    harness.run_main(main)
