"""A repeated round's data beside its agreement (designs/repeat.py): the rule in one process
(MPI.COMM_SELF), and scenarios/kv_repeat.py on every design: repeated steps sum as numpy
does, the bet is taken on a repeated lone call and falls back on another shape or dtype,
and a mismatch in an armed round still fails on every rank naming each rank's shape.
"""
import numpy as np
import pytest

from mpi_kvstore import debug
from mpi_kvstore.comm import agreement
from mpi_kvstore.comm.collective import SIG_LIMIT
from mpi_kvstore.designs import NAMES, NEGOTIATED_NAMES
from mpi_kvstore.designs.repeat import MAX_BYTES, Repeat

from mpi_harness import result, run_designs, run_mpi


class _Req:
    """What a bet reads of a request (collective.Collective's fields)."""

    def __init__(self, seq, sig, values, average=False, kind='allreduce', place='cpu'):
        self.seq, self.sig, self.kind, self.place = seq, sig, kind, place
        self.view = np.array(values)
        self.dtype, self.nbytes = self.view.dtype, self.view.nbytes
        self.average, self.codec, self.error, self.mirror = average, None, None, False
        self.completed = 0

    def buffer(self):
        return self.view

    def complete(self):
        self.completed += 1


def _round(repeat, offer, base=0, window=8, bad_slot=None, joined=False, queued=False):
    """One round as negotiated.py runs it, the MIN over one rank: -> delivered or None."""
    from mpi4py import MPI
    msg = np.zeros(agreement.HEADER + 2 * window, dtype=np.int32)
    agreement.window_message(msg, {s: r.sig for s, r in offer.items()}, base, joined)
    if bad_slot is not None:   # another rank's signature there: the MIN decodes two values
        msg[agreement.HEADER + window + bad_slot] = SIG_LIMIT - 1
    repeat.start(MPI.COMM_SELF, offer, base)
    repeat.wait()
    agreed, bad = agreement.window_result(msg)
    return repeat.settle(msg, agreed, bad, offer, base, queued)


def _offer(base, values, sigs=(11, 12), dtype='float32', average=False):
    return {base + i: _Req(base + i, sig, np.array(v, dtype=dtype), average)
            for i, (sig, v) in enumerate(zip(sigs, values))}


def test_a_round_repeated_twice_arms_the_bet_and_the_third_runs_with_the_agreement():
    repeat = Repeat(size=2, poll_us=50)
    for step in range(2):   # the round seen once, then repeated: no bet yet
        assert _round(repeat, _offer(2 * step, [[1.0, 2.0], [3.0]]), base=2 * step) is None
    offer = _offer(4, [[5.0, 6.0], [7.0]], average=True)
    offer[5].average = False
    before = debug.snapshot()
    done = _round(repeat, offer, base=4)
    assert debug.since(before, 'repeat') == {'won': 1}
    assert [r.seq for r in done] == [4, 5] and all(r.completed == 1 for r in done)
    # one rank's sum (COMM_SELF); the averaged one divided by the 2 ranks the bet was made for
    np.testing.assert_array_equal(offer[4].view, [2.5, 3.0])
    np.testing.assert_array_equal(offer[5].view, [7.0])
    assert repeat.stats == {'won': 1, 'lost': 0}


@pytest.mark.parametrize('change', ['sig', 'dtype', 'mismatch', 'joined', 'queued', 'fewer'])
def test_a_round_that_does_not_repeat_is_left_to_the_ordinary_path(change):
    repeat = Repeat(size=2, poll_us=50)
    for step in range(2):
        _round(repeat, _offer(2 * step, [[1.0, 2.0], [3.0]]), base=2 * step)
    kw, offer = {}, _offer(4, [[5.0, 6.0], [7.0]])
    if change == 'sig':          # another shape or key: another signature
        offer = _offer(4, [[5.0, 6.0, 0.0], [7.0]], sigs=(11, 13))
    elif change == 'dtype':
        offer = _offer(4, [[5.0, 6.0], [7.0]], sigs=(11, 14), dtype='float64')
    elif change == 'mismatch':
        kw['bad_slot'] = 1
    elif change == 'joined':
        kw['joined'] = True
    elif change == 'queued':
        kw['queued'] = True
    else:
        offer.pop(5)
    before, counted = {s: r.view.copy() for s, r in offer.items()}, debug.snapshot()
    assert _round(repeat, offer, base=4, **kw) is None
    assert debug.since(counted, 'repeat') == {'lost': 1}
    assert repeat.stats == {'won': 0, 'lost': 1}
    for seq, req in offer.items():   # the user's data untouched, nothing completed
        np.testing.assert_array_equal(req.view, before[seq])
        assert req.completed == 0


def test_no_bet_on_a_large_round_a_broadcast_or_an_unsupported_dtype():
    for offer in (_offer(0, [np.zeros(MAX_BYTES // 4 + 1)], sigs=(11,)),
                  _offer(0, [[1.0]], sigs=(11,), dtype='float16')):
        repeat = Repeat(size=2, poll_us=50)
        for step in range(3):
            assert _round(repeat, {s + step: r for s, r in offer.items()}, base=step) is None
        assert repeat.stats == {'won': 0, 'lost': 0}
    repeat = Repeat(size=2, poll_us=50)
    for step in range(3):
        offer = _offer(step, [[1.0]], sigs=(11,))
        offer[step].kind = 'bcast'
        assert _round(repeat, offer, base=step) is None
    assert repeat.stats == {'won': 0, 'lost': 0}


def check(out, design, nprocs):
    assert 'kv_repeat[%s]: OK at %d ranks' % (design, nprocs) in out, out[-3000:]
    sums = result(out, 'kv_repeat[%s]' % design)['ranks']
    for rank, seen in enumerate(sums):
        steps = [what for what in seen['checked'] if what.startswith('step')]
        assert len(steps) >= 20, (rank, steps)
        for what, got in seen['checked'].items():
            assert got == seen['expected'][what], (rank, what, got, seen['expected'][what])
    info = result(out, 'kv_repeat_info')['ranks']
    shapes = ['rank %d has shape (%d,) float32' % (r, 4 + r) for r in range(nprocs)]
    for rank, said in enumerate(info):
        assert said['mismatch'] is not None and "key 'odd'" in said['mismatch'], said
        for words in shapes:
            assert words in said['mismatch'], (rank, words, said['mismatch'])
        if design in NEGOTIATED_NAMES:
            assert said['counters'] == {'repeated': {'won': 3, 'lost': 0},
                                        'shape': {'won': 0, 'lost': 1},
                                        'again': {'won': 1, 'lost': 0},
                                        'dtype': {'won': 0, 'lost': 1}}, said
        else:
            assert said['counters'] == {k: None for k in ('repeated', 'shape', 'again', 'dtype')}


@pytest.mark.parametrize('design', NAMES)
def test_repeated_rounds_sum_right_and_fall_back(design, designs):
    out = run_designs(2, 'kv_repeat.py', design, designs, '12', timeout=240)
    check(out, design, 2)


def test_repeated_rounds_at_three_ranks(mpi_available):
    out = run_mpi(3, 'kv_repeat.py', 'funneled', '8', timeout=300)
    check(out, 'funneled', 3)
