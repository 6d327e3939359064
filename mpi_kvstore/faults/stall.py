"""When a collective stalls, name it, and which ranks have and have not pushed it.

- A collective pending on a rank for ``stall_warning`` seconds is logged (logging.warning)
  with how long it has waited and which ranks have and have not pushed it. The warning
  repeats every ``stall_warning`` seconds while the stall lasts; after ``stall_abort``
  seconds (when set) the job is aborted with the same report (abort.abort_job).
- At every look the inspector leaves what it saw as the rank's last words
  (:func:`last_look`), for a fatal signal's handler (last_words.py).

How ranks learn about each other: one daemon thread per store, the inspector, wakes every
0.1-1 s, copies the store's list of pending requests and remembers when it first saw each.
That is sampling: nothing is timed per collective and nothing runs on the user's thread.
The inspector owns a duplicate of the store's communicator. On it, it answers every query
that arrives with its rank's count of collectives pushed and its pending list, and, when a
local collective passes the threshold, it asks every other rank and waits a bounded time
for the answers (and once, quietly, after PROBE_AFTER s: see _probe). Rank r has pushed
collective s iff its count exceeds s, because every rank numbers collectives in call order.

MPI thread level: the inspector calls MPI (improbe, recv, isend on its own communicator)
while the store's threads call it too, which needs MPI_THREAD_MULTIPLE (mpi4py's default).
With less, it reports only what its own rank knows, says why, and still aborts after
``stall_abort`` (MPI_Abort is the one call that may interrupt the others).
"""
import itertools
import logging
import threading
import time

from ..comm.mpiabi import MPI, provided_thread_level, thread_level_name
from ..launch import supervision
from . import last_words
from .abort import abort_job, rank_list

__all__ = ['StallInspector', 'PendingAges', 'format_report', 'who_pushed', 'last_look',
           'inspection_period', 'PROBE_AFTER']

log = logging.getLogger(__name__)

QUERY, REPLY = 1, 2    # message tags on the inspector's own communicator
# A live inspector answers within its period (at most 1 s); one that has not answered in
# 3 s is not coming (its rank finished), and a report must not wait on it.
REPLY_TIMEOUT = 3.0
REPLY_POLL = 0.01      # seconds between probes while answers are due
STOP_TIMEOUT = 10.0    # seconds close() waits for the thread; it never blocks in MPI
# The lowest sequence numbers tell the story; a long list would bury it (and answers
# stay small enough for MPI's eager protocol).
MAX_LISTED = 8
# Seconds a collective waits before the inspector asks the other ranks, quietly (_probe).
PROBE_AFTER = 5.0


# A rank answers from its inspector thread even while its user code is blocked elsewhere,
# so silence means it is gone or cannot run Python at all.
NO_ANSWER = ('no answer from %s (finished or closed its store, '
             'or hung where its inspector cannot run)')
NOT_ASKED = 'not asked: %s'


def who_pushed(seq, size, states, unknown=NO_ANSWER):
    """Which ranks have and have not pushed collective SEQ, from STATES {rank: (pushed, ...)}."""
    pushed = [r for r in sorted(states) if states[r][0] > seq]
    missing = [r for r in sorted(states) if states[r][0] <= seq]
    silent = [r for r in range(size) if r not in states]
    parts = [('pushed by %s', pushed), ('not pushed by %s', missing), (unknown, silent)]
    return '; '.join(form % rank_list(ranks) for form, ranks in parts if ranks)


def _rank_state(rank, state):
    pushed, pending = state
    waits = ('waits on %s for %.1f s' % (pending[0][1], pending[0][2]) if pending
             else 'waits on none')
    return 'rank %d has pushed %d collectives and %s' % (rank, pushed, waits)


def _others(rank, seq, states):
    """The other ranks that answered, those that have not pushed SEQ first."""
    return sorted((r for r in states if r != rank), key=lambda r: (states[r][0] > seq, r))


def format_report(heading, rank, size, stalled, states, note=''):
    """The stall report of RANK.

    STALLED is [(seq, description, seconds waited)] of this rank's stalled collectives in
    sequence order; STATES maps every rank that answered (this one included) to
    (collectives pushed, [(seq, description, seconds waited)] of its pending ones).
    """
    unknown = NOT_ASKED if note else NO_ANSWER
    lines = [heading]
    for seq, what, age in stalled[:MAX_LISTED]:
        lines.append('  %s: waiting %.1f s; %s' % (what, age, who_pushed(seq, size, states,
                                                                          unknown)))
    if len(stalled) > MAX_LISTED:
        lines.append('  ... and %d more' % (len(stalled) - MAX_LISTED))
    others = _others(rank, stalled[0][0], states)
    lines.extend('  ' + _rank_state(r, states[r]) for r in others[:MAX_LISTED])
    if len(others) > MAX_LISTED:
        lines.append('  ... and %d more ranks' % (len(others) - MAX_LISTED))
    if note:
        lines.append('  ' + note)
    return '\n'.join(lines)


def last_look(period, pushed, newest, oldest, waiting, silent):
    """The stall inspector's last look, in words, for a fatal signal's handler: how many
    collectives this rank had pushed, the NEWEST it saw (a description, or ''), the OLDEST
    of the WAITING ones (description, seconds), and the ranks SILENT at its last query."""
    words = ('at the stall inspector\'s last look (every %g s) this rank had pushed %d '
             'collectives' % (period, pushed))
    if newest:
        words += ', the newest it saw %s' % newest
    if waiting:
        words += '; it waited on %s for %.1f s' % oldest
        if waiting > 1:
            words += ' (and %d more)' % (waiting - 1)
    else:
        words += '; it waited on none'
    if silent:
        words += '; %s did not answer its last stall query' % rank_list(silent)
    return words


def inspection_period(warn, abort):
    """Seconds between looks: about 1/8 of the shortest threshold, from 0.1 to 1 s."""
    threshold = min(t for t in (warn, abort) if t > 0)
    return min(1.0, max(0.1, threshold / 8.0))


def local_only_reason():
    """Why the inspector cannot ask other ranks, or '' when it can."""
    provided = provided_thread_level()
    if provided >= MPI.THREAD_MULTIPLE:
        return ''
    return ('other ranks were not asked: the stall inspector talks to them from its own '
            'thread, which needs MPI_THREAD_MULTIPLE, and MPI provides %s'
            % thread_level_name(provided))


# -- the inspector -------------------------------------------------------------------------

class PendingAges:
    """When each pending collective was first seen: sampled, so nothing is timed per call."""

    def __init__(self):
        self._first_seen = {}
        self._requests = []

    def update(self, requests, now):
        """Take a snapshot of the store's pending requests, seen at NOW."""
        # seq is -1 between the store listing a collective and its design numbering it.
        self._requests = sorted((r for r in requests if r.seq >= 0 and not r.done),
                                key=lambda r: r.seq)
        seen = self._first_seen
        self._first_seen = {r.seq: seen.get(r.seq, now) for r in self._requests}

    def ages(self, now):
        """[(request, seconds pending)] in sequence order, of those still not done."""
        return [(r, now - self._first_seen[r.seq]) for r in self._requests if not r.done]


class StallInspector:
    """Watches one store's pending collectives from a daemon thread; see the module docstring.

    ``pending()`` returns a list of the store's requests not yet known to be done;
    ``design.pushed`` counts the collectives numbered so far.
    """

    def __init__(self, comm, config, design, pending):
        self._warn, self._abort = config.stall_warning, config.stall_abort
        self._design, self._pending = design, pending
        self._rank, self._size = comm.Get_rank(), comm.Get_size()
        self._ages = PendingAges()
        self._stop = threading.Event()
        self._replies = {}  # query id -> {rank: state}
        self._query_ids = itertools.count()
        self._sends = []
        self._silent = set()  # ranks that did not answer the last query
        self._said = ''       # the last words left for a fatal signal (_say)
        self._newest = ''     # the newest collective it saw, pending or done
        self._probed = False  # whether the current stall was probed (_probe)
        self._next_warning = 0.0
        self._thread = self._comm = None
        self._why_local = ''
        # One rank cannot stall on others; both knobs at 0 switch inspection off.
        if self._size > 1 and (self._warn > 0 or self._abort > 0):
            self._start(comm)

    def _start(self, comm):
        self._period = inspection_period(self._warn, self._abort)
        self._threshold = min(t for t in (self._warn, self._abort) if t > 0)
        self._why_local = local_only_reason()
        if not self._why_local:
            # Collective; every rank decides the same, from the same config and thread level.
            self._comm = comm.Dup()
        self._thread = threading.Thread(target=self._run, name='mpi_kvstore-inspector',
                                        daemon=True)
        self._thread.start()

    def stop(self):
        """End the thread and free its communicator, before MPI finalizes (idempotent)."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        thread.join(timeout=STOP_TIMEOUT)
        if thread.is_alive():
            log.warning('mpi_kvstore: the stall inspector did not stop within %g s; '
                        'its communicator is left allocated', STOP_TIMEOUT)
            return
        if self._comm is not None and not MPI.Is_finalized():
            self._comm.Free()  # answers still in flight complete on their own (eager sends)
        self._comm = None

    # -- the thread ----------------------------------------------------------------
    def _run(self):
        try:
            while not self._stop.wait(self._period):
                self._serve()
                self._inspect()
        except Exception:  # a diagnostic must never take training down with it
            log.exception('mpi_kvstore: the stall inspector failed and stopped')

    def _inspect(self):
        try:
            snapshot = self._pending()
        except RuntimeError:  # the deque changed while being copied: look again next time
            return
        now = time.monotonic()
        self._ages.update(snapshot, now)
        self._say(snapshot, now)
        ages = self._ages.ages(now)
        self._probe(max((age for _, age in ages), default=0.0))
        stalled = [(r, age) for r, age in ages if age >= self._threshold]
        if not stalled:
            self._next_warning = 0.0
            return
        longest = max(age for _, age in stalled)
        if self._abort and longest >= self._abort:
            states = self._gather()
            oldest = min(r.seq for r, _ in stalled)
            supervision.record(self._rank, supervision.STALL, True, 'stall_abort',
                               lost=[r for r in range(self._size)
                                     if r not in states or states[r][0] <= oldest])
            abort_job(self._report(stalled, self._heading('aborting the job: ', self._abort,
                                                           'stall_abort'), states))
        elif self._warn and longest >= self._warn and now >= self._next_warning:
            log.warning(self._report(stalled, self._heading('', self._warn, 'stall_warning')))
            self._next_warning = now + self._warn

    def _probe(self, longest):
        """Ask the other ranks once, quietly, when a collective has waited PROBE_AFTER s.
        After a cut link, UCX's TCP keepalive fails a connection with nothing in flight,
        and MPICH then dies of SIGSEGV in the next send over it: the stall query at 60 s,
        in 2 cuts of 8 on the test bed. A query sent early is in flight by then, and keeps
        TCP retransmitting instead."""
        if longest < PROBE_AFTER:
            self._probed = False
        elif not self._probed and longest < self._threshold:
            self._probed = True
            self._gather()

    def _say(self, snapshot, now):
        """Leave what this look saw where a fatal signal's handler finds it (last_words)."""
        numbered = [r for r in snapshot if r.seq >= 0]
        if numbered:
            self._newest = max(numbered, key=lambda r: r.seq).describe()
        ages = self._ages.ages(now)
        oldest = (ages[0][0].describe(), ages[0][1]) if ages else None
        words = last_look(self._period, self._design.pushed, self._newest, oldest, len(ages),
                          sorted(self._silent))
        if words != self._said:
            last_words.say(words)
            self._said = words

    def _heading(self, action, limit, knob):
        return ('mpi_kvstore: rank %d of %d: stall: %scollectives pending for more than '
                '%s=%g s (MPI_KVSTORE_%s):'
                % (self._rank, self._size, action, knob, limit, knob.upper()))

    def _report(self, stalled, heading, states=None):
        entries = [(r.seq, r.describe(), age) for r, age in stalled]
        return format_report(heading, self._rank, self._size, entries,
                             self._gather() if states is None else states, self._why_local)

    def _state(self):
        """(collectives pushed, [(seq, description, seconds pending)]) of this rank."""
        ages = self._ages.ages(time.monotonic())[:MAX_LISTED]
        return self._design.pushed, [(r.seq, r.describe(), age) for r, age in ages]

    # -- talking to the other ranks' inspectors ---------------------------------------
    def _gather(self):
        """{rank: state} of this rank and of every rank that answers in time."""
        states = {self._rank: self._state()}
        if self._comm is None:
            return states
        # A send to a rank behind a cut link once died inside MPI (SIGSEGV in this isend,
        # 60 s after the cut): the last words must say what the rank was doing.
        last_words.say(self._said + '; then it asked the other ranks about its stall')
        query = next(self._query_ids)
        self._replies[query] = states
        for dest in range(self._size):
            if dest != self._rank:
                self._sends.append(self._comm.isend(query, dest=dest, tag=QUERY))
        # Ranks silent last time (and not heard from since, _handle) are asked again but
        # not waited for: they have most likely finished, and waiting for them would delay
        # every report (and the abort).
        awaited = set(range(self._size)) - self._silent
        deadline = time.monotonic() + REPLY_TIMEOUT
        while not awaited <= states.keys() and time.monotonic() < deadline:
            if self._stop.wait(REPLY_POLL):
                break
            self._serve()  # answers others meanwhile: two stalled ranks may ask each other
        self._replies.pop(query)
        self._silent = set(range(self._size)) - states.keys()
        return states

    def _serve(self):
        """Answer the queries and file the replies that have arrived; never blocks."""
        if self._comm is None:
            return
        while True:
            status = MPI.Status()
            message = self._comm.improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, status)
            if message is None:
                break
            self._handle(status.Get_source(), status.Get_tag(), message.recv())
        self._sends = [req for req in self._sends if not req.Test()]

    def _handle(self, source, tag, payload):
        if tag == QUERY:
            self._sends.append(self._comm.isend((payload, self._state()), dest=source,
                                                tag=REPLY))
            return
        query, state = payload
        if query in self._replies:
            self._replies[query][source] = state
        else:
            # An answer that came after its query stopped waiting: the rank was busy, not
            # gone, and the next query must wait for it again. Left silent, it would never
            # answer in time (silent ranks are not waited for) and every later report would
            # say it gave no answer.
            self._silent.discard(source)
