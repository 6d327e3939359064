"""What every design shares: sequence numbers, execution of buckets, errors, join."""
import abc
import functools
import itertools
import logging

from .. import debug
from ..comm import agreement
from ..comm.collective import Collective, finish_all
from ..comm.fusion import plan
from ..comm.host import Comm
from ..comm.mpiabi import MPI
from ..comm.reduce import Reducer
from ..engine.arrays import flat_view, view_at
from ..engine.takeup import Slot, complete_slots
from ..errors import ArrayLayoutError, JoinError, RankMismatchError
from . import autotune, join, mismatch

__all__ = ['Design', 'complete_all', 'native_view', 'progress', 'new_comm', 'comm_factory']

log = logging.getLogger(__name__)


class Design(abc.ABC):
    """Base of the designs. Subclasses define ``_submit`` and say in their docstring
    which MPI thread level they need and how they keep one collective order (a design
    without ``_submit`` cannot be made: abc)."""

    name = ''
    thread_level = MPI.THREAD_SERIALIZED
    in_engine = True  # its collectives are MXNet engine ops
    tuner = None      # an autotune.Tuner where the design searches its schedule (negotiated)

    def __init__(self, comm, config, sink, timeline=None, table=None, make_comm=None,
                 shares=None):
        """``make_comm(concurrent=False)``: a new communicator (comm.Comm) for this design's
        collectives; by default :func:`new_comm` of the options, so the design does not
        choose how data moves. ``shares``: the store's shards.JoinedShares (with
        shard_optimizer), which a joined rank's mirrors take part in; None otherwise."""
        self.config = autotune.start_config(config, table)   # a tuned fusion_threshold
        self.make_comm = comm_factory(comm, config, table, make_comm)
        self.table = table  # tuning.Table, or None: how each allreduce size runs (new_comm)
        self.size = comm.Get_size()
        self.rank = comm.Get_rank()
        self._sink = sink
        self._seq = itertools.count()
        self.pushed = 0  # collectives numbered so far (read by the stall inspector)
        self.joined = False  # this rank called join() and mirrors the others' collectives
        self.shares = shares
        # fusion, averaging and device handling around each collective (reduce.py)
        self.reducer = Reducer(self.size, self.fail, self.fail_all)
        self.timeline = timeline

    # -- called on the user's thread ---------------------------------------
    def submit(self, reqs, priority=0):
        """Number the requests in call order, then hand them to the design."""
        seq, timeline = self._seq, self.timeline
        if not timeline and len(reqs) == 1:   # a key alone, the common call: no loop
            at = next(seq)
            reqs[0].number(at, priority)
            self.pushed = at + 1
            self._submit(reqs, priority)
            return
        for req in reqs:
            # Within a round, collectives run by priority: every rank must pass the same.
            at = next(seq)
            req.number(at, priority)
            self.pushed = at + 1
            if timeline:
                timeline.pushed(req)
        self._submit(reqs, priority)

    def again(self, prepared, models, priority, pending):
        """A prepared call (engine.records.Prepared) repeated, in one function where the
        design has one for it (store/job.py, Job.again): its requests renewed from
        ``models`` (Collective.renewed), numbered, entered in ``pending`` and handed over
        as :meth:`submit` would -> True; False: nothing done, submit them the general way."""
        return False

    @abc.abstractmethod
    def _submit(self, reqs, priority):
        """Hand the numbered requests to the design's own scheduling."""

    @property
    def synchronous(self):
        """True when a call returns only after its collectives ran (errors are known)."""
        return self.config.naive_engine

    def reap(self):
        """Mark done the requests whose collectives finished where nobody said so (the
        chained design's native ops). Any thread may call it. Optional: only chained has any."""
        return None

    def close(self):
        """Stop threads; the caller has already waited for every request. Optional: a
        design without threads of its own has nothing to stop."""
        return None

    # -- called where the collective runs ----------------------------------
    def attach(self, req, view=None):
        """Point the request at its array's memory: read now, inside the engine op holding
        it, or by ``view()`` from what a native op read there."""
        if req.array is None:
            return
        try:
            req.attach(view() if view else flat_view(req.array, req.nbytes, req.dtype))
        except Exception as err:  # keep this rank in step with the others (fail_all)
            self.fail_all([req], err)

    def attach_native(self, op):
        """Point each request of a native op (engine.records.NativeOp) at the memory its op read."""
        index = 0
        for req in op.reqs:
            if req.array is not None:
                self.attach(req, functools.partial(native_view, req, op.pointer(index)))
                index += 1

    def fail(self, req, err):
        req.fail(err)
        if not req.mirror:  # a mirror's failure is the active ranks' to report
            self._sink(req, err)

    def fail_all(self, reqs, err):
        """Fail requests on this rank alone. Those without memory get zeros to send.

        Before the agreement this also changes their signature, so every rank sees a
        mismatch and none runs them: the others would otherwise get a sum without this
        rank's part and no error. After it (a failed fusion), the collective runs with
        this rank's zeros, since the other ranks are already in it.
        """
        for req in reqs:
            req.withdraw()
            if req.error is None:
                self.fail(req, err)

    def reject(self, reqs, comm):
        """Ranks agreed that ``reqs`` do not match: fail and complete them, run nothing.

        Every rank of ``comm`` calls it at once (they saw the same MIN), a joined one with
        its mirrors or None, so they can tell each other what they issued.
        """
        every = mismatch.described(comm, None if self.joined else reqs or [])
        words = mismatch.explain(every)
        for req in reqs or ():
            # A request this rank failed first keeps that error: it says why.
            if req.error is None:
                self.fail(req, RankMismatchError(words))
            req.complete()
        if reqs and mismatch.parted(every):
            self.parted(reqs, words)

    def parted(self, reqs, words):
        """Ranks issued different numbers of collectives in the op of ``reqs`` (rejected
        with ``words``): one rank cut a call into more engine ops than another. A design
        that agrees op by op fails the rest of this rank's call without agreeing on it
        (chained), so the ranks meet again at their next call; one that agrees request by
        request, or raises the error before the call's next op (blocking), stays in step."""
        return None

    def call(self, count):
        """The next ``count`` requests numbered are one call's (Collectives.allreduce, where
        it submits them as several engine ops): what :meth:`parted` fails together."""
        return None

    def agree_and_execute(self, reqs, comm):
        """Check with one MIN-allreduce that every active rank issued ``reqs``, then run them."""
        if self.size == 1:
            self.execute_all(reqs, comm)
            return
        msg = self.group_message([r.sig for r in reqs])
        comm.check_min(msg)
        self.run_agreed(reqs, msg, comm)

    def group_message(self, sigs, joined=False):
        """This rank's agreement message of one call (agreement.group_message); chained's
        carries more, so every agreement on its comm has that length."""
        return agreement.group_message(sigs, joined=joined, rank=self.rank)

    def run_agreed(self, reqs, msg, comm):
        """Run ``reqs`` as the agreement ``msg`` (after the MIN) says: reject them on a
        mismatch, mirror them to joined ranks, else execute them."""
        if agreement.group_mismatch(msg):
            self.reject(reqs, comm)
            return
        head = agreement.read_header(msg)
        if head.someone_joined:
            reqs, joined = self.exchange_with_joined(comm, head, reqs)
            reqs = self.refuse(reqs, joined)
        self.execute_all(reqs, comm)

    # -- join ------------------------------------------------------------------
    def join(self):
        """This rank has no more collectives: mirror the others' until every rank joined.

        Called on the user's thread once this rank's own requests finished; blocks.
        Returns the last rank to join. The negotiated designs override it.
        """
        self.joined = True
        comm = self.join_comm
        while True:
            msg = self.group_message((), joined=True)
            comm.check_min(msg)
            head = agreement.read_header(msg)
            if head.all_joined:
                return self.finish_join(comm)
            if agreement.group_mismatch(msg):   # the active ranks run nothing, and say why
                self.reject(None, comm)
            else:
                mirrors, joined = self.exchange_with_joined(comm, head, None)
                self.execute_all(self.refuse(mirrors, joined), comm)

    def exchange_with_joined(self, comm, head, mine):
        """Some rank joined: all learn which, and the lowest active rank says what runs.

        ``mine``: this active rank's requests, or None on a joined rank.
        -> (this rank's requests or their mirrors, joined flag of every rank)
        """
        joined = comm.mpi.allgather(self.joined)
        meta = [join.describe(r) for r in mine] if self.rank == head.lowest_active else None
        meta = comm.mpi.bcast(meta, root=head.lowest_active)
        if mine is not None:
            return mine, joined
        return [join.mirror(m, self.shares) for m in meta], joined

    def refuse(self, reqs, joined):
        """Fail (on every rank alike) what a joined rank cannot take part in; -> the rest."""
        runnable = []
        for req in reqs:
            why = join.refusal(req, joined)
            if why is None:
                runnable.append(req)
            else:
                self.fail(req, JoinError(why))
                req.complete()
        return runnable

    def finish_join(self, comm):
        """Every rank joined: agree on where the sequence goes on, and who joined last.

        The last rank to join is the one that had issued the most collectives
        (ties: the highest rank). Every rank numbers its next collective after it.
        """
        top = comm.mpi.allreduce(self.pushed * self.size + self.rank, op=MPI.MAX)
        self.pushed = top // self.size
        self._seq = itertools.count(self.pushed)
        self.joined = False
        return top % self.size

    def buckets(self, reqs):
        """The agreed requests cut into buckets (fusion.plan, as the options say)."""
        return plan(reqs, self.config.fusion_threshold, self.config.device_fusion_threshold)

    def execute_all(self, reqs, comm):
        for bucket in self.buckets(reqs):
            self.execute(bucket, comm)

    def execute(self, bucket, comm):
        """Run one bucket's collective and complete its requests, whatever happens.

        A failure of this rank's own fusion step still makes the MPI call, on zeros
        of the agreed size: the other ranks are in it, and skipping it would pair
        this rank's next collective with their current one.
        """
        if self.timeline:
            self.timeline.started(bucket)
        try:
            self._execute(bucket, comm)
        except Exception as err:
            log.error('collective failed: %s: %s', bucket[0].describe(), err)
            for req in bucket:
                if req.error is None:
                    self.fail(req, err)
        finally:
            if self.timeline:
                self.timeline.finished(bucket)
            complete_all(bucket)

    def _execute(self, bucket, comm):
        kind = bucket[0].kind
        if kind == 'allreduce':
            self.reducer.allreduce(bucket, comm)
        elif kind == 'bcast':
            self.reducer.bcast(bucket[0], comm)
        elif kind == 'reducescatter':
            self.reducer.reduce_scatter(bucket, comm)
        elif kind == 'allgather':
            self.reducer.allgather(bucket, comm)
        elif kind == 'barrier':
            comm.barrier()
        else:
            bucket[0].run_custom(comm.mpi)


def complete_all(reqs):
    """Collective.complete of each of ``reqs``; those of a take-up's native ops that ran
    without error at once: their engine ops in one compiled call (takeup.complete_slots),
    their waiters woken once."""
    clean = []
    for req in reqs:
        if type(req) is Collective and req.error is None and type(req.completion) is Slot:
            clean.append(req)
        else:
            req.complete()
    if clean:
        complete_slots([req.completion for req in clean])
        finish_all(clean)
        debug.count('round', 'bulk')


def native_view(req, pointer):
    """The request's view from the pointer its native op took (None: it was refused)."""
    if pointer is None:
        raise ArrayLayoutError('array of shape %s cannot be read in place: MXNDArrayToDLPack '
                               'refused it inside the engine op (an MKLDNN layout)'
                               % (req.shape,))
    return view_at(*pointer, req.nbytes, req.dtype, req.array)


def progress(config):
    """How a Comm of these options progresses a large allreduce (comm.Comm)."""
    return config.progress_sleep_us, config.progress_min_bytes


def comm_factory(comm, config, table, make_comm=None):
    """``make_comm``, or by default a factory of communicators from the options (new_comm)."""
    return make_comm or functools.partial(new_comm, comm, config, table)


def new_comm(comm, config, table=None, concurrent=False):
    """The communicator a design runs its collectives on, as the options say (comm.Comm);
    ``concurrent``: it runs beside others at once (the concurrent design's lanes)."""
    return Comm(comm, config.hierarchical, progress(config), config.cuda_aware, table,
                config.gpu_transport, concurrent)
