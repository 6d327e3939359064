"""The one debug interface: counters of which paths the library ran.

Tests and diagnosis read them to tell which allreduce algorithm, which device
transport, or whether Python on an engine thread ran; the library only counts.

    from mpi_kvstore import debug
    before = debug.snapshot()
    ...                                # collectives
    debug.since(before, 'algorithm')   # {'rsag': 2}
"""
import collections

__all__ = ['count', 'count_all', 'snapshot', 'since', 'KINDS']

# algorithm: Comm.allreduce_host by algorithm name; transport: device collectives by
# transport name; engine_python: engine ops that ran Python code (name ''); call_cache:
# push and pushpull calls that skipped their checks ('hit') or ran them ('miss');
# schedule: requests cut into pieces ('pieces_cut') and dispatches that the credit
# stopped short of the queue ('held_back'); named: named allreduces (collectives.allreduce)
# in place whose name's signature was reused ('hit') or made ('miss'), and those staged
# through a copy ('staged'); optimizer: the store's optimizer run on one key ('key') or on a
# batch of keys in one updater call ('batch'); repeat: negotiated rounds whose data went
# beside their agreement ('won') and bets the round did not repeat ('lost', designs/repeat.py);
# fastpath: repeated calls that took their prepared path ('hit') or today's ('miss'); loop:
# calls of MXNet's per-key loops whose collectives waited for the loop's next ('held'), the
# submits that sent a loop's collectives together ('submit'), and held calls that took the
# optimizer's one-function path ('again', store/heldloop.py); round:
# take-ups of a negotiation thread's native ops in one compiled read ('taken') and
# completions of many of their engine ops in one compiled call ('bulk', designs/base.py);
# again: repeated calls that took their one-function path, by call ('pushpull', 'push',
# 'pull', 'group', 'copy', 'unnamed': store/exchange.py, store/collectives.py); fuse: chained
# ops that led a fused run ('led'), ran in an earlier op's ('absorbed'), were linked into a
# burst as one engine op ('linked'), or whose arrays were still busy when pushed, so that
# none could ('busy', designs/chained.py); hvd: Horovod scale factors applied by an engine
# op of their own, beside the reduction ('scale_op', horovod/ops.py).
KINDS = ('algorithm', 'transport', 'engine_python', 'call_cache', 'schedule', 'named',
         'optimizer', 'repeat', 'fastpath', 'loop', 'round', 'again', 'fuse', 'hvd')

_counts = collections.Counter()
# counters that always move together (a repeated call's three: store/exchange.py), by the
# tuple of their (kind, name) keys: one plain dict entry bumped per call, not three Counter
# entries (a Counter's += is ~3x a dict's); never reset, added to _counts where read
_together = {}


def count(kind, name='', runs=1):
    """``runs`` more runs (one by default) of ``name`` of ``kind`` (one of :data:`KINDS`)."""
    _counts[kind, name] += runs


def count_all(keys):
    """One more run of each (kind, name) of ``keys``, a tuple its caller made once (the
    same object every time): one dict entry for the counters of a repeated call."""
    _together[keys] = _together.get(keys, 0) + 1


def snapshot():
    """A copy of every counter, to subtract later with :func:`since`."""
    counts = collections.Counter(_counts)
    for keys, runs in list(_together.items()):
        for key in keys:
            counts[key] += runs
    return counts


def since(before, kind):
    """{name: runs} of ``kind`` since ``before`` (a :func:`snapshot`), non-zero only."""
    return {name: n - before[k, name] for (k, name), n in snapshot().items()
            if k == kind and n != before[k, name]}
