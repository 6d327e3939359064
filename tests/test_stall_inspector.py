"""The stall inspector's talk with the other ranks, in one process: a fake communicator
stands for rank 1's inspector, which answers late or on time as each test says.

A rank whose answer to one query came after the inspector stopped waiting (busy for a few
seconds: compiling the native ops with the GIL held, or starved on a loaded machine) is
alive; the next report must wait for it and say what it pushed, not "no answer".
"""
import types

import pytest

from mpi_kvstore.comm.mpiabi import MPI
from mpi_kvstore.config import Config
from mpi_kvstore.faults import stall

pytestmark = pytest.mark.unit

STALLED_SEQ = 11


class _Message:
    def __init__(self, payload):
        self._payload = payload

    def recv(self):
        return self._payload


class _Sent:
    def Test(self):  # mpi4py's name
        return True


class FakeComm:
    """Rank 0 of 2. Rank 1's answers to the queries sent to it are delivered when the
    test releases them (``answer``), or at once when ``prompt`` is set."""

    def __init__(self, rank1_state):
        self.rank1_state = rank1_state
        self.prompt = False
        self.queries = []     # query ids sent to rank 1, in order
        self.inbox = []       # (source, tag, payload) not yet received

    def isend(self, payload, dest, tag):
        assert (dest, tag) == (1, stall.QUERY), (dest, tag)
        self.queries.append(payload)
        if self.prompt:
            self.answer(payload)
        return _Sent()

    def answer(self, query):
        self.inbox.append((1, stall.REPLY, (query, self.rank1_state)))

    def improbe(self, source, tag, status):
        if not self.inbox:
            return None
        src, tag_, payload = self.inbox.pop(0)
        status.Set_source(src)
        status.Set_tag(tag_)
        return _Message(payload)


class _Request:
    seq, done = STALLED_SEQ, False

    def describe(self):
        return "collective #%d (allreduce of key 'w', shape (16,), dtype float32)" % self.seq


def _inspector(monkeypatch, comm):
    """An inspector of rank 0 of 2 with no thread, talking through COMM."""
    monkeypatch.setattr(stall, 'REPLY_TIMEOUT', 0.2)
    design = types.SimpleNamespace(pushed=STALLED_SEQ + 1)
    # both thresholds 0: no thread is started; the test drives it
    inspector = stall.StallInspector(MPI.COMM_SELF, Config(environ={
        'MPI_KVSTORE_STALL_WARNING': '0', 'MPI_KVSTORE_STALL_ABORT': '0'}), design,
        lambda: [_Request()])
    inspector._size, inspector._comm = 2, comm
    return inspector


def _rank1_part(states):
    return stall.who_pushed(STALLED_SEQ, 2, states)


def test_a_rank_that_answered_late_is_waited_for_next_time(monkeypatch):
    comm = FakeComm(rank1_state=(STALLED_SEQ, []))   # rank 1 has not pushed #11
    inspector = _inspector(monkeypatch, comm)
    first = inspector._gather()          # rank 1 busy: no answer within REPLY_TIMEOUT
    assert sorted(first) == [0]
    assert _rank1_part(first) == 'pushed by rank 0; ' + stall.NO_ANSWER % 'rank 1'
    comm.answer(comm.queries[0])         # ... its answer comes after all
    comm.prompt = True                   # and from now on it answers within its period
    inspector._serve()                   # the inspector's next look files what arrived
    second = inspector._gather()
    assert second[1] == (STALLED_SEQ, [])
    assert _rank1_part(second) == 'pushed by rank 0; not pushed by rank 1'
    assert len(comm.queries) == 2


def test_a_rank_that_never_answers_is_not_waited_for_again(monkeypatch):
    comm = FakeComm(rank1_state=(STALLED_SEQ, []))   # rank 1 finished: it never answers
    inspector = _inspector(monkeypatch, comm)
    polls = []
    real_wait = inspector._stop.wait

    def counting_wait(timeout):
        polls.append(timeout)
        return real_wait(timeout)

    monkeypatch.setattr(inspector._stop, 'wait', counting_wait)
    assert sorted(inspector._gather()) == [0]
    waited = len(polls)
    assert waited >= 1                                 # it waited for rank 1 once
    for _ in range(3):
        assert sorted(inspector._gather()) == [0]
    assert len(polls) == waited                        # and never again
    assert len(comm.queries) == 4                      # though it still asks


def test_the_report_names_a_late_rank_as_not_pushed(monkeypatch):
    """The whole look: a warning after a late answer says rank 1 has not pushed #11."""
    comm = FakeComm(rank1_state=(STALLED_SEQ, []))
    inspector = _inspector(monkeypatch, comm)
    inspector._gather()                   # e.g. a probe while rank 1 was busy
    comm.answer(comm.queries[0])
    comm.prompt = True
    inspector._serve()
    stalled = [(_Request(), 2.5)]
    report = inspector._report(stalled, 'HEAD')
    assert ("collective #11 (allreduce of key 'w', shape (16,), dtype float32): waiting 2.5 s; "
            'pushed by rank 0; not pushed by rank 1') in report
    assert 'rank 1 has pushed 11 collectives and waits on none' in report
