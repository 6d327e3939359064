"""How an allreduce's progress loop shares the CPU with compute: blocking MPI against a
non-blocking collective polled with sleeps, alone and beside a compute thread.

    python -m testbed run --hosts 2 --rate 3gbit -n 2 -- python -m benchmarks.progress
    OMP_NUM_THREADS=1 mpiexec -n 2 python -m benchmarks.progress [--size 16M] [--polls 0,100,1000]

Per mode, over --trials interleaved rounds, the slowest rank's median, min and max of:
compute alone (numpy matmuls on a thread of their own, which release the GIL), exchange
alone (Allreduce(IN_PLACE) of --size bytes: its wall time, the process's CPU meanwhile, and
the whole machine's busy cores from /proc/stat, which holds the kernel's TCP work too), both
(the exchange while the compute thread runs) and hidden = 1 - (both - compute) / exchange.
Modes: blocking (MPI_Allreduce, which MPICH busy-polls) and poll:U (MPI_Iallreduce, then Test
with sleeps doubling up to U us; 0: a tight loop).
"""
import functools
import threading
import time

import numpy as np
from mpi4py import MPI

from benchmarks import harness, report

COMM = MPI.COMM_WORLD


def parse_args(argv=None):
    parser = harness.parser(__doc__)
    parser.add_argument('--size', type=harness.parse_size, default=16 << 20)
    parser.add_argument('--polls', default='0,100,1000,5000',
                        help='comma-separated longest sleeps in us for the poll modes')
    parser.add_argument('--trials', type=int, default=7)
    parser.add_argument('--work', type=int, default=0,
                        help='matmuls of 256x256 in the compute part (default: about as long '
                             'as one blocking exchange)')
    return parser.parse_args(argv)


def exchange(buf, poll_us):
    if poll_us is None:
        COMM.Allreduce(MPI.IN_PLACE, buf)
        return
    req = COMM.Iallreduce(MPI.IN_PLACE, buf)
    sleep = 1e-6
    while not req.Test():
        if poll_us:
            time.sleep(sleep)
            sleep = min(2 * sleep, poll_us * 1e-6)


def compute(work):
    a = np.ones((256, 256), np.float32)
    for _ in range(work):
        a = (a @ a) * (1.0 / 256)
    return a


def slowest(value):
    return COMM.allreduce(value, op=MPI.MAX)


def timed(fn, busy=None):
    COMM.Barrier()
    start = harness.machine_busy() if busy is not None else 0.0
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    if busy is not None:
        busy.append((harness.machine_busy() - start, wall))
    return slowest(wall), slowest(cpu)


def both(buf, poll_us, work):
    worker = threading.Thread(target=compute, args=(work,))

    def run():
        worker.start()
        exchange(buf, poll_us)
        worker.join()
    return timed(run)


def main():
    args = parse_args()
    buf = np.ones(args.size // 4, np.float32)
    modes = [('blocking', None)] + [(f'poll:{p}', int(p)) for p in harness.names(args.polls)]
    work = args.work
    if not work:   # calibrate: compute about as long as one blocking exchange
        exchange(buf, None)
        took = timed(lambda: exchange(buf, None))[0]
        per = timed(lambda: compute(20))[0] / 20
        work = max(1, int(took / per))
    polls = dict(modes)
    for poll in polls.values():
        exchange(buf, poll)   # warm
    computed, busy = [], {name: [] for name in polls}
    alone, joint = {name: [] for name in polls}, {name: [] for name in polls}
    for r in range(args.trials):
        for name in harness.rotation([None] + list(polls), r):
            if name is None:
                computed.append(timed(lambda: compute(work))[0])
                continue
            alone[name].append(timed(functools.partial(exchange, buf, polls[name]), busy[name]))
            joint[name].append(both(buf, polls[name], work)[0])
    compute_alone = harness.spread(computed)
    rows = []
    for name in polls:
        machine = sum(b for b, _ in busy[name]) / sum(w for _, w in busy[name])
        wall = harness.spread([a[0] for a in alone[name]])
        cpu = float(np.median([a[1] for a in alone[name]]))
        together = harness.spread(joint[name])
        rows.append((name, wall, cpu / wall['median'], machine, together,
                     1 - (together['median'] - compute_alone['median']) / wall['median']))
    if COMM.rank == 0:
        print(f'{COMM.size} ranks, {harness.format_size(args.size)} per exchange, {args.trials} '
              f'interleaved rounds; compute alone {compute_alone["median"] * 1e3:.1f} ms '
              f'(min {compute_alone["min"] * 1e3:.1f}, max {compute_alone["max"] * 1e3:.1f}; '
              f'{work} matmuls); ms: median, min, max')
        print(report.text(
            ['mode', 'exchange ms', 'min', 'max', 'cpu/wall', 'machine cores', 'both ms', 'min',
             'max', 'hidden'],
            [[name, f'{wall["median"] * 1e3:.1f}', f'{wall["min"] * 1e3:.1f}', f'{wall["max"] * 1e3:.1f}',
              f'{share:.2f}', f'{machine:.2f}', f'{together["median"] * 1e3:.1f}',
              f'{together["min"] * 1e3:.1f}', f'{together["max"] * 1e3:.1f}', f'{hidden:.2f}']
             for name, wall, share, machine, together, hidden in rows],
            align=['left'] + ['right'] * 9))


if __name__ == '__main__':
    harness.run_main(main)
