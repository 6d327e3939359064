"""The steps of an elastic world's forming (world.py): the handshake that admits only the
job's workers, and calls that each have an end.

A process that connects to the root's port must answer a challenge with the job's secret
(:func:`challenge`, :func:`answer`); the launcher's stand-in for a worker that died answers
that it skips it.

A worker that dies while the world forms must leave no survivor waiting in MPI. The
collectives are nonblocking calls polled until they complete or ``failed()`` says why they
never will (a member the launcher announced lost, the deadline). Connect, Accept and Merge
exist only in blocking form: they run in a thread of their own, waited for the same way.
A step given up on raises HorovodInternalError, which ``elastic.run`` answers by re-forming
again; its request or thread is kept for the life of the process (comm/abandoned.py), with
the buffers MPI may still write into.

A connect or an accept pending in MPI blocks every other MPI call of its process (MPICH
holds its lock while it waits for the other side): the connect ends by MPI's own timeout
(:func:`connect`), and the root's accept is completed by the launcher's stand-in once the
worker it waited for gave up (:func:`give_up`, launch/driver.py). (MPICH's accept takes an
info 'timeout' too, but one that timed out left its receive posted on the port: a later
accept on that port hung, and the connect meant for it got no answer.)

A root never closes its ports (:func:`open_port`): MPICH names a port by its process's
address and a tag, the lowest one not open in that process, so a port opened after
``Close_port`` had the same name as the one closed, and a connect meant for an earlier forming
reached the new one's ``Accept``, which crashed.
"""
import logging
import os
import pickle
import threading
import time

import numpy as np

from ..comm import abandoned
from ..comm.mpiabi import MPI
from ..launch import rendezvous
from .exceptions import HorovodInternalError

__all__ = ['ADMIT', 'SKIP', 'REFUSED', 'challenge', 'answer', 'open_port', 'accept', 'connect',
           'wait', 'call', 'bcast', 'allgather_ints', 'newer_port', 'give_up', 'given_up']

log = logging.getLogger(__name__)

POLL = 0.0005          # seconds between Tests of a pending collective
HANDSHAKE_TIMEOUT = 10.0
ADMIT, SKIP, REFUSED = 'admit', 'skip', 'refused'   # the root's verdicts on a connection


def challenge(inter, admit, secret):
    """The root's side: ADMIT when the process behind ``inter`` holds the job's ``secret``
    and is worker ``admit``; SKIP when it is the launcher's stand-in for ``admit`` (which
    died); REFUSED otherwise."""
    nonce = os.urandom(16).hex()
    inter.send(nonce, dest=0)
    request = inter.irecv(source=0)
    ends = time.monotonic() + HANDSHAKE_TIMEOUT
    answered, reply = request.test()
    while not answered and time.monotonic() < ends:
        time.sleep(0.001)
        answered, reply = request.test()
    if not answered:
        request.Cancel()
        abandoned.keep(request)   # a cancelled receive is still MPI's until it completes
    reply = reply if answered and isinstance(reply, dict) else {}
    verdict = REFUSED
    if reply.get('id') == admit and rendezvous.verify(secret, reply.get('mac'), 'join', nonce,
                                                      admit):
        verdict = ADMIT
    elif reply.get('skip') == admit and rendezvous.verify(secret, reply.get('mac'), 'skip',
                                                          nonce, admit):
        verdict = SKIP
        log.warning("mpi_kvstore elastic: the launcher's stand-in answered for worker %d (it "
                    'died while the world waited for it, or gave up joining); the world '
                    'forms without it', admit)
    else:
        log.warning('mpi_kvstore elastic: refused a process that connected to the port '
                    'without the job\'s secret (%s)',
                    'no answer' if not answered else 'a wrong signature')
    inter.send(verdict == ADMIT, dest=0)
    return verdict


def answer(inter, worker, secret):
    """A connecting worker's side: whether the root admitted it."""
    nonce = inter.recv(source=0)
    inter.send({'id': worker, 'mac': rendezvous.sign(secret, 'join', nonce, worker)}, dest=0)
    return inter.recv(source=0)


_ports: list[str] = []   # this process's ports, kept open for its life (open_port)


def open_port():
    """A new MPI port, never closed, so that no two ports of this process share a name.

    MPICH 5.0.2 (ch4) names a port ``tag#T$connentry#<address>``: T is the lowest tag not
    open in this process, so after ``Close_port`` the next port had the same name. A connect
    sends its request to that address and tag at once, and it waits in the acceptor's queue
    until an ``Accept`` on the tag takes it: a connect that timed out, or one still waiting
    from a forming given up on, was taken by the next forming's ``Accept`` on the reused
    name. In a standalone test (three ``mpiexec -n 1`` launches) that ``Accept`` crashed
    (SIGSEGV) each time, whether the connecting process had given up, exited or still
    waited, and the newcomer's connect got no answer; with the first port kept open the
    second one's tag differed and the newcomer was admitted each time. No message of our own
    after the connect can tell the two apart: the crash comes first. MPICH allows 2048 open
    ports a process: one for each world this process forms as the root."""
    try:
        port = MPI.Open_port()
    except MPI.Exception as err:
        raise RuntimeError('mpi_kvstore elastic: this worker cannot open an MPI port for the '
                           'world it forms (%d open, none closed: see forming.open_port): %s'
                           % (len(_ports), err)) from err
    _ports.append(port)
    return port


def accept(world, port, admit, secret):
    """Every member's side of accepting worker ``admit``: (the intercommunicator, the root's
    verdict; None elsewhere). The root's challenge runs in the same call, so that an accept
    given up on (forming.call) still completes the handshake with whoever connects later
    (the launcher's stand-in): a process with an accept pending in MPI cannot open a port."""
    inter = world.Accept(port, root=0)
    return inter, challenge(inter, admit, secret) if world.Get_rank() == 0 else None


def connect(port, worker, secret, timeout):
    """A joining worker's side: connect (MPI's own connect ends after ``timeout`` s, so
    that no connect is left pending in MPI), answer the challenge, merge."""
    info = MPI.Info.Create()
    info.Set('timeout', str(max(1, int(timeout))))
    try:
        inter = MPI.COMM_SELF.Connect(port, info, root=0)
    finally:
        info.Free()
    if not answer(inter, worker, secret):
        raise RuntimeError('mpi_kvstore elastic: the world refused this worker')
    return inter.Merge(high=True)


def newer_port(directory, secret, generation, refused):
    """Why a worker joining through the port of ``generation`` gives up: the root published
    a newer one (it gave up on this forming), or None."""
    found = rendezvous.read_signed(rendezvous.current_port_path(directory), secret, refused)
    if found and isinstance(found.get('generation'), int) and found['generation'] > generation:
        return ('joining the world: the root published the port of generation %d (it gave up '
                'on %d)' % (found['generation'], generation))
    return None


def give_up(directory, secret, generation, worker, why):
    """Say that ``worker`` gave up on the forming of ``generation`` (rendezvous.gave_up)."""
    try:
        rendezvous.write_signed(rendezvous.gave_up_path(directory, generation, worker), secret,
                                {'generation': generation, 'worker': worker, 'why': str(why)})
    except OSError as err:
        log.warning('mpi_kvstore elastic: could not say that worker %d gave up on the '
                    'forming of generation %d: %s', worker, generation, err)


def given_up(directory, secret, generation, refused):
    """The workers whose signed word says they gave up on the forming of ``generation``."""
    found = []
    for worker in rendezvous.gave_up(directory, generation):
        said = rendezvous.read_signed(rendezvous.gave_up_path(directory, generation, worker),
                                      secret, refused)
        if said and said.get('generation') == generation and said.get('worker') == worker:
            found.append(worker)
    return found


def wait(request, failed, keep=()):
    """Poll ``request`` until it completes; HorovodInternalError once ``failed()`` returns a
    reason (``request`` and ``keep`` kept: MPI may still write into them)."""
    while not request.Test():
        why = failed()
        if why:
            abandoned.keep(request, *keep)
            raise HorovodInternalError(why)
        time.sleep(POLL)


def call(fn, what, failed, keep=(), stale=None, every=0.01):
    """``fn()``, a blocking MPI call, in a thread of its own: its value, or
    HorovodInternalError once ``failed()`` or ``stale()`` (every ``every`` s) returns a
    reason, the thread and ``keep`` kept, or when ``fn`` raised (``what`` failed: ...).
    Without MPI_THREAD_MULTIPLE the call is made here, unbounded."""
    if MPI.Query_thread() != MPI.THREAD_MULTIPLE:
        return fn()
    box = {}

    def target():
        try:
            box['value'] = fn()
        except BaseException as err:   # handed to the waiting thread
            box['error'] = err
    thread = threading.Thread(target=target, name='mpi_kvstore-forming', daemon=True)
    thread.start()
    look = 0.0
    while True:
        thread.join(POLL)
        if not thread.is_alive():
            break
        why = failed()
        if not why and stale is not None and time.monotonic() > look:
            look = time.monotonic() + every
            why = stale()
        if why:
            abandoned.keep(thread, box, *keep)   # still inside MPI
            raise HorovodInternalError(why)
    if 'error' in box:
        raise HorovodInternalError('%s failed: %s' % (what, box['error'])) from box['error']
    return box['value']


def bcast(comm, obj, failed):
    """Rank 0's picklable ``obj`` on every rank of ``comm`` (its length, then its bytes)."""
    root = comm.Get_rank() == 0
    data = pickle.dumps(obj, protocol=4) if root else b''
    length = np.array([len(data)], dtype=np.int64)
    wait(comm.Ibcast(length, root=0), failed, keep=(length,))
    buffer = np.frombuffer(data, dtype=np.uint8).copy() if root else \
        np.empty(int(length[0]), dtype=np.uint8)
    wait(comm.Ibcast(buffer, root=0), failed, keep=(buffer,))
    return obj if root else pickle.loads(buffer.tobytes())


def allgather_ints(comm, value, failed):
    """Every rank's int ``value``, in rank order."""
    out = np.empty(comm.Get_size(), dtype=np.int64)
    wait(comm.Iallgather(np.array([value], dtype=np.int64), out), failed, keep=(out,))
    return [int(v) for v in out]
