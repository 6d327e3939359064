"""The tune table's device rows for the other collectives (``device_ops``), without MPI jobs
or a GPU: the rows round-trip through JSON, tables without them still load, bad rows name
what is wrong; and a Comm with a table sends each op's device buffers through the row's
transport for their size (stand-in transports record what ran), with the bucket's stream
(reduce._scope) on the transport that runs the op. test_gpu.py runs the real transports.
"""
import contextlib
import json
import sys
import types

import numpy as np
import pytest
from test_tune_ops import _OneRank  # what tuning.load asks of a communicator

from mpi_kvstore import debug
from mpi_kvstore.comm import transports, tuning
from mpi_kvstore.comm.collective import Collective
from mpi_kvstore.comm.fusion import pieces
from mpi_kvstore.comm.transports.base import REGISTRY, Transport
from mpi_kvstore.comm.tuning import OPS, Table
from mpi_kvstore.errors import ConfigError

SMALL, LARGE = 4096, 64 << 20
OLD = {'version': 1, 'comm_size': 2, 'measured_ms': {},
       'allreduce': [{'bytes': 4096, 'algorithm': 'mpi'}],
       'device': [{'bytes': SMALL, 'transport': 'staged'}, {'bytes': LARGE, 'transport': 'nccl'}]}
# Each op the other way round from allreduce's rows, so a fallback to those shows.
DEVICE_OPS = {op: [{'bytes': SMALL, 'transport': 'nccl'}, {'bytes': LARGE, 'transport': 'staged'}]
              for op in OPS}
NEW = dict(OLD, device_ops=DEVICE_OPS)
EDGE = 524288   # isqrt(4096 * 64M): from here on the large row decides


def test_device_ops_rows_round_trip_through_json():
    table = Table.from_json(json.loads(json.dumps(NEW)))
    again = Table.from_json(json.loads(json.dumps(table.to_json())))
    assert again.to_json()['device_ops'] == DEVICE_OPS
    assert again.to_json()['device'] == OLD['device']
    for op in OPS:
        assert [again.choose_device_op(op, n) for n in (1, EDGE - 1, EDGE, 1 << 40)] == \
            ['nccl', 'nccl', 'staged', 'staged'], op
    assert again.choose_device(1) == 'staged'   # allreduce's own rows, untouched


def test_a_table_without_device_ops_rows_still_loads(tmp_path):
    path = tmp_path / 'old.json'
    path.write_text(json.dumps(OLD))
    reading = tuning.read(str(path))
    assert reading.error is None, reading.error
    table = Table.from_json(reading.payload)
    assert table.device_ops == {} and 'device_ops' not in table.to_json()
    assert [table.choose_device_op(op, 1) for op in OPS] == [None] * len(OPS)
    with pytest.raises(ValueError, match=r"'allscatter'.*broadcast"):
        table.choose_device_op('allscatter', 1)


@pytest.mark.parametrize('rows, words', [
    ({'allscatter': [{'bytes': 1, 'transport': 'nccl'}]}, ["'allscatter'", 'alltoall']),
    ({'broadcast': [{'bytes': 4096, 'transport': 'gloo'}]},
     ['broadcast', "'gloo'", '4096', 'staged']),
    ({'allgather': [{'bytes': LARGE, 'transport': 'nccl'}, {'bytes': SMALL, 'transport': 'staged'}]},
     ['allgather', 'increase', '%d follows %d' % (SMALL, LARGE)]),
    ({'allgather': [{'bytes': SMALL, 'transport': 'nccl'}, {'bytes': SMALL, 'transport': 'staged'}]},
     ['allgather', 'increase']),
    ({'reducescatter': [{'bytes': -1, 'transport': 'nccl'}]}, ['reducescatter', '>= 0', '-1']),
    ({'reducescatter': [{'bytes': 1.5, 'transport': 'nccl'}]}, ['reducescatter', 'whole', '1.5']),
    ({'alltoall': []}, ['alltoall', 'a row per size']),
    ({'alltoall': [{'bytes': 1}]}, ['alltoall', '"transport"']),
    ([['broadcast']], ['device_ops must be an object']),
])
def test_a_bad_device_ops_row_names_the_op_and_what_is_wrong(tmp_path, rows, words):
    path = tmp_path / 'bad.json'
    path.write_text(json.dumps(dict(OLD, device_ops=rows)))
    reading = tuning.read(str(path))
    assert reading.error is not None and reading.error.startswith('ValueError: ')
    for word in words:
        assert word in reading.error, (word, reading.error)


def test_loading_a_bad_device_ops_row_raises_config_error(tmp_path, monkeypatch):
    monkeypatch.setattr(tuning, 'check', lambda *args: None)   # the ranks' agreement: MPI
    path = tmp_path / 'table.json'
    path.write_text(json.dumps(dict(OLD, device_ops={'broadcast': [
        {'bytes': 1, 'transport': 'carrier-pigeon'}]})))
    with pytest.raises(ConfigError, match="device_ops broadcast: unknown GPU transport "
                                          "'carrier-pigeon'"):
        tuning.load(str(path), _OneRank(2))


def test_doctor_shows_each_ops_gpu_transport(tmp_path):
    from mpi_kvstore.cli import doctor
    path = tmp_path / 'table.json'
    path.write_text(json.dumps(dict(OLD, device_ops={'broadcast': DEVICE_OPS['broadcast']})))
    lines = doctor._tune_table(types.SimpleNamespace(tune_table=str(path), gpu_transport='auto'))
    assert '  GPU allreduce:  4K staged, 64M nccl' in lines, lines
    assert '  GPU broadcast:  4K nccl, 64M staged' in lines, lines
    for op in ('allgather', 'reducescatter', 'alltoall'):   # no rows: allreduce's, said so
        assert '  %-15s as allreduce' % ('GPU %s:' % op) in lines, lines
    lines = doctor._tune_table(types.SimpleNamespace(tune_table=str(path), gpu_transport='staged'))
    assert '  GPU broadcast:  4K nccl, 64M staged (gpu_transport=staged wins)' in lines, lines


# -- the choice: a real Comm (on COMM_SELF, told it has 2 ranks) over stand-in transports --

RAN = []          # (op, transport, nbytes, the transport whose stream was current)
CURRENT = [None]  # the transport whose stream is current (reduce._scope enters it)


class _Device:
    id = 0

    @staticmethod
    def synchronize():
        pass


class DeviceArray:
    """What Comm and Reducer read of a CuPy array, over numpy memory; the module name
    makes fusion.BufferPool treat it as CuPy's (the fake 'cupy' below makes its buffers)."""
    __module__ = 'cupy'
    device = _Device()

    def __init__(self, host):
        self.host = host
        self.nbytes, self.shape, self.dtype, self.size = (host.nbytes, host.shape, host.dtype,
                                                          host.size)

    def __getitem__(self, index):
        return DeviceArray(self.host[index])

    def __setitem__(self, index, value):
        self.host[index] = value.host if isinstance(value, DeviceArray) else value

    def reshape(self, *shape):
        return DeviceArray(self.host.reshape(*shape))


class _Stream:
    def __init__(self, name):
        self.name = name

    def __enter__(self):
        CURRENT.append(self.name)

    def __exit__(self, *exc):
        CURRENT.pop()

    def synchronize(self):
        pass


class _StandIn(Transport):
    """A GPU transport's stand-in: it records what ran and computes what 2 ranks holding
    the same data would get (rank 0's view), in numpy."""

    def __init__(self, comm, device):   # no CuPy: no real stream, no device
        self.comm, self.device, self.stream = comm, device, _Stream(self.name)

    def _ran(self, op, buf):
        RAN.append((op, self.name, buf.nbytes, CURRENT[-1]))

    def allreduce(self, buf, algorithm='mpi'):
        self._ran('allreduce', buf)
        buf.host *= 2

    def bcast(self, buf, root):
        self._ran('broadcast', buf)

    def allgather(self, buf, counts, displs):
        self._ran('allgather', buf)

    def reduce_scatter(self, send, recv, counts):
        self._ran('reducescatter', send)
        recv.host[...] = 2 * send.host[:counts[0]]

    def alltoall(self, send, recv):
        self._ran('alltoall', send)
        piece = send.size // 2
        recv.host[...] = np.tile(send.host[:piece], 2)   # rank j's piece for rank 0

    def follow(self, other):
        pass

    def finish(self):
        pass


class _NCCL(_StandIn):
    name = 'nccl'


class _Staged(_StandIn):
    name = 'staged'


class _CudaMPI(_StandIn):
    name = 'cuda_mpi'

    @classmethod
    def usable(cls, comm):
        return False, 'not CUDA-aware'


@pytest.fixture
def stand_ins(monkeypatch):
    """The registry's transports replaced by stand-ins; the GPU-sharing check answered
    without CuPy (``shared[0]``); a fake 'cupy' module for reduce.py's scope."""
    for cls in (_NCCL, _CudaMPI, _Staged):
        monkeypatch.setitem(REGISTRY, cls.name, cls)
    shared = [False]
    monkeypatch.setattr(transports, 'devices_shared', lambda comm, device: shared[0])
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(
        Device=lambda device: contextlib.nullcontext()),
        empty=lambda count, dtype: DeviceArray(np.empty(count, dtype)),
        zeros=lambda count, dtype: DeviceArray(np.zeros(count, dtype)), float32=np.float32)
    monkeypatch.setitem(sys.modules, 'cupy', fake)
    RAN.clear()
    return shared


def _comm(table, gpu_transport='auto'):
    from mpi4py import MPI

    from mpi_kvstore.comm.host import Comm
    comm = Comm(MPI.COMM_SELF, 'off', table=table, gpu_transport=gpu_transport)
    comm.size = 2   # so device buffers are routed; the stand-ins run no MPI
    return comm


def _data(nbytes, seed):
    return np.random.default_rng(seed).standard_normal(nbytes // 4).astype(np.float32)


def _run_each_op(comm, nbytes):
    """Each op through the Comm on a device buffer of nbytes; checks the results against
    numpy (2 ranks, the same data on both) -> {op: transport name that ran}."""
    host = _data(nbytes, nbytes)
    counts, displs = pieces(host.size, 2)
    before = len(RAN)
    buf = DeviceArray(host.copy())
    comm.bcast(buf, 1)
    np.testing.assert_array_equal(buf.host, host)
    comm.allgather_in_place(buf, counts, displs)
    np.testing.assert_array_equal(buf.host, host)
    recv = DeviceArray(np.zeros(counts[0], np.float32))
    comm.reduce_scatter(buf, recv, counts)
    np.testing.assert_array_equal(recv.host, 2 * host[:counts[0]])
    out = DeviceArray(np.zeros_like(host))
    comm.alltoall(buf, out)
    np.testing.assert_array_equal(out.host, np.tile(host[:host.size // 2], 2))
    comm.allreduce(buf)
    np.testing.assert_array_equal(buf.host, 2 * host)
    ran = RAN[before:]
    assert [op for op, *_ in ran] == ['broadcast', 'allgather', 'reducescatter', 'alltoall',
                                      'allreduce'], ran
    return {op: name for op, name, *_ in ran}


@pytest.mark.parametrize('nbytes', [SMALL, EDGE - 8, EDGE, LARGE])
def test_each_op_takes_its_rows_transport_for_the_size(stand_ins, nbytes):
    comm = _comm(Table.from_json(NEW))
    try:
        before = debug.snapshot()
        ran = _run_each_op(comm, nbytes)
    finally:
        comm.free()
    other = 'nccl' if nbytes < EDGE else 'staged'
    assert ran == dict({op: other for op in OPS},
                       allreduce='staged' if nbytes < EDGE else 'nccl'), ran
    assert sum(debug.since(before, 'transport').values()) == 5


def test_ops_without_device_rows_take_allreduces_rows(stand_ins):
    table = Table.from_json(dict(OLD, device_ops={'broadcast': DEVICE_OPS['broadcast']}))
    comm = _comm(table)
    try:
        assert _run_each_op(comm, SMALL) == dict(broadcast='nccl', allgather='staged',
                                                 reducescatter='staged', alltoall='staged',
                                                 allreduce='staged')
        assert _run_each_op(comm, LARGE) == dict(broadcast='staged', allgather='nccl',
                                                 reducescatter='nccl', alltoall='nccl',
                                                 allreduce='nccl')
    finally:
        comm.free()


def test_a_named_gpu_transport_wins_over_the_rows(stand_ins):
    comm = _comm(Table.from_json(NEW), gpu_transport='staged')
    try:
        assert set(_run_each_op(comm, SMALL).values()) == {'staged'}
        assert set(_run_each_op(comm, LARGE).values()) == {'staged'}
    finally:
        comm.free()


def test_rows_naming_nccl_where_ranks_share_a_gpu_give_way_to_staged(stand_ins, caplog):
    """Two ranks on one GPU: NCCL cannot run, so every size of every op goes to auto's
    choice (staged) alike on every rank (the inputs are agreed), with a warning."""
    stand_ins[0] = True
    comm = _comm(Table.from_json(NEW))
    try:
        for nbytes in (SMALL, LARGE):
            assert set(_run_each_op(comm, nbytes).values()) == {'staged'}
    finally:
        comm.free()
    assert 'sends some sizes through nccl, which cannot run here' in caplog.text
    assert list(comm.router.built) == []   # freed


def _request(kind, host, root=0):
    return Collective(kind, kind, np.dtype(host.dtype), host.shape, root=root, place='gpu',
                      view=DeviceArray(host))


@pytest.mark.parametrize('nbytes', [SMALL, LARGE])
def test_a_device_buckets_stream_is_the_transport_that_runs_its_op(stand_ins, nbytes):
    """reduce._scope makes a transport's stream current by the bucket's op and size; the
    op must run through that same transport, else the copy back is not ordered after it."""
    from mpi_kvstore.comm.reduce import Reducer
    comm = _comm(Table.from_json(NEW))
    reducer = Reducer(2, None, None)
    host = _data(nbytes, 7)
    try:
        reducer.bcast(_request('bcast', host.copy(), root=1), comm)
        shares = _request('reducescatter', host.copy())
        reducer.reduce_scatter([shares], comm)
        counts, _ = pieces(host.size, 2)
        np.testing.assert_array_equal(shares.view.host[:counts[0]], 2 * host[:counts[0]])
        np.testing.assert_array_equal(shares.view.host[counts[0]:], host[counts[0]:])
        reducer.allgather([_request('allgather', host.copy())], comm)
        reducer.allreduce([_request('allreduce', host.copy())], comm)
    finally:
        comm.free()
    want = 'nccl' if nbytes < EDGE else 'staged'
    assert [(op, name) for op, name, _, _ in RAN] == [
        ('broadcast', want), ('reducescatter', want), ('allgather', want),
        ('allreduce', 'staged' if want == 'nccl' else 'nccl')], RAN
    assert all(name == current for _, name, _, current in RAN), RAN


def test_tune_times_each_op_through_each_transport_and_keeps_auto_by_the_margin(stand_ins):
    """cli/tune_device.ops_rows: every op of OPS runs through every built transport at every
    size, on buffers of the size; a size keeps auto's transport (nccl here) unless another
    is 3% faster. The timer is a stand-in that runs each candidate once."""
    from mpi_kvstore.cli import tune_device
    comm = types.SimpleNamespace(size=2, rank=0)
    made = {name: REGISTRY[name](comm, 0) for name in ('nccl', 'staged')}
    seconds = {SMALL: {'nccl': 1.0, 'staged': 0.98}, LARGE: {'nccl': 1.0, 'staged': 0.5}}

    def interleaved(comm, fns, trials):
        for run in fns.values():
            run()
        return dict(seconds[RAN[-1][2]])   # by the size the last run was handed
    said = []
    rows, measured = tune_device.ops_rows(comm, made, 'nccl', [SMALL, LARGE], 1, interleaved,
                                          said.append)
    assert rows == {op: [(SMALL, 'nccl'), (LARGE, 'staged')] for op in OPS}, rows
    assert measured['alltoall'][str(LARGE)] == {'nccl': 1000.0, 'staged': 500.0}
    ran = [(op, name, nbytes) for op, name, nbytes, _ in RAN]
    assert ran == [(op, name, nbytes) for op in OPS for nbytes in (SMALL, LARGE)
                   for name in ('nccl', 'staged')], ran
    assert len(said) == 2 * len(OPS) and 'staged 500.000 ms *' in said[-1], said


def test_tune_sorts_its_sizes_so_the_rows_it_writes_increase():
    from mpi_kvstore.cli import tune
    assert tune._sizes('1M,4K,1M,64K') == [4096, 65536, 1 << 20]
    rows = [(n, 'staged') for n in tune._sizes('1M,4K,1M')]
    assert Table([4], ['mpi'], 1, device_ops={'alltoall': rows}).choose_device_op(
        'alltoall', 1) == 'staged'
