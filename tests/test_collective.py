"""comm.collective.Collective: complete when made, read-only from outside, changed only by its
own methods (the designs, the reducer and the sharded optimizer call them)."""
import zlib

import numpy as np
import pytest

from mpi_kvstore.comm.collective import SIG_LIMIT, Collective

# every public attribute, with a value of the right sort to try to write
FIELDS = {'kind': 'bcast', 'key': 'other', 'dtype': np.dtype('f8'), 'shape': (6,),
          'nbytes': 8, 'root': 1, 'place': 'gpu', 'array': None, 'fn': len, 'average': False,
          'unit': 1, 'codec': None, 'shard': False, 'in_place': False, 'mirror': True,
          'seq': 7, 'priority': 3, 'sig': 11, 'view': np.zeros(6, 'f4'),
          'scratch': np.zeros(6, 'f4'), 'completion': None, 'waiter': None, 'result': 5,
          'error': RuntimeError('x'), 'done': True}


def _crc(text):
    """The signature by hand: CRC-32 of the description, below 2**30."""
    return zlib.crc32(text.encode()) % (1 << 30)


class _Completion:
    def __init__(self):
        self.calls = []

    def done(self, err):
        self.calls.append(err)


def _made():
    return Collective('reducescatter', 'w', np.dtype('float32'), (2, 3), root=0,
                      average=True, place='cpu', unit=3, shard=True, in_place=True)


def test_fields_are_set_by_construction():
    req = _made()
    assert (req.kind, req.key, req.dtype, req.shape, req.root) == (
        'reducescatter', 'w', np.dtype('float32'), (2, 3), 0)
    assert req.nbytes == 24 and req.extent == 6           # 2 * 3 float32
    assert (req.average, req.place, req.unit, req.shard, req.in_place, req.mirror) == (
        True, 'cpu', 3, True, True, False)
    # the unit joins the signature (fusion decides shares by it)
    assert req.sig == (_crc("reducescatter|'w'|float32|(2, 3)|0") * 31 + 3) % SIG_LIMIT
    assert (req.seq, req.priority, req.view, req.scratch, req.error, req.done) == (
        -1, 0, None, None, None, False)


@pytest.mark.parametrize('name', sorted(FIELDS))
def test_outside_code_cannot_assign_an_attribute(name):
    req = _made()
    before = getattr(req, name)
    with pytest.raises(AttributeError):
        setattr(req, name, FIELDS[name])
    assert getattr(req, name) is before


def test_no_attribute_can_be_added():
    with pytest.raises(AttributeError):
        _made().priority_hint = 1


def test_numbered_once_with_the_priority_in_the_signature():
    req = _made()
    unmarked = req.sig
    req.number(4, -2)
    assert (req.seq, req.priority) == (4, -2)
    assert req.sig == (unmarked * 31 - 2) % SIG_LIMIT
    with pytest.raises(RuntimeError, match='already numbered'):
        req.number(5, 0)
    assert (req.seq, req.priority, req.sig) == (4, -2, (unmarked * 31 - 2) % SIG_LIMIT)


def test_a_mirror_is_complete_when_made():
    """join.mirror gives the active rank's seq, priority, signature and zeros."""
    zeros = np.zeros(4, np.float32)
    req = Collective('allreduce', 'g', np.dtype('float32'), (4,), priority=2, sig=12345,
                     seq=9, mirror=True, view=zeros)
    assert (req.seq, req.priority, req.sig, req.mirror) == (9, 2, 12345, True)
    assert req.view is zeros and req.buffer() is zeros
    with pytest.raises(RuntimeError):
        req.number(10, 0)


def test_a_failure_is_recorded_poisoned_and_completed_through_methods():
    values = np.arange(6, dtype=np.float32)
    req = _made()
    completion = _Completion()
    req.attach(values)
    req.complete_with(completion)
    assert req.view is values and req.buffer() is values
    err = RuntimeError('lost a rank')
    req.fail(err)
    req.complete()
    assert req.error is err and req.done and req.wait(0)
    assert np.isnan(values).all()                      # the output is poisoned
    assert len(completion.calls) == 1 and 'lost a rank' in completion.calls[0]
    assert 'collective #-1 (reducescatter' in completion.calls[0]


def test_a_success_completes_with_no_error_and_keeps_the_values():
    values = np.arange(6, dtype=np.float32)
    req = _made()
    completion = _Completion()
    req.attach(values)
    req.complete_with(completion)
    req.complete()
    assert completion.calls == [None] and req.done
    np.testing.assert_array_equal(values, np.arange(6, dtype=np.float32))


def test_withdrawn_without_memory_it_sends_zeros_and_mismatches():
    array = np.ones((2, 3), np.float32)            # never read: no view
    req = Collective('allreduce', 'w', np.dtype('float32'), (2, 3), array=array, place='cpu')
    req.number(0, 0)
    numbered = req.sig
    req.withdraw()
    np.testing.assert_array_equal(req.scratch, np.zeros(6, np.float32))
    assert req.buffer() is req.scratch
    assert req.sig == (numbered + (1 << 29)) % (1 << 30) != numbered
    on_device = np.full(6, 0.0, np.float64)            # the reducer moves it elsewhere
    req.use_scratch(on_device)
    assert req.scratch is on_device


def test_withdrawn_after_its_read_it_sends_its_view():
    req = _made()
    values = np.arange(6, dtype=np.float32)
    req.attach(values)
    req.withdraw()
    assert req.scratch is None and req.buffer() is values


def test_a_custom_collective_keeps_its_result_and_waits_by_its_waiter():
    req = Collective('custom', '__size__', fn=lambda mpi: mpi * 2)
    req.run_custom(21)
    assert req.result == 42
    asked = []
    req.wait_with(lambda r, timeout: asked.append((r, timeout)) or 'waited')
    assert req.waiter is not None and req.wait(1.5) == 'waited' and asked == [(req, 1.5)]
    req.finish()
    assert req.wait(0) is True and asked == [(req, 1.5)]   # done: the waiter is not asked
