"""What the benchmarks compare mpi_kvstore with, each as it is normally run:

- raw MPI through mpi4py (raw_allreduce_op): the ceiling for any store on MPI;
- MXNet's engine alone (engine_floor_op): one engine round trip, no MPI, which any
  collective embedded in the engine also pays;
- MXNet's own parameter-server store, dist_sync, with its ps-lite scheduler and server run
  by rank 0 (PsLite, DistSync): on 127.0.0.1 when every rank is on one host, else on rank
  0's host address (pslite_addresses); and its P3 variant (DMLC_PS_VAN_TYPE=p3: ps-lite's
  P3 van, which slices keys and sends them by priority);
- Horovod (horovod), when horovod.mxnet imports.
"""
import atexit
import contextlib
import gc
import os
import socket
import subprocess
import sys
import tempfile
import time
import weakref

import mxnet as mx
import numpy as np
from mpi4py import MPI

from benchmarks import harness

COMM = MPI.COMM_WORLD


def add_args(parser):
    """The options that choose the ps-lite baseline."""
    parser.add_argument('--no-dist-sync', action='store_true', help="skip MXNet's ps-lite baseline")
    parser.add_argument('--p3', action='store_true',
                        help="run MXNet's ps-lite baseline with its P3 van (DMLC_PS_VAN_TYPE=p3), "
                             "reported as dist_sync:p3; ps-lite allows one store per process, so "
                             'one run has either it or dist_sync')
    return parser


# ---------------------------------------------------------------- raw MPI and the engine

def raw_allreduce_op(nbytes, count=1, in_place=True, comm=COMM):
    """`count` Allreduces of nbytes each on numpy float32 buffers (count > 1: unfused keys).
    in_place: Allreduce(IN_PLACE, buf), no send-to-receive copy, as a store that sums in
    place can do, so the fair ceiling for one (about 1.4x faster than two buffers at 16 MB
    here); else Allreduce(send, recv)."""
    if in_place:
        return harness.summed_op(lambda buf: comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM),
                                 nbytes, comm.size, 'raw MPI Allreduce(IN_PLACE)', count)
    sends = [np.ones(nbytes // 4, np.float32) for _ in range(count)]
    recvs = [np.empty_like(buf) for buf in sends]

    def op():
        for send, recv in zip(sends, recvs):
            comm.Allreduce(send, recv, op=MPI.SUM)
    op()
    harness.check_sum(recvs[-1], comm.size, 'raw MPI Allreduce')
    return op


def engine_floor_op(nbytes, count=1):
    """`count` MXNet engine hand-offs (one per key), then wait for all: no MPI at all.

    Each is one op writing one element of the key's array in place (slice_assign_scalar;
    arr[0:1] = 0 adds ~40 us of index parsing), so it costs the engine's hand-off whatever
    nbytes, not memcpy. Checked once: element 0 of an array of ones is 0 after."""
    targets = [mx.nd.ones((nbytes // 4,), dtype='float32') for _ in range(count)]

    def op():
        for target in targets:
            target.slice_assign_scalar(0.0, (0,), (1,), (1,))
        for target in targets:
            target.wait_to_read()
    op()
    head = targets[-1][:2].asnumpy().tolist()     # element 0 written, element 1 not
    if head != [0.0, 1.0][:len(head)]:
        raise RuntimeError(f'engine hand-off: got {head} from an array of ones, expected [0, 1]')
    return op


# ---------------------------------------------------------------- Horovod

def horovod(comm=COMM):
    """Collective: (horovod.mxnet, initialised, None) on every rank, or (None, why)."""
    try:
        import horovod.mxnet as hvd
        hvd.init()
        why = None
    except Exception as exc:
        hvd, why = None, f'horovod.mxnet does not import ({type(exc).__name__}: {exc})'
    why = harness.agree(why, comm)
    return (None, why) if why else (hvd, None)


# ---------------------------------------------------------------- ps-lite for dist_sync

# Run in each ps-lite child. The kernel kills it if its parent (rank 0) dies and an alarm
# bounds its life, so no server outlives a killed job. `import mxnet` does the rest: with
# DMLC_ROLE=server or scheduler, mxnet/kvstore/kvstore_server.py creates a 'dist' store,
# serves until the workers shut it down, then calls sys.exit().
_BOOTSTRAP = (
    'import ctypes, os, signal, sys\n'
    'ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG\n'
    'if os.getppid() != int(sys.argv[1]): sys.exit(3)  # parent already gone\n'
    'signal.alarm(int(sys.argv[2]))\n'
    'import mxnet\n'
    'sys.exit(4)  # reached only if mxnet did not start serving\n'
)


def free_port(host='127.0.0.1'):
    """A TCP port on `host` nobody listens on now (the small race is acceptable here)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def pslite_addresses(comm):
    """Collective: (root, own, error): the address ps-lite's scheduler and servers listen on
    (rank 0's host), the one this rank's worker announces, or why there is none.

    ps-lite reaches each process at its DMLC_NODE_HOST (else an interface it guesses). One
    host: 127.0.0.1 for both. Across hosts: rank 0's host name resolved, and on each rank the
    source address the kernel picks to reach it (a connected UDP socket sends nothing)."""
    hosts = comm.allgather(MPI.Get_processor_name())
    if len(set(hosts)) == 1:
        return '127.0.0.1', '127.0.0.1', None
    root, error = None, None
    if comm.rank == 0:
        try:
            root = socket.gethostbyname(hosts[0])
            if root.startswith('127.'):
                error = (f'rank 0\'s host name {hosts[0]!r} resolves to {root}, which other '
                         'hosts cannot reach')
        except OSError as exc:
            error = f'cannot resolve rank 0\'s host name {hosts[0]!r}: {exc}'
    root, error = comm.bcast((root, error), root=0)
    if error:
        return None, None, error
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((root, 9))
        return root, sock.getsockname()[0], None


class PsLite:
    """The ps-lite scheduler and servers behind MXNet's dist_sync store, run as subprocesses
    of rank 0 on the root address of pslite_addresses, with every rank of `comm` as a worker.
    van='p3' runs every process of it with ps-lite's P3 van (MXNet then creates its P3 store
    for dist_sync).

        pslite = PsLite(comm)
        error = pslite.start()       # collective; None on success, else why not
        kv = mx.kv.create('dist_sync')
        ...
        del kv; gc.collect()         # collective: the workers' destructor stops the servers
        pslite.stop()                # collective

    ps-lite keeps one worker per process for the life of the process: start it once.
    """

    def __init__(self, comm, num_servers=1, start_timeout=60.0, lifetime=3600, van=None):
        self.comm, self.num_servers, self.van = comm, num_servers, van
        self.start_timeout, self.lifetime = start_timeout, int(lifetime)
        self.procs, self.log = [], None
        self.root = self.own = '127.0.0.1'
        self._saved_env = {}

    def _env(self, port, role):
        env = {'DMLC_ROLE': role, 'DMLC_PS_ROOT_URI': self.root, 'DMLC_PS_ROOT_PORT': str(port),
               'DMLC_NUM_WORKER': str(self.comm.size), 'DMLC_NUM_SERVER': str(self.num_servers),
               # without it ps-lite looks for a non-loopback interface and aborts where none is
               'DMLC_NODE_HOST': self.own}
        if self.van:
            env['DMLC_PS_VAN_TYPE'] = self.van
        return env

    def _spawn(self, port, role):
        # The children must not look like MPI processes to the launcher's PMI.
        env = {k: v for k, v in os.environ.items() if not k.startswith(('PMI_', 'HYDRA_', 'MPI_LOCALRANK'))}
        env.update(self._env(port, role), OMP_NUM_THREADS='1')
        argv = [sys.executable, '-c', _BOOTSTRAP, str(os.getpid()), str(self.lifetime)]
        return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=self.log,
                                stderr=subprocess.STDOUT)

    def _wait_listening(self, port):
        """None once the scheduler accepts connections, else why not."""
        give_up = time.monotonic() + self.start_timeout
        while time.monotonic() < give_up:
            dead = [p for p in self.procs if p.poll() is not None]
            if dead:
                return f'a ps-lite process exited with code {dead[0].returncode}: {self.log_tail()}'
            with contextlib.suppress(OSError), socket.create_connection((self.root, port), 1):
                return None
            time.sleep(0.2)
        return f'the ps-lite scheduler did not listen within {self.start_timeout:.0f} s: {self.log_tail()}'

    def _start_root(self):
        """Rank 0: start the processes; return (port, error)."""
        try:
            # open while the servers write to it; deleted when this object goes
            self.log = tempfile.NamedTemporaryFile('w+', prefix='pslite-', suffix='.log')
            port = free_port(self.root)
            self.procs = [self._spawn(port, 'scheduler')]
            self.procs += [self._spawn(port, 'server') for _ in range(self.num_servers)]
            atexit.register(self.kill)
            error = self._wait_listening(port)
        except Exception as exc:
            port, error = None, f'{type(exc).__name__}: {exc}'
        if error:
            self.kill()
        return port, error

    def start(self):
        """Collective. Start the servers, point this process's ps-lite at them (environment
        read when the store is created); return None, or a message why it could not."""
        self.root, self.own, error = pslite_addresses(self.comm)
        if error:
            return error
        port, error = self._start_root() if self.comm.rank == 0 else (None, None)
        port, error = self.comm.bcast((port, error), root=0)
        if error is None:
            for key, value in self._env(port, 'worker').items():
                self._saved_env[key] = os.environ.get(key)
                os.environ[key] = value
        return error

    def stop(self, timeout=30.0):
        """Collective. Wait for the servers to leave (the workers' store destructor tells them
        to), kill them if they do not, restore the environment."""
        self.comm.Barrier()
        give_up = time.monotonic() + timeout
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.1, give_up - time.monotonic()))
        self.kill()
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    def kill(self):
        """Idempotent, never raises: also runs at exit and from a deadline."""
        for proc in self.procs:
            with contextlib.suppress(Exception):
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(5)
        self.procs = []

    def log_tail(self, chars=2000):
        if self.log is None:
            return ''
        with contextlib.suppress(Exception):
            self.log.flush()
            with open(self.log.name) as handle:
                return handle.read()[-chars:].strip()
        return ''


class DistSync:
    """MXNet's dist_sync store behind its ps-lite processes, for one run of a script.

        dist_sync = DistSync(run, lifetime)   # run: harness.Run, its args from add_args()
        why = dist_sync.start()               # collective; None, or why there is no baseline
        ... dist_sync.kv, reported as dist_sync.name ...
        dist_sync.stop()                      # collective; always stops ps-lite

    ps-lite starts once per process: one DistSync per run. `lifetime` (s) is the servers' own
    alarm, a safety net should the script die without stopping them. With --p3 every
    ps-lite process uses the P3 van and the method is named dist_sync:p3.
    """

    def __init__(self, run, lifetime):
        self.run, self.lifetime, self.kv, self.pslite = run, lifetime, None, None
        self.van = 'p3' if getattr(run.args, 'p3', False) else None
        self.name = 'dist_sync' + (f':{self.van}' if self.van else '')

    def start(self):
        if self.run.args.no_dist_sync:
            return '--no-dist-sync'
        self.pslite = PsLite(MPI.COMM_WORLD, lifetime=self.lifetime, van=self.van)
        error = self.pslite.start()
        if error:
            return f'ps-lite did not start: {error}'
        self.run.on_expire = self.pslite.kill
        # On one host the handshake takes about a second; minutes mean it will never finish.
        with harness.deadline(min(self.run.args.timeout, 120), f'creating the {self.name} store',
                              self.pslite.kill):
            self.kv = mx.kv.create('dist_sync')
        return None

    def stop(self):
        """The store's destructor tells the servers to leave; a store still referenced
        would instead hang at exit, talking to servers that were killed."""
        if self.kv is None:
            return
        with harness.deadline(self.run.args.timeout, f'shutting down {self.name}', self.pslite.kill):
            mx.nd.waitall()
            MPI.COMM_WORLD.Barrier()
            alive = weakref.ref(self.kv)
            self.kv = None
            gc.collect()
            if alive() is not None:
                raise RuntimeError('the dist_sync store is still referenced: cannot stop ps-lite')
            self.pslite.stop()
        self.run.on_expire = None
