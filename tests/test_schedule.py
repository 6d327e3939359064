"""schedule.py without MPI: cutting agreed allreduces into pieces, the queue's takes by
priority up to a credit, and a request's completion from its pieces.

Requests are real collective.Collective objects whose seq and view the tests set by hand,
as a design does once the ranks agreed on them; their completion is a recorder.
"""
import itertools
import threading

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from mpi_kvstore import debug
from mpi_kvstore.comm.collective import Collective
from mpi_kvstore.comm.fusion import Shares, pieces
from mpi_kvstore.comm.poison import poison_value
from mpi_kvstore.designs.schedule import Knobs, Piece, Queue, SharePiece, cut, wire_bytes

DTYPES = ('float16', 'float32', 'float64', 'int32', 'int64')


def request(seq, count, dtype='float32', priority=0, kind='allreduce', key=None, fill=0,
            codec=None):
    """An agreed request of ``count`` elements whose view holds fill, fill + 1, ..."""
    dtype = np.dtype(dtype)
    return Collective(kind, 'k%d' % seq if key is None else key, dtype, (count,),
                      priority=priority, seq=seq, codec=codec,
                      view=(np.arange(count) % 1000 + fill).astype(dtype))


def unit_id(unit):
    """(seq, piece index or None, bytes): what every rank must take alike."""
    return unit.seq, unit.index if isinstance(unit, Piece) else None, unit.nbytes


def order_key(unit):
    """fusion.order written out: higher priority first, then seq, then piece index."""
    return -unit.priority, unit.seq, unit.index if isinstance(unit, Piece) else 0


class Recorder:
    """A completion (engine.Completion's interface) that records its calls."""

    def __init__(self):
        self.calls = []
        self.lock = threading.Lock()

    def done(self, err):
        with self.lock:
            self.calls.append(err)


# -- cut ----------------------------------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(count=st.integers(1, 5000), dtype=st.sampled_from(DTYPES),
       partition=st.one_of(st.integers(1, 12000), st.sampled_from([1, 2, 3, 7, 4096, 4097])))
def test_pieces_cover_the_request_in_order_as_views_of_its_memory(count, dtype, partition):
    req = request(3, count, dtype, priority=-2)
    original = req.view.copy()
    itemsize = req.dtype.itemsize
    units = cut(req, partition)
    if req.nbytes <= partition:
        assert units == [req]
        return
    step = max(1, partition // itemsize)      # elements of every piece but the last
    assert all(isinstance(u, Piece) for u in units)
    assert len(units) == -(-count // step)    # one element larger than partition_bytes: one
    assert [u.index for u in units] == list(range(len(units)))
    assert units[0].start == 0 and units[-1].stop == count
    for a, b in itertools.pairwise(units):
        assert a.stop == b.start, (a.start, a.stop, b.start)
    for piece in units:
        size = piece.stop - piece.start
        assert size > 0
        # at most partition_bytes, or one element where an element is larger
        assert piece.nbytes == size * itemsize <= max(partition, itemsize)
        assert piece.view.nbytes == piece.nbytes and piece.shape == (size,)
        assert piece.view.flags['C_CONTIGUOUS'] and piece.view.dtype == req.dtype
        assert np.shares_memory(piece.view, req.view)
        assert piece.view.__array_interface__['data'][0] == (
            req.view.__array_interface__['data'][0] + piece.start * itemsize)
        assert (piece.seq, piece.priority, piece.dtype, piece.kind) == (3, -2, req.dtype,
                                                                        'allreduce')
        assert piece.buffer() is piece.view
    assert all(p.stop - p.start == step for p in units[:-1])
    np.testing.assert_array_equal(np.concatenate([p.view for p in units]), original)
    # writing through the pieces writes the request's memory (zero-copy)
    for piece in units:
        piece.view[...] = piece.index
    expected = np.concatenate([np.full(p.stop - p.start, p.index) for p in units])
    np.testing.assert_array_equal(req.view, expected.astype(req.dtype))
    # each piece keeps compression state of its own (a key per piece)
    assert len({p.key for p in units}) == len(units) and all(p.key[0] == req.key for p in units)


@pytest.mark.parametrize('dtype', DTYPES)
def test_boundaries_odd_sizes_and_itemsizes(dtype):
    itemsize = np.dtype(dtype).itemsize
    partition = 1001 * itemsize - 1            # not a multiple of the itemsize: 1000 a piece
    at_limit = request(0, 1000, dtype)          # under partition_bytes, or at it: whole
    assert cut(at_limit, at_limit.nbytes) == [at_limit]
    assert cut(at_limit, partition) == [at_limit]
    one_more = request(1, 1001, dtype)          # one element over: two pieces
    assert [(p.start, p.stop) for p in cut(one_more, 1000 * itemsize)] == [(0, 1000),
                                                                           (1000, 1001)]
    odd = request(2, 4097, dtype)
    assert [(p.start, p.stop) for p in cut(odd, partition)] == [
        (0, 1000), (1000, 2000), (2000, 3000), (3000, 4000), (4000, 4097)]
    tiny = request(3, 5, dtype)                 # partition below one element: one each
    assert [(p.start, p.stop) for p in cut(tiny, 1)] == [(i, i + 1) for i in range(5)]


@pytest.mark.parametrize('kind', ['bcast', 'barrier', 'custom'])
def test_only_allreduces_are_cut(kind):
    if kind == 'bcast':
        req = request(0, 100000, 'float32', kind='bcast')
    else:
        req = Collective(kind, '__%s__' % kind, fn=len if kind == 'custom' else None, seq=0)
    assert cut(req, 16) == [req]


@settings(max_examples=300, deadline=None)
@given(count=st.integers(1, 3000), size=st.integers(2, 5), dtype=st.sampled_from(DTYPES),
       partition=st.integers(1, 6000), kind=st.sampled_from(['reducescatter', 'allgather']))
def test_share_pieces_cut_every_share_in_place(count, size, dtype, partition, kind):
    """The sharded optimizer's collectives in pieces: piece p holds part p of every rank's
    share, so the parts of rank r's share, piece after piece, are exactly that share
    (fusion.pieces), in order; each piece's bytes are what it sends; and the fused layout
    of a bucket of pieces reads every element of the request once."""
    req = request(4, count, dtype, kind=kind, priority=1)
    units = cut(req, partition, size)
    itemsize = np.dtype(dtype).itemsize
    if count * itemsize <= partition:
        assert units == [req]
        return
    assert all(isinstance(u, SharePiece) and u.kind == kind and u.seq == 4 for u in units)
    assert [u.index for u in units] == list(range(len(units)))
    assert len(units) == min(-(-count * itemsize // partition), -(-count // size))
    counts, displs = pieces(count, size)
    for r in range(size):
        at = displs[r]
        for u in units:
            c, d = u.cuts[0][r], u.cuts[1][r]
            assert d == at
            at += c
        assert at == displs[r] + counts[r]
    for u in units:
        assert u.nbytes == sum(u.cuts[0]) * itemsize and u.buffer() is req.view
    layout = Shares(units, size)
    assert not layout.direct
    seen = np.zeros(count, int)
    for r in range(size):
        for _, start, stop, _at in layout.spans(r):
            seen[start:stop] += 1
    assert (seen == 1).all()


def test_share_pieces_only_of_host_memory_whole_elements_and_several_ranks():
    req = request(0, 1000, 'float32', kind='reducescatter')
    assert len(cut(req, 400, 2)) == 10
    assert cut(req, 400, 1) == [req]       # one rank: nothing to scatter
    rows = Collective('reducescatter', 'rows', np.dtype('float32'), (100, 10), unit=10)
    assert cut(rows, 400, 2) == [rows]     # Horovod's cut along the first axis: whole
    assert Shares([req], 2).direct


def test_partition_zero_cuts_nothing():
    req = request(0, 1 << 20, 'float64')
    assert cut(req, 0) == [req]
    queue = Queue(Knobs(0, 0))
    queue.add([req])
    assert queue.take() == [req] and len(queue) == 0


def test_pieces_of_a_failed_read_cut_its_scratch():
    """A rank that could not read its array sends zeros (base.fail_all's scratch): its
    pieces send slices of them, and keep the view for the poison."""
    req = request(0, 10, 'int32')
    req.use_scratch(np.zeros(10, np.int32))
    pieces = cut(req, 12)
    assert [p.stop - p.start for p in pieces] == [3, 3, 3, 1]
    for piece in pieces:
        assert np.shares_memory(piece.buffer(), req.scratch)
        assert not np.shares_memory(piece.buffer(), req.view)
        assert np.shares_memory(piece.view, req.view)


# -- Queue.take -------------------------------------------------------------------------------

specs = st.tuples(st.integers(1, 3000), st.sampled_from(DTYPES), st.integers(-3, 3),
                  st.sampled_from(['allreduce', 'allreduce', 'allreduce', 'bcast']))


@st.composite
def schedules(draw):
    """Agreed batches of requests, the order each rank finds each batch's requests in, and
    the options: (ranks, specs, seqs, batches, orders, partition_bytes, credit_bytes)."""
    ranks = draw(st.integers(2, 4))
    reqs = draw(st.lists(specs, min_size=1, max_size=12))
    seqs = draw(st.permutations(range(len(reqs))))   # agreed out of push order too
    bounds = sorted(draw(st.lists(st.integers(0, len(reqs)), max_size=5)))
    edges = [0] + bounds + [len(reqs)]
    batches = [list(range(a, b)) for a, b in itertools.pairwise(edges)]   # some may be empty
    orders = [[draw(st.permutations(batch)) for batch in batches] for _ in range(ranks)]
    # from 200 bytes: up to 120 pieces a request keeps an example fast
    partition = draw(st.one_of(st.just(0), st.integers(200, 9000), st.integers(200, 2000)))
    credit = draw(st.one_of(st.just(0), st.integers(1, 20000), st.integers(1, 4000)))
    return ranks, reqs, seqs, batches, orders, partition, credit


def expected_units(spec, seq, partition):
    """(order key, bytes) of each unit of one request, from its sizes alone."""
    count, dtype, priority, kind = spec
    itemsize = np.dtype(dtype).itemsize
    if partition <= 0 or kind != 'allreduce' or count * itemsize <= partition:
        return {(-priority, seq, 0): count * itemsize}
    step = max(1, partition // itemsize)
    return {(-priority, seq, i): (min(start + step, count) - start) * itemsize
            for i, start in enumerate(range(0, count, step))}


def check_take(taken, waiting, credit):
    """One take against the model ``waiting`` ({order key: bytes} before it): a prefix of
    the queue in order, at least one unit, within the credit, and as many as fit."""
    keys = [order_key(u) for u in taken]
    assert keys == sorted(keys), keys
    assert [u.nbytes for u in taken] == [waiting[k] for k in keys]
    for k in keys:
        del waiting[k]
    if not keys:
        return
    assert not waiting or max(keys) < min(waiting), (keys, sorted(waiting)[:3])
    total = sum(u.nbytes for u in taken)
    if credit <= 0:
        assert not waiting, 'credit 0 takes everything'
        return
    assert total <= credit or len(taken) == 1, (total, credit, len(taken))
    if waiting:   # the next unit in order would have gone over the credit
        assert total + waiting[min(waiting)] > credit, (total, credit)


@settings(max_examples=200, deadline=None)
@given(schedules())
def test_every_rank_takes_the_same_units_round_after_round(schedule):
    ranks, specs_, seqs, batches, orders, partition, credit = schedule
    before = debug.snapshot()
    # each rank its own request objects and memory, alike in what was agreed
    mine = [[request(seqs[i], count, dtype, priority, kind, key='key%d' % i, fill=10 * r)
             for i, (count, dtype, priority, kind) in enumerate(specs_)]
            for r in range(ranks)]
    queues = [Queue(Knobs(partition, credit)) for _ in range(ranks)]
    waiting = {}     # the model of rank 0's queue: order key -> bytes
    seen = set()
    cut_requests = held_back = 0
    rounds = [(b, True) for b in range(len(batches))]
    while rounds:
        b, agreed = rounds.pop(0)
        taken = []
        for r in range(ranks):
            if agreed:
                queues[r].add([mine[r][i] for i in orders[r][b]])
            before_take = len(queues[r])
            units = queues[r].take()
            assert units or not before_take, 'a take from a non-empty queue took nothing'
            for unit in units:   # this rank's own request and memory
                owner = unit.parent if isinstance(unit, Piece) else unit
                assert owner is mine[r][seqs.index(unit.seq)]
                assert unit.view is None or np.shares_memory(unit.view, owner.view)
            taken.append([unit_id(u) for u in units])
            if r == 0:
                if agreed:
                    for i in batches[b]:
                        units_i = expected_units(specs_[i], seqs[i], partition)
                        waiting.update(units_i)
                        cut_requests += len(units_i) > 1
                check_take(units, waiting, credit)
                held_back += bool(waiting)
                seen.update((s, k) for s, k, _ in taken[0])
        assert all(t == taken[0] for t in taken), 'ranks took different units: %s' % taken
        assert len({len(q) for q in queues}) == 1
        if not rounds and len(queues[0]):
            rounds.append((None, False))   # every rank negotiates while units are queued
    assert not waiting
    # every unit of every request taken once: pieces and whole requests
    assert len(seen) == sum(len(expected_units(s, seqs[i], partition))
                            for i, s in enumerate(specs_))
    event('requests cut: %s; takes that held back: %s' % (cut_requests > 0, held_back > 0))
    counts = {k: v * ranks for k, v in (('pieces_cut', cut_requests),
                                        ('held_back', held_back)) if v}
    assert debug.since(before, 'schedule') == counts


def test_credit_zero_takes_all_and_a_large_unit_goes_alone():
    reqs = [request(s, n) for s, n in enumerate([10, 5000, 20, 30])]   # 40, 20000, 80, 120 B
    everything = Queue(Knobs(0, 0))
    everything.add(reqs)
    assert everything.take() == reqs and everything.take() == []
    tight = Queue(Knobs(0, 100))
    tight.add(reqs)
    before = debug.snapshot()
    assert [r.seq for r in tight.take()] == [0]       # 40 + 20000 > 100
    assert [r.seq for r in tight.take()] == [1]       # larger than the credit: alone
    assert [r.seq for r in tight.take()] == [2]       # 80 + 120 > 100
    assert [r.seq for r in tight.take()] == [3]
    assert tight.take() == [] and len(tight) == 0
    assert debug.since(before, 'schedule') == {'held_back': 3}


@pytest.mark.parametrize('codec, dtype, per_value', [
    ('fp16', 'float32', 2), ('bf16', 'float32', 2), ('fp16', 'float64', 2),
    ('2bit', 'float32', 0.25), ('fp16', 'int32', 4), (None, 'float32', 4)])
def test_pieces_and_credit_count_the_bytes_on_the_wire(codec, dtype, per_value):
    """A compressed request is cut and credited by its codes: fp16 pieces hold twice the
    float32 values (four times the float64 ones), 2-bit's sixteen times; a codec that does
    not apply to the dtype (int32) counts the values' own bytes."""
    from mpi_kvstore import compression
    count, partition = 100_000, 40_000
    req = request(0, count, dtype,
                  codec=(compression.from_params({'type': '2bit', 'threshold': 0.5})
                         if codec == '2bit' else compression.wire_cast(codec) if codec else None))
    assert wire_bytes(req) == -(-count * per_value // 1)
    units = cut(req, partition)
    per_piece = int(partition // per_value)          # values of every piece but the last
    if count * per_value <= partition:
        assert units == [req]
    else:
        assert [u.extent for u in units[:-1]] == [per_piece] * (len(units) - 1)
        assert sum(u.extent for u in units) == count
        assert all(wire_bytes(u) <= partition for u in units)
    # the credit: as many pieces as fit on the wire, counted in the same bytes
    queue = Queue(Knobs(partition, 2 * partition))
    queue.add([req])
    taken = queue.take()
    assert sum(wire_bytes(u) for u in taken) <= 2 * partition
    assert len(taken) == min(2, len(units))


def test_a_late_high_priority_request_overtakes_the_pieces_left():
    queue = Queue(Knobs(partition_bytes=4096, credit_bytes=8192))
    big = request(0, 10000, 'float32', priority=-10)     # 40000 B: 10 pieces
    queue.add([big])
    first = queue.take()
    assert [(u.seq, u.index) for u in first] == [(0, 0), (0, 1)]
    small = request(1, 16, 'float32', priority=0)
    later_low = request(2, 16, 'float32', priority=-10)  # as low as big, pushed later
    queue.add([later_low, small])
    second = queue.take()
    assert second[0] is small
    assert [(u.seq, u.index) for u in second[1:]] == [(0, 2)]   # 64 + 4096 + 4096 > 8192
    rest = []
    while len(queue):
        rest += [(u.seq, getattr(u, 'index', None)) for u in queue.take()]
    # big's pieces keep their order; the later request of the same priority waits for them
    assert rest == [(0, i) for i in range(3, 10)] + [(2, None)]


# -- completion from pieces -----------------------------------------------------------------------

def pieces_of(dtype='float32', count=1000, per_piece=100):
    req = request(7, count, dtype)
    req.complete_with(Recorder())
    return req, cut(req, per_piece * req.dtype.itemsize)


@settings(max_examples=50, deadline=None)
@given(st.permutations(range(10)))
def test_the_request_completes_once_after_its_last_piece(finish_order):
    req, pieces = pieces_of()
    assert len(pieces) == 10
    original = req.view.copy()
    for n, i in enumerate(finish_order):
        assert not req.done and req.completion.calls == []
        pieces[i].complete()
        assert pieces[i].done == req.done == (n == len(pieces) - 1)
    assert req.completion.calls == [None] and req.error is None
    np.testing.assert_array_equal(req.view, original)


@pytest.mark.parametrize('dtype', DTYPES)
def test_a_piece_error_fails_the_request_poisoned_after_its_last_piece(dtype):
    req, pieces = pieces_of(dtype)
    original = req.view.copy()
    first, second = RuntimeError('piece 3 failed'), RuntimeError('piece 6 failed too')
    pieces[3].error, pieces[6].error = first, second
    for i in (3, 0, 6, 1, 2, 4, 5, 7, 8):
        pieces[i].complete()
        assert req.error is first        # the first error is the request's
        np.testing.assert_array_equal(req.view, original)   # no poison before the last
        assert req.completion.calls == [] and not req.done
    pieces[9].complete()
    assert req.done and len(req.completion.calls) == 1
    message = req.completion.calls[0]
    assert 'collective #7' in message and 'piece 3 failed' in message
    poison = poison_value(dtype)
    if np.dtype(dtype).kind == 'f':
        assert np.isnan(req.view).all()
    else:
        assert (req.view == poison).all()


def test_pieces_completed_from_several_threads_complete_the_request_once():
    for _ in range(20):
        req, pieces = pieces_of(count=4000, per_piece=25)    # 160 pieces
        start = threading.Barrier(8)

        def finish(mine, start=start):
            start.wait()
            for piece in mine:
                piece.complete()

        threads = [threading.Thread(target=finish, args=(pieces[t::8],)) for t in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert req.done and req.completion.calls == [None]


def test_timeline_keeps_a_requests_marks_for_pieces_that_finish_out_of_order(tmp_path):
    """Concurrent's lanes may finish a request's last piece before its first: every piece's
    event still starts at the request's push, and nothing is left behind."""
    import json

    from mpi_kvstore.comm.timeline import Timeline
    req = Collective('allreduce', 'w', np.dtype('float32'), (8,), seq=0,
                     view=np.zeros(8, np.float32))
    timeline = Timeline(str(tmp_path / 't.json'), 0, 1)
    timeline.pushed(req)
    timeline.ready(req)
    first, second = cut(req, 16)
    timeline.started([first])
    timeline.started([second])
    timeline.finished([second])
    timeline.finished([first])
    timeline.write()
    events = [e for e in json.load(open(timeline.path))['traceEvents'] if e.get('ph') == 'X']
    queued = {e['args']['piece']: e for e in events if e['name'] == 'QUEUED'}
    assert sorted(queued) == [0, 1]
    assert queued[0]['ts'] == queued[1]['ts'] and queued[0]['dur'] > 0
    assert timeline._marks == {} and timeline._pieces_done == {}


def test_the_queue_cuts_and_credits_by_its_knobs_as_they_stand_after_a_switch():
    """autotune switches the design's knobs, not the queue: the next add cuts by the new
    partition_bytes, the next take credits by the new credit_bytes, and the queue's own
    sizes cannot be written."""
    knobs = Knobs(partition_bytes=0, credit_bytes=0)
    queue = Queue(knobs)
    first = request(0, 10000)                            # 40000 B
    queue.add([first])
    assert queue.take() == [first]                       # not cut, all taken
    knobs.switch(4096, 8192)
    assert (queue.partition_bytes, queue.credit_bytes) == (4096, 8192)
    with pytest.raises(AttributeError):
        queue.partition_bytes = 0
    second = request(1, 10000)
    queue.add([second])
    # 4096 B of float32: pieces of 1024 values; two of them fit in 8192 B
    assert [(u.seq, u.index, u.extent) for u in queue.take()] == [(1, 0, 1024), (1, 1, 1024)]
    knobs.switch(0, 0)                                   # credit 0: the rest at once
    rest = queue.take()
    assert [u.index for u in rest] == list(range(2, 10))
    assert sum(u.extent for u in rest) == 10000 - 2 * 1024
