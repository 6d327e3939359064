"""Words for a mismatch: what every rank issued where the ranks disagree.

The agreement (agreement.py) finds a mismatch with one MIN-allreduce of signatures,
which says that ranks differ, not how. Every rank sees the same MIN, so every rank
(a joined one too) knows at once that a mismatch was found, and only then do they
gather short descriptions of the requests in question (:func:`gather`) and build
one message (:func:`explain`), the same text on every rank and in every design.
Design.reject calls it: blocking and chained through run_agreed, where chained's compiled
op hands a mismatch over (engine.layout.AGREED, then Chained._in_python); funneled and concurrent
from the negotiation thread, on the control communicator.

The gather is two buffer-based calls (the lengths, then the bytes), never one of
mpi4py's object collectives: those hold the GIL while they wait, which once starved
the concurrent design's other lane into a hang (git log 7a4918a).
"""
import json
import logging

import numpy as np

from ..faults.abort import rank_list

__all__ = ['describe', 'gather', 'explain', 'words', 'described', 'parted']

log = logging.getLogger(__name__)

# The described fields that ranks must agree on, in the order a message names them;
# 'shape' stands for shape and dtype together, as a user reads them.
_FIELDS = ('kind', 'key', 'shape', 'root', 'compression', 'place', 'unit', 'priority',
           'factor', 'scale')
# Positions of a call named at most; a long list would bury the first difference.
MAX_LISTED = 4
ADVICE = ('every rank must issue the same keys, shapes, dtypes, roots and gradient '
          'compression in the same order')


def describe(req):
    """What a rank says of one of its requests (JSON-able; ``failed``: its own error)."""
    codec = req.codec.spec if req.codec is not None else None
    failed = None
    if req.error is not None:   # its first line: the others need the gist, this rank has it all
        failed = '%s: %s' % (type(req.error).__name__, (str(req.error).splitlines() or [''])[0])
    return {'seq': req.seq, 'kind': req.kind, 'key': repr(req.key),
            'shape': [list(req.shape), None if req.dtype is None else str(req.dtype)],
            'root': req.root, 'compression': None if codec is None else list(codec),
            'place': req.place, 'unit': req.unit, 'priority': req.priority,
            'factor': float(req.factor),
            'scale': None if req.scale is None else [float(v) for v in req.scale],
            'failed': failed}


def gather(comm, mine):
    """Every rank's ``mine`` (a JSON-able value; None from a joined rank), in rank order.

    ``comm``: the comm.Comm the agreement ran on; every rank of it must call this at the
    same point, which a mismatch that every rank saw in one MIN guarantees.
    """
    data = np.frombuffer(json.dumps(mine).encode(), dtype=np.uint8)
    counts = np.zeros(comm.size, dtype=np.int32)
    comm.allgather(np.array([data.size], dtype=np.int32), counts)
    counts = [int(c) for c in counts]
    displs = [sum(counts[:r]) for r in range(comm.size)]
    buf = np.zeros(sum(counts), dtype=np.uint8)
    buf[displs[comm.rank]:displs[comm.rank] + data.size] = data
    comm.allgather_flat(buf, counts, displs)
    return [json.loads(buf[d:d + c].tobytes()) for d, c in zip(displs, counts)]


def words(comm, reqs):
    """The message for a mismatch among ``reqs`` (None on a joined rank), from every rank's
    description; this rank's alone if the gather fails (the message still says why)."""
    return explain(described(comm, reqs))


def described(comm, reqs):
    """Every rank's descriptions of its ``reqs`` (None: a joined rank), in rank order; only
    this rank's where the gather fails (:func:`words`)."""
    mine = None if reqs is None else [describe(r) for r in reqs]
    try:
        return gather(comm, mine)
    except Exception as err:  # an MPI failure here must not hide the mismatch itself
        log.error('mpi_kvstore: could not gather what every rank issued: %s', err)
        return [mine if r == comm.rank else None for r in range(comm.size)]


def parted(every):
    """Whether the active ranks of ``every`` (:func:`described`) issued different numbers
    of collectives in the op that mismatched: their calls were cut into engine ops
    differently, so ops that follow it on one rank belong to the call the others ended."""
    return len({len(reqs) for reqs in every if reqs is not None}) > 1


def explain(every):
    """One message from every rank's described requests (None: that rank joined)."""
    active = [(rank, reqs) for rank, reqs in enumerate(every) if reqs is not None]
    if not active:
        return 'ranks disagree; ' + ADVICE
    if len({len(reqs) for _, reqs in active}) > 1:
        told = ', '.join('rank %d issued %s' % (rank, _count(reqs)) for rank, reqs in active)
        return 'ranks disagree on how many collectives one call issues: %s; %s' % (told, ADVICE)
    found = [text for text in (_position([(rank, reqs[i]) for rank, reqs in active])
                               for i in range(len(active[0][1]))) if text]
    if not found:   # signatures differ in something not described here
        return 'ranks disagree on %s; %s' % (_seqs(active[0][1]), ADVICE)
    more = len(found) - MAX_LISTED
    listed = '; '.join(found[:MAX_LISTED]) + ('; and %d more' % more if more > 0 else '')
    return 'ranks disagree on %s; %s' % (listed, ADVICE)


def _position(said):
    """What ranks said of one position: None if they agree, else 'collective #n (what):
    rank 0 has ..., rank 1 has ...'."""
    first = said[0][1]
    differ = [f for f in _FIELDS if any(d[f] != first[f] for _, d in said)]
    failed = [(rank, d['failed']) for rank, d in said if d['failed']]
    if not differ and not failed:
        return None
    same = all(d['seq'] == first['seq'] for _, d in said)
    head = _collective(first if same else dict(first, seq=None),
                       [f for f in ('kind', 'key', 'shape') if f not in differ])
    if 'factor' in differ and 'scale' in differ:   # the factors said it: one is enough
        differ.remove('scale')
    if differ and not same:   # a rank that issued more collectives before: say where
        differ.insert(0, 'seq')
    told = _grouped(said, differ) if differ else []
    told += ['rank %d could not take part (%s)' % (rank, why) for rank, why in failed]
    return '%s: %s' % (head, ', '.join(told))


def _grouped(said, differ):
    """'rank 0 has X, ranks 1-7 have Y': ranks that said the same, named together, so that
    a large job's message stays short and still names every rank."""
    groups = {}
    for rank, d in said:
        groups.setdefault(_render(d, differ), []).append(rank)
    return ['%s %s %s' % (rank_list(ranks), 'has' if len(ranks) == 1 else 'have', text)
            for text, ranks in groups.items()]


def _collective(d, fields):
    seq = 'collective' if d['seq'] is None else 'collective #%d' % d['seq']
    what = _render(d, fields, ', ')
    return '%s (%s)' % (seq, what) if what else seq


def _render(d, fields, sep=' '):
    """The fields of one description, as a user reads them: 'allreduce of key 'w' shape
    (3,) float32'."""
    text = sep.join(_field(f, d[f]) for f in fields)
    return text.replace(sep + 'key ', ' of key ', 1) if 'kind' in fields and 'key' in fields else text


def _field(name, value):
    if name == 'kind':
        return value
    if name == 'seq':
        return '#%d' % value
    if name == 'key':
        return 'key %s' % value
    if name == 'shape':
        shape, dtype = value
        return 'shape %s %s' % (tuple(shape), dtype) if dtype else 'no array'
    if name == 'compression':
        return 'compression %s' % ' '.join(map(str, value)) if value else 'no compression'
    if name == 'place':
        return '%s memory' % value
    if name == 'factor':   # Horovod's scale factors, folded (horovod.ops._fold)
        return 'scale factor %r' % value
    if name == 'scale':   # the same product, split differently (comm.collective.factor_sig)
        return ('prescale %r and postscale %r' % tuple(value) if value
                else 'no prescale or postscale')
    return '%s %s' % (name, value)


def _count(reqs):
    keys = ', '.join(d['key'] for d in reqs[:MAX_LISTED])
    more = ', ...' if len(reqs) > MAX_LISTED else ''
    return '%d (keys %s%s)' % (len(reqs), keys, more)


def _seqs(reqs):
    if not reqs:
        return 'an empty call'
    first, last = reqs[0]['seq'], reqs[-1]['seq']
    return 'collective #%d' % first if first == last else 'collectives #%d-#%d' % (first, last)
