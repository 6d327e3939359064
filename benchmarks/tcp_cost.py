"""The CPU that TCP itself costs: plain sockets moving N bytes each way between two ranks,
against MPI's allreduce of the same bytes, with the busy time of the whole machine.

    python -m testbed run --hosts 2 --rate 3gbit -n 2 -- python -m benchmarks.tcp_cost [--size 42M]

On the test bed both hosts are network namespaces of one machine, so /proc/stat counts what
both ranks and the kernel's network work cost together. Per mode, over --trials interleaved
rounds: wall time and the machine's busy core-ms, median, min and max. Modes: sockets (each
rank sends and receives --size bytes over one TCP connection: the least a 2-rank allreduce
must move, with no polling), sockets+sum (plus the float32 sum of what arrived), mpi
(Allreduce(IN_PLACE), which MPICH busy-polls) and mpi polled (MPI_Iallreduce waited for as
the store waits with progress_sleep_us=200).
"""
import socket
import subprocess
import threading
import time

import numpy as np
from mpi4py import MPI

from benchmarks import harness, report
from mpi_kvstore.comm.progress import PROGRESS_TESTS, wait_polling  # the store's own wait

COMM = MPI.COMM_WORLD


def parse_args(argv=None):
    parser = harness.parser(__doc__)
    parser.add_argument('--size', type=harness.parse_size, default=42 << 20)
    parser.add_argument('--trials', type=int, default=5)
    return parser.parse_args(argv)


def global_addresses():
    """This host's global IPv4 addresses (the test hosts' own)."""
    out = subprocess.run(['ip', '-4', '-o', 'addr', 'show', 'scope', 'global'],
                         capture_output=True, text=True, check=False).stdout
    return [line.split()[3].split('/')[0] for line in out.splitlines()]


def connect():
    """One TCP connection between rank 0 and rank 1."""
    mine = global_addresses()
    theirs = COMM.bcast(mine if COMM.rank == 0 else None, root=0)
    if COMM.rank == 0:
        server = socket.socket()
        server.bind(('0.0.0.0', 0))
        server.listen(1)
        COMM.bcast(server.getsockname()[1], root=0)
        conn, _ = server.accept()
        server.close()
    else:
        port = COMM.bcast(None, root=0)
        conn = socket.create_connection((theirs[0], port), timeout=30)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def sockets(conn, send, recv, add):
    def transmit():
        conn.sendall(memoryview(send))
    sender = threading.Thread(target=transmit)
    sender.start()
    view, got = memoryview(recv), 0
    while got < recv.nbytes:
        got += conn.recv_into(view[got:])
    sender.join()
    if add:
        np.add(recv.view(np.float32), send.view(np.float32), out=recv.view(np.float32))


def once(fn):
    """(wall seconds, machine busy core-seconds) of one fn(), between barriers; the wall the
    same on both ranks (the slowest)."""
    COMM.Barrier()
    start_busy, start = harness.machine_busy(), time.perf_counter()
    fn()
    COMM.Barrier()
    wall = COMM.allreduce(time.perf_counter() - start, op=MPI.MAX)
    return wall, harness.machine_busy() - start_busy


def measure(modes, trials):
    """{name: ([walls], [busy])} of {name: fn}: one untimed run of each, then `trials` rounds,
    every mode once a round in harness.rotation's order."""
    for fn in modes.values():
        fn()
    kept = harness.interleaved(modes, trials, time_one=lambda name, fn: once(fn))
    return {name: ([w for w, _ in runs], [b for _, b in runs]) for name, runs in kept.items()}


def main():
    args = parse_args()
    if COMM.size != 2:
        raise SystemExit('tcp_cost.py runs on exactly 2 ranks (one per test host)')
    if not harness.one_machine(COMM):
        harness.rank0_print('note: the ranks run on different machines; machine core-ms counts '
                            "rank 0's machine only")
    count = args.size // 4 * 4
    send = np.ones(count, np.uint8)
    recv = np.empty(count, np.uint8)
    buf = np.ones(count // 4, np.float32)
    conn = connect()
    modes = [('sockets', lambda: sockets(conn, send, recv, False)),
             ('sockets+sum', lambda: sockets(conn, send, recv, True)),
             ('mpi', lambda: COMM.Allreduce(MPI.IN_PLACE, buf)),
             ('mpi polled', lambda: wait_polling(COMM.Iallreduce(MPI.IN_PLACE, buf), 200,
                                                 PROGRESS_TESTS))]
    timed = measure(dict(modes), args.trials)
    conn.close()
    harness.rank0_print(f'{harness.format_size(count)} each way between 2 ranks, {args.trials} '
                        'interleaved rounds: median, min and max of wall ms and of the machine\'s '
                        'busy core-ms; machine cores = median core-ms / median wall ms')
    rows = []
    for name, (walls, busy) in timed.items():
        w, b = harness.spread(walls), harness.spread(busy)
        rows.append([name, *(f'{w[k] * 1e3:.1f}' for k in ('median', 'min', 'max')),
                     *(f'{b[k] * 1e3:.0f}' for k in ('median', 'min', 'max')),
                     f'{b["median"] / w["median"]:.2f}'])
    harness.rank0_print(report.text(['mode', 'wall ms', 'min', 'max', 'core-ms', 'min', 'max',
                                     'machine cores'], rows, align=['left'] + ['right'] * 7))


if __name__ == '__main__':
    harness.run_main(main)
