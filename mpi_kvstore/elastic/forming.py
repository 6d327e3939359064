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

__all__ = ['ADMIT', 'SKIP', 'REFUSED', 'challenge', 'answer', 'wait', 'call', 'bcast',
           'allgather_ints']

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
        log.warning('mpi_kvstore elastic: worker %d died while the world waited for it '
                    "(the launcher's stand-in says so); the world forms without it", admit)
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
