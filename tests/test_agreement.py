"""The agreement messages (mpi_kvstore.comm.agreement), with the MPI MIN done by numpy."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpi_kvstore.comm import agreement as ag
from mpi_kvstore.comm.collective import SIG_LIMIT


def _min(*msgs):
    return np.minimum.reduce([np.array(m) for m in msgs])


def test_group_same_requests_agree():
    msg = _min(ag.group_message([5, 9], rank=0), ag.group_message([5, 9], rank=1))
    assert not ag.group_mismatch(msg)
    assert ag.read_header(msg) == ag.Header(False, 0, False)


@pytest.mark.parametrize('other', [[9, 5], [5], [5, 9, 9], [5, 10]])
def test_group_any_difference_is_a_mismatch(other):
    msg = _min(ag.group_message([5, 9], rank=0), ag.group_message(other, rank=1))
    assert ag.group_mismatch(msg)


def test_group_joined_rank_is_invisible_and_reported():
    msg = _min(ag.group_message([7], rank=2), ag.group_message((), joined=True),
               ag.group_message([7], rank=1))
    assert not ag.group_mismatch(msg)
    assert ag.read_header(msg) == ag.Header(True, 1, False)
    mismatch = _min(ag.group_message([7], rank=2), ag.group_message((), joined=True),
                    ag.group_message([8], rank=1))
    assert ag.group_mismatch(mismatch)


def test_group_all_joined():
    msg = _min(ag.group_message((), joined=True), ag.group_message((), joined=True))
    assert ag.read_header(msg).all_joined


def _window(offer, base=10, window=8, joined=False, rank=0):
    msg = np.full(ag.HEADER + 2 * window, -5, dtype=np.int32)   # stale content is overwritten
    return ag.window_message(msg, offer, base, joined, rank)


def test_window_ready_everywhere_agreed_only():
    a = _window({10: 3, 11: 4, 13: 6})
    b = _window({10: 3, 12: 5, 13: 6}, rank=1)
    agreed, bad = ag.window_result(_min(a, b))
    assert (agreed, bad) == ([0, 3], [])


def test_window_different_signatures_at_one_slot():
    agreed, bad = ag.window_result(_min(_window({10: 3, 11: 4}), _window({10: 3, 11: 9})))
    assert (agreed, bad) == ([0], [1])


def test_window_joined_rank_offers_a_wildcard_everywhere():
    joined = _window({}, joined=True, rank=1)
    assert (joined[ag.HEADER:] == ag.WILDCARD).all()
    msg = _min(_window({10: 3, 12: 5}), joined, _window({10: 3, 12: 5, 13: 1}, rank=2))
    assert ag.window_result(msg) == ([0, 2], [])
    assert ag.read_header(msg) == ag.Header(True, 0, False)
    assert ag.read_header(_min(joined, _window({}, joined=True))).all_joined


def test_signature_limits_fit_the_encoding():
    # sig + 1 and SIG_LIMIT - sig stay positive int32 below the wildcard
    for sig in (0, SIG_LIMIT - 1):
        msg = _window({10: sig})
        assert 0 < msg[ag.HEADER] < ag.WILDCARD and 0 < msg[ag.HEADER + 8] < ag.WILDCARD
        assert ag.window_result(msg) == ([0], [])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.none(), st.dictionaries(st.integers(0, 39), st.integers(0, 3),
                                                      max_size=20)), min_size=1, max_size=4))
def test_window_result_from_the_offered_slots_equals_the_whole_scan(offers):
    """An active rank reads only the slots it offered (few one by one, many with numpy):
    the same agreed and mismatched slots as a scan of the whole window, with the burst's
    numpy-filled message equal to the one filled slot by slot. ``None``: a joined rank."""
    base, window = 100, 40
    msgs = []
    for r, offer in enumerate(offers):
        msg = np.zeros(ag.HEADER + 2 * window, dtype=np.int32)
        ag.window_message(msg, {base + s: sig for s, sig in (offer or {}).items()}, base,
                          joined=offer is None, rank=r)
        if offer:
            slow = np.zeros_like(msg)
            slow[:ag.HEADER] = (1, r)
            for s, sig in offer.items():
                slow[ag.HEADER + s], slow[ag.HEADER + window + s] = sig + 1, SIG_LIMIT - sig
            np.testing.assert_array_equal(msg, slow)
        msgs.append(msg)
    msg = _min(*msgs)
    whole = ag.window_result(msg)
    for offer in offers:
        if offer is not None:
            assert ag.window_result(msg, list(offer)) == whole
    if all(offer is not None for offer in offers):   # agreed: offered everywhere, one sig
        common = set.intersection(*(set(o) for o in offers))
        assert sorted(whole[0] + whole[1]) == sorted(common)
        assert whole[0] == sorted(s for s in common if len({o[s] for o in offers}) == 1)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.none(), st.lists(st.integers(0, 3), max_size=3)), min_size=1,
                max_size=4))
def test_runs_as_offered_is_no_join_and_no_mismatch(offers):
    """The chained native op's fast test equals the full reading, on every active rank;
    ``None`` is a rank that joined."""
    msgs = [ag.group_message((), joined=True) if sigs is None
            else ag.group_message(sigs, rank=r) for r, sigs in enumerate(offers)]
    msg = _min(*msgs)
    head = ag.read_header(msg)
    for mine, sigs in zip(msgs, offers):
        if sigs is not None:
            assert ag.runs_as_offered(msg, mine) == (
                not head.someone_joined and not ag.group_mismatch(msg))


def test_runs_as_offered_compiles_to_the_same_answers():
    """The function compiled into the native op (numba) answers as it does in Python."""
    from mpi_kvstore.engine import native  # imports MXNet: the compiled one sits beside the op
    mine = ag.group_message([5, 9], rank=1)
    for other in ([5, 9], [9, 5], [5], [5, 9, 9], [], None):
        theirs = (ag.group_message((), joined=True) if other is None
                  else ag.group_message(other, rank=0))
        msg = _min(mine, theirs)
        assert native.runs_as_offered(msg, mine) == ag.runs_as_offered(msg, mine) == (
            other == [5, 9])
