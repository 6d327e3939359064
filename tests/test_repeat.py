"""A repeated round's data beside its agreement (designs/repeat.py): the rule in one process
(MPI.COMM_SELF), and scenarios/kv_repeat.py on every design: repeated steps of several rounds
sum as numpy does, the bet is taken on a repeated lone call and on a repeating pattern of
bursts, and falls back on another shape, dtype or pattern, and a mismatch in an armed round
still fails on every rank naming each rank's shape.
"""
import time

import numpy as np
import pytest

from mpi_kvstore import debug
from mpi_kvstore.comm import agreement
from mpi_kvstore.comm.collective import SIG_LIMIT
from mpi_kvstore.designs import NAMES, NEGOTIATED_NAMES
from mpi_kvstore.designs.repeat import (
    GATHER_S,
    MAX_BYTES,
    MAX_PAUSE_S,
    PAUSE_S,
    REQUEST_BYTES,
    Repeat,
)

from mpi_harness import result, run_designs, run_mpi


class _Req:
    """What a bet reads of a request (collective.Collective's fields)."""

    def __init__(self, seq, sig, values, average=False, kind='allreduce', place='cpu'):
        self.seq, self.sig, self.kind, self.place = seq, sig, kind, place
        self.view = np.array(values)
        self.dtype, self.nbytes = self.view.dtype, self.view.nbytes
        self.average, self.codec, self.error, self.mirror = average, None, None, False
        self.factor = 1.0
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


def test_a_pattern_of_rounds_is_predicted_from_what_followed_each_round_last_time():
    repeat = Repeat(size=2, poll_us=50)
    # round A: two requests at slots 0 and 1; round B: one of another key at slot 0
    pattern = [((11, 12), [[1.0, 2.0], [3.0]]), ((21,), [[4.0, 5.0, 6.0]])]
    seen, base = [], 0
    for _ in range(4):
        for sigs, values in pattern:
            offer = _offer(base, values, sigs=sigs)
            done = _round(repeat, offer, base=base)
            seen.append(None if done is None else [r.seq - base for r in done])
            if done is not None:   # one rank's sum (COMM_SELF): the values themselves
                for req, want in zip(offer.values(), values):
                    np.testing.assert_array_equal(req.view, want)
            base += len(sigs)
    # A, B learn B after A; the second A learns A after B and bets on B; then every round
    assert seen == [None, None, None, [0], [0, 1], [0], [0, 1], [0]]
    assert repeat.stats == {'won': 5, 'lost': 0}


def test_a_bet_that_the_round_covers_delivers_its_part_the_rest_runs_as_before():
    repeat = Repeat(size=2, poll_us=50)
    for step in range(2):
        _round(repeat, _offer(2 * step, [[1.0, 2.0], [3.0]]), base=2 * step)
    offer = _offer(4, [[5.0, 6.0], [7.0], [8.0]], sigs=(11, 12, 13))   # one more agreed
    done = _round(repeat, offer, base=4)
    assert [r.seq for r in done] == [4, 5] and offer[6].completed == 0
    np.testing.assert_array_equal(offer[6].view, [8.0])
    assert repeat.stats == {'won': 1, 'lost': 0}


def test_a_large_round_is_bet_on_up_to_the_bound_and_a_mixed_one_up_to_its_first_dtype():
    big = np.arange(MAX_BYTES // 4 // 3, dtype=np.float32)       # 3 of them are 1 MB or more
    assert 3 * big.nbytes > 64 * 1024
    repeat = Repeat(size=2, poll_us=50, request_bytes=MAX_BYTES)
    for step in range(3):
        offer = _offer(3 * step, [big + step, big, big * 2], sigs=(11, 12, 13))
        done = _round(repeat, offer, base=3 * step)
    assert [r.seq for r in done] == [6, 7, 8] and repeat.stats['won'] == 1
    np.testing.assert_array_equal(offer[6].view, big + 2)
    bounded = Repeat(size=2, poll_us=50, max_bytes=2 * big.nbytes,   # room for two only
                     request_bytes=MAX_BYTES)
    for step in range(3):
        offer = _offer(3 * step, [big, big, big], sigs=(11, 12, 13))
        done = _round(bounded, offer, base=3 * step)
    assert [r.seq for r in done] == [6, 7] and offer[8].completed == 0
    mixed = Repeat(size=2, poll_us=50)
    for step in range(3):
        offer = _offer(2 * step, [[1.0], [2.0]], sigs=(11, 12))
        offer[2 * step + 1] = _Req(2 * step + 1, 12, np.array([2.0]))   # float64 second
        done = _round(mixed, offer, base=2 * step)
    assert [r.seq for r in done] == [4] and mixed.stats == {'won': 1, 'lost': 0}


def test_a_request_larger_than_request_bytes_runs_in_place_not_in_the_bet():
    big = np.arange(REQUEST_BYTES // 4 + 1, dtype=np.float32)   # one element over the bound
    repeat = Repeat(size=2, poll_us=50)
    for step in range(3):
        offer = _offer(2 * step, [[1.0, 2.0], big], sigs=(11, 12))
        done = _round(repeat, offer, base=2 * step)
    assert [r.seq for r in done] == [4] and offer[5].completed == 0   # the big one: as before
    np.testing.assert_array_equal(offer[4].view, [1.0, 2.0])
    alone = Repeat(size=2, poll_us=50)
    for step in range(3):
        assert _round(alone, _offer(step, [big], sigs=(12,)), base=step) is None
    assert alone.stats == {'won': 0, 'lost': 0}


def test_a_bet_of_many_requests_averages_and_copies_back_each_one():
    repeat = Repeat(size=2, poll_us=50)
    values = [np.arange(n, dtype=np.float64) + n for n in (1, 3, 7, 2, 5, 4, 6, 8, 9, 10)]
    sigs = tuple(range(20, 30))
    for step in range(3):
        offer = _offer(10 * step, values, sigs=sigs, dtype='float64', average=True)
        done = _round(repeat, offer, base=10 * step, window=16)
    assert [r.seq for r in done] == list(range(20, 30)) and repeat.stats['won'] == 1
    for req, v in zip(done, values):   # the MIN over one rank: the sum is the data, / 2
        np.testing.assert_array_equal(req.view, v / 2)
        assert req.completed == 1


def test_a_rank_holding_part_of_the_predicted_round_waits_for_the_rest_not_longer():
    repeat = Repeat(size=2, poll_us=50)
    for step in range(3):
        _round(repeat, _offer(3 * step, [[1.0], [2.0], [3.0]], sigs=(11, 12, 13)), base=3 * step)
    full = _offer(9, [[1.0], [2.0], [3.0]], sigs=(11, 12, 13))
    part = {9: full[9]}
    waits = []

    def refresh():   # the rest turns ready after the first wait
        return full if waits else part
    assert repeat.missing(part, 9) and not repeat.missing(full, 9)
    assert repeat.gather(part, 9, waits.append, refresh) is full and len(waits) == 1
    assert 0 < waits[0] <= GATHER_S + 1e-9
    waits.clear()

    def wait(seconds):   # as the waker's: nothing comes within the time asked
        waits.append(seconds)
        time.sleep(seconds)
    assert repeat.gather(part, 9, wait, lambda: part, budget=0.001) is part
    assert waits and all(0 < w <= 0.001 + 1e-9 for w in waits)
    other = _offer(9, [[1.0]], sigs=(99,))   # none of the predicted round: no wait
    assert repeat.gather(other, 9, waits.append, refresh) is other


def test_gather_pauses_after_a_wake_up_by_what_is_still_lacking_then_looks_again():
    repeat = Repeat(size=2, poll_us=50)
    values = [[float(i)] for i in range(6)]
    for step in range(3):
        _round(repeat, _offer(6 * step, values, sigs=tuple(range(11, 17))), base=6 * step)
    full = _offer(18, values, sigs=tuple(range(11, 17)))
    arrivals = [{s: full[s] for s in list(full)[:n]} for n in (1, 4, 6)]
    looks, pauses = [], []

    def refresh():   # two calls came after the first look, then the last two
        looks.append(1)
        return arrivals[len(looks)]
    got = repeat.gather(arrivals[0], 18, lambda seconds: None, refresh, sleep=pauses.append)
    assert got == full and len(looks) == 2
    # 5 lacking: 4 pauses' worth; then 2 lacking: 1; the last call waits for no pause
    assert pauses == pytest.approx([4 * PAUSE_S, PAUSE_S])
    assert all(p <= MAX_PAUSE_S for p in pauses)


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
            # 'again': lone_shape followed lone last time, so the first call back bets on it
            assert said['counters'] == {'repeated': {'won': 3, 'lost': 0},
                                        'shape': {'won': 0, 'lost': 1},
                                        'again': {'won': 1, 'lost': 1},
                                        'dtype': {'won': 0, 'lost': 1}}, said
            # 3 rounds a step: from the third step on, each round was predicted and won; in a
            # step whose middle round changed, the first wins, the changed one loses and the
            # last is not bet on (nothing followed the changed round before)
            assert said['bursts'] == {'warm': {'won': 12, 'lost': 0},
                                      'changed': {'won': 1, 'lost': 1}}, said
        else:
            assert said['counters'] == {k: None for k in ('repeated', 'shape', 'again', 'dtype')}
            assert said['bursts'] == {'warm': None, 'changed': None}


@pytest.mark.parametrize('design', NAMES)
def test_repeated_rounds_sum_right_and_fall_back(design, designs):
    out = run_designs(2, 'kv_repeat.py', design, designs, '12', timeout=240)
    check(out, design, 2)


def test_repeated_rounds_at_three_ranks(mpi_available):
    out = run_mpi(3, 'kv_repeat.py', 'funneled', '8', timeout=300)
    check(out, 'funneled', 3)
