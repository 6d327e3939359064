"""When a rank fails, end the job at once and say which rank.

What it guarantees, in a job of more than one process:

- An unhandled exception on any rank, in the main thread or in a thread of the user's
  (KeyboardInterrupt included), no longer leaves the other ranks waiting forever in a
  collective that rank will never join. The hooks the first store installs print the
  traceback (through the hooks they replaced), log which rank failed, and call
  ``MPI.COMM_WORLD.Abort``, which ends every rank: status 1, or 130 after Ctrl-C, as
  ``python -m mpi4py`` does. ``sys.exit()`` on one rank is not an exception to these
  hooks and is not covered.
- A fatal signal (a segmentation fault inside MPI on a connection a cut link killed) is
  preceded by the rank's last words: the first store installs last_words.py's handler,
  and the stall inspector (stall.py) leaves there, at every look, what it saw.
"""
import logging
import signal
import sys
import threading
import time
import traceback

from ..comm.mpiabi import MPI
from ..errors import CollectiveError
from ..launch import supervision
from . import last_words

__all__ = ['install_abort_hook', 'abort_job', 'is_fault', 'rank_list', 'world']

log = logging.getLogger(__name__)

FAILURE_STATUS = 1
INTERRUPT_STATUS = 128 + signal.SIGINT  # what shells report after Ctrl-C; mpi4py uses it too

# The launcher forwards each rank's output on its own time and stops as soon as an abort
# tears the job down: hydra lost the traceback and the message in 1 run of 12 on a loaded
# 2-core VM without this pause before MPI_Abort, and in none of 60 with it.
ABORT_GRACE = 0.5

# -- an unhandled exception aborts the job --------------------------------------------

_hook_lock = threading.Lock()
_hooks_installed = False


def install_abort_hook():
    """Make an unhandled exception on any rank end the whole job (once per process)."""
    global _hooks_installed  # noqa: PLW0603 (once per process, under the lock)
    with _hook_lock:
        if _hooks_installed:
            return
        sys.excepthook = _aborting_excepthook(sys.excepthook)
        threading.excepthook = _aborting_thread_hook(threading.excepthook)
        _hooks_installed = True
        rank, size = world()
        if supervision.active():   # tell the supervisor where this rank runs
            supervision.started(rank, size, MPI.Get_processor_name())
        if size > 1:
            _install_last_words(rank, size)


def _install_last_words(rank, size):
    """A fatal signal inside MPI (UCX on a dead connection) must still end in words."""
    try:
        last_words.install(rank, size, MPI.Get_processor_name())
    except Exception as exc:  # a diagnostic must never stop the store from being made
        log.warning('mpi_kvstore: rank %d: no last words on a fatal signal (%s: %s)',
                    rank, type(exc).__name__, exc)


def _aborting_excepthook(previous):
    def excepthook(exc_type, exc, tb):
        try:
            previous(exc_type, exc, tb)  # the traceback, as it would be printed without us
        finally:
            _abort_on(exc_type, exc, 'the main thread')
    return excepthook


def _aborting_thread_hook(previous):
    def excepthook(args):
        try:
            previous(args)
        finally:
            # threading ends a thread quietly on SystemExit; that is no failure.
            if args.exc_type is not SystemExit:
                name = getattr(args.thread, 'name', '?')
                _abort_on(args.exc_type, args.exc_value, 'thread %r' % name)
    return excepthook


def _abort_on(exc_type, exc, where):
    rank, size = world()
    if size < 2:
        return  # nobody waits for a single process: exit as Python would
    interrupted = issubclass(exc_type, KeyboardInterrupt)
    what = 'was interrupted' if interrupted else 'raised an unhandled exception'
    summary = traceback.format_exception_only(exc_type, exc)[-1].strip()
    supervision.record(rank, supervision.EXCEPTION, is_fault(exc), summary)
    abort_job('mpi_kvstore: rank %d of %d %s in %s (%s); aborting the job, whose other '
              'ranks would otherwise wait for it forever' % (rank, size, what, where, summary),
              INTERRUPT_STATUS if interrupted else FAILURE_STATUS)


def is_fault(exc):
    """Whether an exception that ends a rank is a fault of the machines (MPI failed, or a
    collective failed inside the engine: a relaunch may help) rather than a bug in the
    user's code (the supervisor does not relaunch for those)."""
    while exc is not None:
        if isinstance(exc, (MPI.Exception, CollectiveError)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def world():
    """(rank, size) in COMM_WORLD; (0, 1) where MPI is not running."""
    if not MPI.Is_initialized() or MPI.Is_finalized():
        return 0, 1
    return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


def abort_job(message, status=FAILURE_STATUS):
    """Log MESSAGE, flush what this rank printed, and end every rank of the job."""
    log.critical(message)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()  # MPI_Abort ends the process without flushing Python's buffers
        except (AttributeError, OSError, ValueError):
            pass
    time.sleep(ABORT_GRACE)
    MPI.COMM_WORLD.Abort(status)


# -- the stall report (pure) -------------------------------------------------------------

def rank_list(ranks):
    """'no rank', 'rank 3', 'ranks 0, 2', 'ranks 0-5, 9': short even for thousands of ranks."""
    ranks = sorted(ranks)
    if not ranks:
        return 'no rank'
    if len(ranks) == 1:
        return 'rank %d' % ranks[0]
    return 'ranks ' + ', '.join(_spans(ranks))


def _spans(ranks):
    spans, start = [], ranks[0]
    for prev, cur in zip(ranks, ranks[1:] + [None]):
        if cur is None or cur != prev + 1:
            if prev - start > 1:
                spans.append('%d-%d' % (start, prev))
            else:
                spans.extend(str(r) for r in range(start, prev + 1))
            start = cur
    return spans
