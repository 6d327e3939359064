"""Online tuning of the schedule while a job trains (the option ``autotune``).

The negotiated designs (funneled, concurrent) search ``partition_bytes``, ``credit_bytes``,
``fusion_threshold`` and ``progress_sleep_us`` on the job itself, as Horovod's autotune
searches its fusion threshold and cycle time, and ByteScheduler its credit:

- The signal is the step: the time between two moments the first key this rank ever
  reduced (a gradient's allreduce or reduce-scatter) turns ready, that is, its gradient
  has been computed, as the negotiation thread sees it. It counts compute and the waits for
  the exchange alike, which is what the knobs trade: the next step's gradient waits for
  this step's update, which waits for the exchange. Not the pushes: a training loop with no
  wait between steps pushes several steps' calls within milliseconds, ahead of the engine
  (GPU-like ResNet-50, 3 steps a wait: 2-3 ms between pushes of a step of 430 ms), and the
  search then compared the Python thread's pace. A sample is
  the median of ``autotune_steps`` steps; the first steps of the job (graph building,
  compilation) and the step that spans a switch are left out, as Horovod's warm-up samples.
- Agreement: every :data:`CHECK_EVERY` negotiation rounds (the rounds are collectives, so
  every rank counts the same), one MAX-allreduce of (this rank's median, minus its number
  of steps) gives every rank the slowest rank's step and the fewest steps any rank has
  measured. Once every rank has a full sample, rank 0 feeds the MAX to the search and
  broadcasts what runs next; every rank applies it before its next round, the same round
  everywhere, so no rank runs a new cut, credit, bucket or wait (a blocking MPI call never
  matches a non-blocking one) while another still runs the old.
- The search (:class:`CoordinateSearch`) measures the start, then FIFO as one setting
  (:data:`JOINT`), then each free knob over its grid (:data:`GRID`) with the others at
  their best so far. A group's fastest value (FIFO's, or a knob's), if faster than the
  best at all, is measured again right after the values in use, and kept only if it wins
  that pair by half of :data:`MARGIN` and the two pairs together by the margin. One
  10-step sample on a loaded machine is noisy enough to pass the margin by chance, or to
  miss a real lead of a few percent; a pair taken back to back also cancels a slow drift
  of the machine's speed. It settles after at most :func:`samples` samples, that is
  within :func:`settle_bound` steps, logs its choice once (rank 0), and writes it into the
  tune table's ``schedule`` (tuning.Table), where the next run of the same topology starts.
- A value the user set (argument or environment variable) is never searched: only values
  whose origin is the default, 'auto' or the tune table are free.

Why no optimisation library: scikit-optimize (Horovod's choice is its own Gaussian process)
does not install beside numpy<1.24 (it needs a scikit-learn that needs a numpy MXNet 1.9.1
cannot use) and is no longer maintained. The space is also small (four knobs, three or four
values each: 10 samples for a whole pass from values on the grid, 11 with FIFO), and every
sample costs ten training steps, so a model of the surface would save few samples; a
deterministic coordinate search costs one pass and decides the same on every machine given
the same timings. One pass can miss where knobs interact (a gain hidden behind a cost
another knob removes later); the one such corner measured, FIFO, is tried as one setting,
and a next run starts a new pass from the table.
"""
import json
import logging
import os
import threading
import time
from dataclasses import dataclass

import numpy as np

from ..comm.mpiabi import MPI
from ..comm.progress import wait_polling
from ..config import format_bytes

__all__ = ['KNOBS', 'GRID', 'JOINT', 'CoordinateSearch', 'State', 'Tuner', 'candidates',
           'free_knobs', 'samples', 'settle_bound', 'start_config', 'save']

log = logging.getLogger('mpi_kvstore')

KNOBS = ('partition_bytes', 'credit_bytes', 'fusion_threshold', 'progress_sleep_us')
# The values tried for each knob, besides the one it starts from. 0 turns pieces, the
# credit or polling off, which won on one host and at 10 Gbit/s (docs/scheduling.md);
# fusion above 4 MB cost more in copies than it saved on a CPU (docs/configuration.md).
GRID = {'partition_bytes': (0, 1 << 20, 4 << 20),
        'credit_bytes': (0, 2 << 20, 8 << 20, 32 << 20),
        'fusion_threshold': (256 << 10, 1 << 20, 4 << 20),
        'progress_sleep_us': (0.0, 50.0, 200.0)}
# Tried together before the knobs one at a time: FIFO (no pieces, no credit), which won at
# 10 Gbit/s and 4 hosts, where neither knob alone gained (docs/benchmarks.md, the grid).
# A search one knob at a time cannot reach a corner that only both moves together find.
JOINT = (('fifo', {'partition_bytes': 0, 'credit_bytes': 0}),)
MARGIN = 0.03        # a value replaces the best so far only when this much faster: noise
WARMUP_STEPS = 3     # steps of the job's start left out (graph building, compiled ops)
CHECK_EVERY = 4      # negotiation rounds between two agreements on the timings
_USER = ('argument', 'environment variable')


def free_knobs(config):
    """The knobs autotune may change: those whose value the user did not set."""
    return tuple(k for k in KNOBS if not config.origin(k).startswith(_USER))


def candidates(start, free, grid=GRID, joint=JOINT):
    """What one pass tries after the start, in groups: [(name, [changes, ...])], each
    change a {knob: value} dict. First each joint setting whose knobs are all free and not
    all at it already, then each free knob's other grid values."""
    groups = [(name, [dict(changes)]) for name, changes in joint
              if set(changes) <= set(free) and any(start[k] != v for k, v in changes.items())]
    return groups + [(k, [{k: v} for v in _ordered(grid[k]) if v != start[k]])
                     for k in KNOBS if k in free and set(grid[k]) - {start[k]}]


def samples(start, free, grid=GRID, joint=JOINT):
    """The most samples one pass takes: the start, then each candidate, and for each group
    whose fastest candidate was faster than the best, the values in use and that candidate
    once more (:class:`CoordinateSearch`)."""
    groups = candidates(start, free, grid, joint)
    return 1 + sum(len(changes) for _, changes in groups) + 2 * len(groups)


def settle_bound(steps, count):
    """The steps within which ``count`` samples of ``steps`` steps settle: the warm-up, then
    per sample the step that spans a switch, its steps, and up to CHECK_EVERY more while the
    ranks wait for the next agreement (a step runs at least one negotiation round)."""
    return WARMUP_STEPS + count * (1 + steps + CHECK_EVERY)


class CoordinateSearch:
    """Deterministic coordinate search: the same costs give the same proposals and choice.

    ``start``: {knob: value}; ``free``: the knobs it may change (others keep their start).
    :meth:`proposal` is what to measure next (None once done), :meth:`record` its cost.
    Each group of :func:`candidates` in turn, with the best so far for the rest: its
    fastest candidate, if faster than the best, is measured again right after the best,
    and replaces it only if it wins that pair by half the ``margin`` and both pairs
    together (the sums of their costs) by the ``margin``.
    """

    def __init__(self, start, free, grid=GRID, margin=MARGIN, joint=JOINT):
        self.best = dict(start)
        self.best_cost = None
        self.trials = []     # (values, cost) in the order measured
        self._margin = margin
        # None: the best so far (first: the start); else (group, {knob: value})
        self._pending = [None] + [(name, changes) for name, group in
                                  candidates(start, free, grid, joint) for changes in group]
        self._group_best = None               # (cost, changes) of the group being searched
        self._again = None                    # the best's cost, measured again: a recheck
        self._first = None                    # the rechecked candidate's first cost

    def proposal(self):
        """The values to measure next, or None: the search is done (``best``)."""
        return self.proposal_of(self._pending[0]) if self._pending else None

    def record(self, cost):
        """The cost (a step, in seconds: lower is better) of :meth:`proposal`'s values."""
        cost = float(cost)
        head = self._pending.pop(0)
        self.trials.append((self.proposal_of(head), cost))
        if head is None:
            if self.best_cost is None:
                self.best_cost = cost                      # the start
            else:
                self._again = cost                         # the best, measured again
            return
        group, changes = head
        if self._again is not None:                        # the candidate, measured again
            again, self._again = self._again, None
            # best_cost is still the figure the first sample was compared with
            won = (cost < again * (1 - self._margin / 2)
                   and self._first + cost < (self.best_cost + again) * (1 - self._margin))
            if won:
                self.best.update(changes)
                self._drop_known()
            self.best_cost = cost if won else again
            return
        if self._group_best is None or cost < self._group_best[0]:
            self._group_best = (cost, changes)
        following = self._pending[0][0] if self._pending else None
        if following != group:   # the group's last candidate: recheck the fastest if faster
            cost_g, changes_g = self._group_best
            self._group_best = None
            if cost_g < self.best_cost:
                self._first = cost_g
                self._pending[:0] = [None, (group, changes_g)]

    def _drop_known(self):
        """Leave out candidates that are the best already (a knob at the value a joint
        setting gave it), once the best changed: only after a recheck, between groups, so
        the group under way keeps all of its candidates. The start needs none of this:
        :func:`candidates` leaves its values out."""
        self._pending = [head for head in self._pending
                         if head is None or self.proposal_of(head) != self.best]

    def proposal_of(self, head):
        return dict(self.best) if head is None else dict(self.best, **head[1])

    @property
    def done(self):
        return not self._pending


def _ordered(values):
    return sorted(set(values))


def start_config(config, table):
    """``config`` with the tune table's tuned ``fusion_threshold`` where the user set none
    (topology.resolve applies the table's other schedule values, which start as 'auto')."""
    tuned = (getattr(table, 'schedule', None) or {}).get('fusion_threshold')
    if tuned is None or config.origin('fusion_threshold') != 'default':
        return config
    return config.replace(origin='tune table', fusion_threshold=int(tuned))


def save(path, values):
    """Write ``values`` into the tune table at ``path``'s ``schedule``, keeping the rest; ->
    whether this rank wrote it. Every rank that can read the table writes the same content
    (the ranks agreed on it: tuning.load), each through a file of its own renamed over it,
    so a table on a shared disk and one copy a host stay the same everywhere."""
    try:
        with open(path) as fh:
            payload = json.load(fh)
    except (OSError, ValueError):
        return False      # not on this host: rank 0's copy served this job
    payload['schedule'] = dict(payload.get('schedule') or {}, **values)
    scratch = '%s.%d.%d.tmp' % (path, os.getpid(), threading.get_ident())
    try:
        with open(scratch, 'w') as fh:
            json.dump(payload, fh, indent=1)
        os.replace(scratch, path)
    except OSError as err:
        log.warning('mpi_kvstore: autotune could not write its choice into %s: %s', path, err)
        return False
    return True


@dataclass(frozen=True)
class State:
    """Where a store's search stands, as ``MPIKVStore.autotune_state`` reports it: a copy,
    which the search does not change afterwards."""

    active: bool
    """Still searching; False once it settled (or with nothing to search on any rank)."""
    values: dict
    """{knob: value} in use now: what it settled on, once settled."""
    free: tuple
    """The knobs this rank's user left to the search (the rest are kept as set)."""
    bound: int
    """The steps within which the search settles (:func:`settle_bound`)."""
    steps: int
    """The steps this rank has seen so far (at most one more than it measured)."""
    switches: tuple
    """(round, {knob: new value}) of each switch, alike on every rank."""


class Tuner:
    """One rank's side of the online search; the negotiation thread calls :meth:`round`
    after every round, and the design :meth:`ready` with the requests that turn ready."""

    def __init__(self, config, rank, size, table=None, poll_us=50.0):
        self.rank, self.size = rank, size
        self.steps = config.autotune_steps
        self.free = free_knobs(config)
        self.current = {k: getattr(config, k) for k in KNOBS}
        self.search = CoordinateSearch(self.current, self.free)
        self.bound = settle_bound(self.steps, samples(self.current, self.free))
        self.path = config.tune_table if table is not None else ''
        # On every rank alike, even where this rank's user set every knob: rank 0's search
        # decides (its free knobs), and a rank that skipped the checks would hang the rest.
        self.active = True
        self.rounds = 0
        self.switches = []          # (round, values) of every switch, the same on every rank
        self._poll_us = poll_us
        self._lock = threading.Lock()
        self._first_key = None
        self._last = None
        self._skip = WARMUP_STEPS
        self._intervals = []
        self._steps_seen = 0
        self._start_cost = None

    def state(self):
        """A :class:`State` of the search now (any thread)."""
        with self._lock:
            return State(self.active, dict(self.current), tuple(self.free), self.bound,
                         self._steps_seen, tuple((r, dict(v)) for r, v in self.switches))

    # -- the thread that marks requests ready (the negotiation thread, or an engine worker) ----
    def ready(self, reqs):
        """Mark a step where a gradient's collective of the first key reduced turns ready."""
        if not self.active:     # settled: no more samples, and no list growing a step
            return
        for req in reqs:
            if req.kind not in ('allreduce', 'reducescatter'):
                continue
            with self._lock:
                if self._first_key is None:
                    self._first_key = req.key
                first = req.key == self._first_key
            if first:
                self.tick(time.perf_counter())
                return

    def tick(self, now):
        """A step began at ``now`` (seconds)."""
        with self._lock:
            self._steps_seen += 1
            last, self._last = self._last, now
            if last is None:
                return
            if self._skip:
                self._skip -= 1
                return
            self._intervals.append(now - last)

    def summary(self):
        """This rank's (median step in seconds, minus its number of steps): what the ranks
        MAX-allreduce."""
        with self._lock:
            steps = list(self._intervals)
        return np.array([float(np.median(steps)) if steps else 0.0, -float(len(steps))])

    # -- the negotiation thread --------------------------------------------------------------
    def round(self, comm):
        """After one agreed round (the same round on every rank): every CHECK_EVERY rounds,
        agree on the timings; -> {knob: value} to apply now, or None."""
        self.rounds += 1
        if not self.active or self.rounds % CHECK_EVERY:
            return None
        agreed = self.summary()
        if self.size > 1:
            wait_polling(comm.mpi.Iallreduce(MPI.IN_PLACE, agreed, op=MPI.MAX), self._poll_us)
        if -agreed[1] < self.steps:
            return None
        choice = self.decide(agreed[0]) if self.rank == 0 else None
        if self.size > 1:
            choice = comm.mpi.bcast(choice, root=0)
        return self.switch(choice)

    def decide(self, cost):
        """Rank 0: the agreed cost of the values in use -> (settled, values to run next)."""
        if self._start_cost is None:
            self._start_cost = cost
        self.search.record(cost)
        following = self.search.proposal()
        if following is None:
            return True, dict(self.search.best), (self.free, self.search.best_cost,
                                                  self._start_cost)
        return False, following, None

    def switch(self, choice):
        """Every rank: apply rank 0's ``choice`` (decide's tuple) from now on; -> the knobs
        that change."""
        settled, values, outcome = choice
        changed = {k: v for k, v in values.items() if self.current[k] != v}
        with self._lock:         # state() reads the values, switches and active together
            self.current = dict(values)
            self._intervals = []
            self._skip = 1       # the step under way began with the old values
            if changed:
                self.switches.append((self.rounds, dict(changed)))
            if settled:
                self.active = False
        if settled:
            self._settled(*outcome)
        return changed

    def _settled(self, free, cost, start_cost):
        # rank 0's free knobs: every rank writes the same content (ranks' origins may differ)
        saved = bool(self.path and free) and save(self.path, {k: self.current[k] for k in free})
        if self.rank != 0:
            return
        log.info('mpi_kvstore: autotune settled at round %d after %d steps (bound %d): %s '
                 '(a step %.2f ms, %.2f ms with the start values)%s%s',
                 self.rounds, self._steps_seen, self.bound, describe(self.current),
                 cost * 1e3, start_cost * 1e3,
                 '; kept as set: %s' % ', '.join(k for k in KNOBS if k not in self.free)
                 if len(self.free) < len(KNOBS) else '',
                 '; written to %s' % self.path if saved else
                 '; give tune_table=PATH (python -m mpi_kvstore tune) to keep it for the next run')


def describe(values):
    """'partition_bytes=4M, ...' of knob values."""
    return ', '.join('%s=%s' % (k, format_bytes(int(values[k])) if k != 'progress_sleep_us'
                                else '%g' % values[k]) for k in KNOBS if k in values)
