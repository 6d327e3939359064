"""Pure-Python parts: configuration, fusion planning, the key/value grammar."""
import sys
import types

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mpi_kvstore import config as cfg
from mpi_kvstore.comm.collective import Collective, signature
from mpi_kvstore.comm.fusion import plan
from mpi_kvstore.gluon import _groups  # loaded in a test, the store outlasts hypothesis' deadline


def test_config_precedence_argument_env_default():
    env = {'MPI_KVSTORE_DESIGN': 'chained', 'MPI_KVSTORE_FUSION_THRESHOLD': '4M'}
    assert cfg.Config(environ={}).design == 'auto'
    assert cfg.Config(environ=env).design == 'chained'
    assert cfg.Config(environ=env, design='concurrent').design == 'concurrent'
    assert cfg.Config(environ=env).fusion_threshold == 4 << 20
    assert cfg.Config(environ={'MPI_KVSTORE_AVERAGE': 'yes'}).average is True


@pytest.mark.parametrize('env, needle', [
    ({'MPI_KVSTORE_DESIGN': 'ring'}, 'MPI_KVSTORE_DESIGN'),
    ({'MPI_KVSTORE_FUSION_THRESHOLD': '-1'}, 'MPI_KVSTORE_FUSION_THRESHOLD'),
    ({'MPI_KVSTORE_LANES': '0'}, 'MPI_KVSTORE_LANES'),
    ({'MPI_KVSTORE_AVERAGE': 'maybe'}, 'MPI_KVSTORE_AVERAGE'),
])
def test_bad_environment_value_names_the_variable(env, needle):
    with pytest.raises(cfg.ConfigError, match=needle):
        cfg.Config(environ=env)


def test_bad_argument_and_unknown_option():
    with pytest.raises(cfg.ConfigError, match='argument design'):
        cfg.Config(environ={}, design='nope')
    with pytest.raises(cfg.ConfigError, match='unknown option'):
        cfg.Config(environ={}, fusion=1)


def test_options_table_lists_every_knob():
    table = cfg.options_table()
    for option in cfg.OPTIONS:
        assert '`%s`' % option.env in table


def _req(seq, nbytes, dtype='float32', kind='allreduce'):
    dt = np.dtype(dtype)
    return Collective(kind, 'k%d' % seq, dt, (nbytes // dt.itemsize,), seq=seq)


def _seqs(buckets):
    return [[r.seq for r in b] for b in buckets]


def test_plan_fuses_neighbours_up_to_threshold_in_seq_order():
    reqs = [_req(s, 400) for s in (5, 1, 3, 2, 4)]
    assert _seqs(plan(reqs, 1000)) == [[1, 2], [3, 4], [5]]


def test_plan_large_and_other_kinds_travel_alone():
    reqs = [_req(0, 100), _req(1, 5000), _req(2, 100), _req(3, 100, kind='bcast'), _req(4, 100)]
    assert _seqs(plan(reqs, 1000)) == [[0], [1], [2], [3], [4]]


def test_plan_splits_on_dtype_and_threshold_zero_disables():
    reqs = [_req(0, 64), _req(1, 64, 'float64'), _req(2, 64, 'float64')]
    assert _seqs(plan(reqs, 1000)) == [[0], [1, 2]]
    assert _seqs(plan(reqs, 0)) == [[0], [1], [2]]


def test_plan_runs_higher_priority_first_then_push_order():
    reqs = [Collective('allreduce', 'k%d' % s, np.dtype('float32'), (100,), seq=s,
                       priority=prio) for s, prio in enumerate((0, -5, 3, 0))]
    assert _seqs(plan(reqs, 1000)) == [[2, 0], [3, 1]]


def test_plan_is_independent_of_arrival_order():
    reqs = [_req(s, 300) for s in range(20)]
    shuffled = list(reqs)
    np.random.RandomState(0).shuffle(shuffled)
    assert _seqs(plan(reqs, 1000)) == _seqs(plan(shuffled, 1000))


def test_signature_is_stable_and_discriminating():
    f32 = np.dtype('float32')
    a = signature('allreduce', 'w', f32, (3, 4), 0)
    assert a == signature('allreduce', 'w', f32, (3, 4), 0)
    assert len({a, signature('allreduce', 'w', f32, (4, 3), 0),
                signature('allreduce', 'v', f32, (3, 4), 0),
                signature('bcast', 'w', f32, (3, 4), 0),
                signature('allreduce', 'w', np.dtype('float64'), (3, 4), 0)}) == 5
    assert 0 <= a < (1 << 30)


def test_launcher_local_rank():
    assert cfg.launcher_local_rank({'MPI_LOCALRANKID': '1', 'MPI_LOCALNRANKS': '4'}) == (1, 4)
    assert cfg.launcher_local_rank({'OMPI_COMM_WORLD_LOCAL_RANK': '0',
                                    'OMPI_COMM_WORLD_LOCAL_SIZE': '2'}) == (0, 2)
    assert cfg.launcher_local_rank({}) is None


def test_docs_options_table_is_generated_from_config():
    import os
    import re
    path = os.path.join(os.path.dirname(__file__), '..', 'docs', 'configuration.md')
    with open(path) as f:
        page = f.read()
    block = re.search(r'<!-- options-table:start -->\n(.*)\n<!-- options-table:end -->', page,
                      re.S)
    assert block, 'docs/configuration.md lost its options-table markers'
    assert block.group(1) == cfg.options_table(), (
        'docs/configuration.md options table is stale: regenerate with '
        'python -m mpi_kvstore options')


@given(st.lists(st.integers(0, 64), max_size=40), st.integers(0, 100))
def test_distributed_trainer_groups_keep_order_and_size(sizes, limit):
    """DistributedTrainer's groups: every gradient once, in order (last layer first, as
    given); a group stays within group_bytes unless it is one gradient alone; 0: one group."""
    items = [(key, None, nbytes) for key, nbytes in enumerate(sizes)]
    runs = _groups(items, limit)
    assert [item for run in runs for item in run] == items
    assert all(run for run in runs)
    if limit == 0:
        assert len(runs) == (1 if items else 0)
        return
    for i, run in enumerate(runs):
        total = sum(n for _, _, n in run)
        assert total <= limit or len(run) == 1
        if i + 1 < len(runs):    # greedy: the next item would not have fit
            assert total + runs[i + 1][0][2] > limit


def test_without_mxnet_the_import_says_which_wheel_to_install():
    """MXNet comes from an extra (cpu), so that a GPU wheel is never overwritten."""
    import subprocess
    import sys
    code = "import sys; sys.modules['mxnet'] = None; import mpi_kvstore; mpi_kvstore.create()"
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True)
    assert out.returncode != 0
    assert "pip install 'mpi_kvstore[cpu]'" in out.stderr and 'mxnet-cu11x' in out.stderr, out.stderr


def test_the_transports_import_without_mxnet():
    """The GPU machine runs CuPy with numpy 2, where MXNet cannot go: the transports, the
    host communicator and the bucket runner import without it, and a host bucket runs."""
    import subprocess
    import sys
    code = ("import sys; sys.modules['mxnet'] = None\n"
            "import numpy as np\n"
            "from mpi_kvstore.comm import host as comm, reduce, transports\n"
            "from mpi_kvstore.comm.collective import Collective\n"
            "from mpi_kvstore.comm.mpiabi import MPI\n"
            "c = comm.Comm(MPI.COMM_WORLD, 'off')\n"
            "req = Collective('allreduce', 'k', np.dtype('f4'), (3,), place='cpu')\n"
            "req.attach(np.arange(3, dtype='f4'))\n"
            "reduce.Reducer(c.size, None, None).allreduce([req], c)\n"
            "print(sorted(transports.REGISTRY), req.view.tolist(), 'mxnet' in sys.modules\n"
            "      and sys.modules['mxnet'] is not None)\n")
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["['cuda_mpi',", "'nccl',", "'staged']", '[0.0,', '1.0,',
                                  '2.0]', 'False'], out.stdout


def test_cuda_awareness_is_asked_of_the_loaded_mpi():
    """mpi4py 4.1 has no Query_cuda_support: 'auto' asks the library's MPIX_ query, which
    the PyPI mpich wheel answers with no; 'on' and 'off' override it."""
    import ctypes

    from mpi_kvstore.comm import mpiabi
    lib = ctypes.CDLL(mpiabi._loaded_libmpi())
    assert hasattr(lib, 'MPIX_Query_cuda_support') or hasattr(lib, 'MPIX_GPU_query_support')
    lib.MPIX_Query_cuda_support.restype = ctypes.c_int
    assert mpiabi.cuda_aware('auto') is bool(lib.MPIX_Query_cuda_support())
    assert mpiabi.cuda_aware('auto') is False            # the mpich wheel is not CUDA-aware
    assert mpiabi.cuda_aware('on') is True and mpiabi.cuda_aware('off') is False
    assert cfg.Config(cuda_aware=True).cuda_aware == 'on'
    with pytest.raises(cfg.ConfigError, match='auto, on or off'):
        cfg.Config(cuda_aware='maybe')


def test_doctor_reports_this_mpi_at_two_ranks():
    from mpi_harness import result, run_mpi
    out = run_mpi(2, 'doctor_report.py', env={'MPI_KVSTORE_DESIGN': 'chained'}, timeout=120)
    assert 'doctor_report: OK at 2 ranks' in out, out[-2000:]
    for rank, report in enumerate(result(out, 'doctor_report')['ranks']):
        assert 'rank %d of 2' % rank in report['report'][0]
        assert '  * chained    usable' in report['report']     # the design it was given
        assert 'tune table:       none' in '\n'.join(report['report'])
        assert '  allreduce:      4K mpi, 16M rsag' in report['with_table']


def test_doctor_command_runs_alone():
    import subprocess
    import sys
    out = subprocess.run([sys.executable, '-m', 'mpi_kvstore', 'doctor'], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert 'rank 0 of 1' in out.stdout and 'thread level:' in out.stdout, out.stdout


def test_fusion_plans_from_agreed_metadata_only():
    """A rank whose engine op could not read an array (its view unset) plans the same
    buckets as a rank that read it into GPU memory: place comes from the signature."""
    class DeviceBuffer(np.ndarray):
        device = 'cuda:0'

    def reqs(read):
        out = []
        for i in range(4):
            req = Collective('allreduce', i, np.dtype(np.float32), (8,), place='gpu', seq=i)
            if read or i != 2:
                req.attach(np.zeros(8, np.float32).view(DeviceBuffer))
            out.append(req)
        return out
    shape = lambda buckets: [[r.seq for r in b] for b in buckets]  # noqa: E731
    assert shape(plan(reqs(True), 1 << 20)) == shape(plan(reqs(False), 1 << 20)) == [[0, 1, 2, 3]]
    cpu = Collective('allreduce', 9, np.dtype(np.float32), (8,), place='cpu', seq=9)
    assert len(plan(reqs(True) + [cpu], 1 << 20)) == 2     # never fused across places
    assert signature('allreduce', 1, 'float32', (8,), 0, 'gpu') != signature(
        'allreduce', 1, 'float32', (8,), 0)


def test_tune_table_chooses_by_the_nearer_measured_size_in_log_scale():
    from mpi_kvstore.comm.tuning import Table
    table = Table([4096, 1 << 20, 1 << 26], ['mpi', 'rsag', 'mpi'], 2)
    assert [table.choose(n) for n in (4, 4096, 65535, 65536, 1 << 20, (8 << 20) - 1, 8 << 20,
                                      1 << 30)] \
        == ['mpi', 'mpi', 'mpi', 'rsag', 'rsag', 'rsag', 'mpi', 'mpi']   # edges: 64 KB, 8 MB
    assert Table.from_json(table.to_json()).backends == table.backends
    with pytest.raises(ValueError, match='unknown allreduce algorithm'):
        Table([4], ['nccl-over-carrier-pigeon'], 2)
    with pytest.raises(ValueError, match='version-1'):
        Table.from_json({'version': 0})


def test_tune_picks_a_gpu_transport_per_size_only_by_the_margin():
    """auto's transport stays unless another is 3% faster (closer is noise)."""
    from mpi_kvstore.cli.tune_device import pick as _pick_device
    from mpi_kvstore.comm.tuning import Table
    assert _pick_device({'nccl': 1.0, 'staged': 0.98}, 'nccl') == 'nccl'
    assert _pick_device({'nccl': 1.0, 'staged': 0.96}, 'nccl') == 'staged'
    assert _pick_device({'staged': 2.0}, 'staged') == 'staged'
    table = Table([4096], ['mpi'], 2, device=[(1 << 20, 'staged'), (4096, 'nccl')])
    assert table.device.sizes == [4096, 1 << 20]            # sorted with their names
    assert [table.choose_device(n) for n in (1, 65535, 65536)] == ['nccl', 'nccl', 'staged']
    assert Table([4096], ['mpi'], 2).choose_device(1) is None
    with pytest.raises(ValueError, match='unknown GPU transport'):
        Table([4096], ['mpi'], 2, device=[(4096, 'gloo')])


def test_gpu_transport_choice_is_a_pure_agreed_function():
    """transports.decide: auto takes the first of nccl, cuda_mpi, staged that can run; a
    named transport that cannot run raises ConfigError saying why (on every rank alike,
    since its inputs are agreed)."""
    from mpi_kvstore.comm import transports
    assert transports.AUTO_ORDER == ('nccl', 'cuda_mpi', 'staged')
    assert set(transports.REGISTRY) == set(cfg.GPU_TRANSPORTS) - {'auto'}
    yes, no = (True, ''), (False, 'not here')
    every = {'nccl': yes, 'cuda_mpi': yes, 'staged': yes}
    assert transports.decide('auto', every, shared=False, concurrent=False) == 'nccl'
    assert transports.decide('auto', every, shared=True, concurrent=False) == 'cuda_mpi'
    assert transports.decide('auto', every, shared=False, concurrent=True) == 'cuda_mpi'
    plain = dict(every, cuda_mpi=no)
    assert transports.decide('auto', plain, shared=True, concurrent=False) == 'staged'
    assert transports.decide('staged', every, shared=False, concurrent=False) == 'staged'
    with pytest.raises(cfg.ConfigError, match='one GPU'):
        transports.decide('nccl', every, shared=True, concurrent=False)
    with pytest.raises(cfg.ConfigError, match='launch order'):
        transports.decide('nccl', every, shared=False, concurrent=True)
    with pytest.raises(cfg.ConfigError, match='not here'):
        transports.decide('cuda_mpi', plain, shared=False, concurrent=False)


def test_gpu_transport_option():
    assert cfg.Config(environ={}).gpu_transport == 'auto'
    assert cfg.Config(environ={'MPI_KVSTORE_GPU_TRANSPORT': 'NCCL'}).gpu_transport == 'nccl'
    assert cfg.Config(environ={}).device_fusion_threshold == 16 << 20
    with pytest.raises(cfg.ConfigError, match='auto, nccl, cuda_mpi, staged'):
        cfg.Config(environ={}, gpu_transport='gloo')
    with pytest.raises(cfg.ConfigError, match='design=concurrent'):
        cfg.Config(environ={}, design='concurrent', gpu_transport='nccl')
    assert cfg.Config(environ={}, design='concurrent').gpu_transport == 'auto'


def test_cuda_aware_mpi_is_never_chosen_for_an_mpi_that_says_no():
    """The PyPI mpich wheel is not CUDA-aware: cuda_mpi is unusable unless cuda_aware=on."""
    from mpi_kvstore.comm.transports import cuda_mpi
    probe = type('Probe', (), {'cuda_aware_setting': 'auto'})()
    ok, why = cuda_mpi.CudaMPI.usable(probe)
    assert not ok and 'not known to be CUDA-aware' in why
    probe.cuda_aware_setting = 'on'
    assert cuda_mpi.CudaMPI.usable(probe) == (True, '')


def test_device_buckets_have_their_own_fusion_threshold():
    reqs = []
    for i in range(6):
        reqs.append(Collective('allreduce', i, np.dtype('f4'), (1000,),
                               place='gpu' if i < 3 else 'cpu', seq=i))
    buckets = plan(reqs, 4000, device_threshold=12000)
    assert [[r.key for r in b] for b in buckets] == [[0, 1, 2], [3], [4], [5]]
    buckets = plan(reqs, 8000)
    assert [[r.key for r in b] for b in buckets] == [[0, 1], [2], [3, 4], [5]]


class _FakeCuda:
    """The least of CuPy that reduce.py touches, recording which device is current when
    work runs: the wrong-device defect (every bucket ran on GPU 0) needs more than one GPU
    to show on hardware, and this machine has none."""

    def __init__(self):
        self.current = [0]            # the device stack; CuPy's default device is 0
        self.events = []              # (what, device current at the time)
        fake = self

        class Device:
            def __init__(self, id):
                self.id = id

            def __enter__(self):
                fake.current.append(self.id)

            def __exit__(self, *exc):
                fake.current.pop()

        class Stream:
            def __init__(self):
                self.device = fake.current[-1]   # a stream belongs to the current device

            def __enter__(self):
                fake.events.append(('stream of %d' % self.device, fake.current[-1]))

            def __exit__(self, *exc):
                pass

            def synchronize(self):
                fake.events.append(('synchronize %d' % self.device, fake.current[-1]))

        self.cuda = type('cuda', (), {'Device': Device, 'Stream': Stream})
        self.zeros = lambda count, dtype: _DeviceArray(np.zeros(count, dtype), fake.current[-1])
        self.empty = lambda count, dtype: _DeviceArray(np.empty(count, dtype), fake.current[-1])


class _DeviceArray:
    def __init__(self, data, device):
        self.data, self.nbytes, self.dtype, self.size = data, data.nbytes, data.dtype, data.size
        self.device = type('device', (), {'id': device})()

    def __getitem__(self, index):
        return _DeviceArray(self.data[index], self.device.id)

    def __imul__(self, factor):
        self.data *= factor
        return self


def test_a_device_bucket_runs_on_its_own_device_and_is_finished(monkeypatch):
    """reduce._scope: a bucket on GPU 1 runs with device 1 current, on a stream of device 1
    that is synchronised before the bucket completes, even where the transport lives on
    GPU 0 (its stream belongs to device 0); a bucket on GPU 0 uses the transport's stream
    and finish(). A rank whose read failed sends zeros made on the bucket's device."""
    from mpi_kvstore.comm import reduce as reduce_mod
    fake = _FakeCuda()
    monkeypatch.setitem(sys.modules, 'cupy', fake)
    monkeypatch.setattr(reduce_mod, '_streams', {})

    class Transport:
        device = 0
        stream = fake.cuda.Stream()

        def finish(self):
            fake.events.append(('finish', fake.current[-1]))

    class Comm:
        def device_transport(self, device, nbytes, op='allreduce'):
            return Transport()

        def allreduce(self, buf):
            fake.events.append(('allreduce on %d' % buf.device.id, fake.current[-1]))
            buf.data += 1

    def request(key, buf, device):
        array = type('NDArray', (), {'context': type('ctx', (), {'device_id': device})()})()
        return Collective('allreduce', key, np.dtype('f4'), (4,), place='gpu', average=True,
                          array=array, view=buf)

    reducer = reduce_mod.Reducer(2, fail=None, fail_all=None)
    on_one = _DeviceArray(np.ones(4, np.float32), 1)
    reducer.allreduce([request('a', on_one, 1)], Comm())
    assert fake.events == [('stream of 1', 1), ('allreduce on 1', 1), ('synchronize 1', 1)]
    np.testing.assert_array_equal(on_one.data, 1.0)          # (1 + 1) / 2 ranks
    assert fake.current == [0]

    fake.events.clear()
    on_zero = _DeviceArray(np.ones(4, np.float32), 0)
    reducer.allreduce([request('b', on_zero, 0)], Comm())
    assert fake.events == [('stream of 0', 0), ('allreduce on 0', 0), ('finish', 0)]

    fake.events.clear()
    unread = request('c', None, 1)                           # its read failed: host zeros
    unread.use_scratch(np.zeros(4, np.float32))
    reducer.allreduce([unread], Comm())
    assert isinstance(unread.scratch, _DeviceArray) and unread.scratch.device.id == 1
    assert fake.events == [('stream of 1', 1), ('allreduce on 1', 1), ('synchronize 1', 1)]

    # Fusion buffers: one pool entry per device, each made with its device current.
    from mpi_kvstore.comm.fusion import BufferPool
    pool = BufferPool()
    CupyArray = type('ndarray', (_DeviceArray,), {'__module__': 'cupy'})  # told by module
    like = {d: CupyArray(np.ones(4, np.float32), d) for d in (0, 1)}
    made = [pool.get(like[d], 8) for d in (1, 0, 1)]
    assert [m.device.id for m in made] == [1, 0, 1]
    assert made[0].data.base is made[2].data.base is not made[1].data.base



def _request(array, kind='allreduce', average=False, root=0, factor=1.0):
    dtype = np.dtype(array.dtype)
    return types.SimpleNamespace(array=array, nbytes=array.size * dtype.itemsize, kind=kind,
                                 dtype=dtype, root=root, average=average, factor=factor)


def test_a_chained_record_holds_each_field_where_its_layout_declares():
    """records.py writes and reads a record by the word offsets that layout.py derives: seen
    through the declared dtypes, each field holds what the plan was given."""
    import mxnet as mx

    from mpi_kvstore.comm import agreement
    from mpi_kvstore.comm.mpiabi import c_datatype
    from mpi_kvstore.engine import layout, records
    ints = [mx.nd.ones((3,), dtype='int32'), mx.nd.ones((5,), dtype='int32')]
    floats = mx.nd.ones((4,))
    buckets = [[_request(a, average=True) for a in ints], [_request(floats, 'bcast', root=1)],
               [_request(floats, factor=0.25)]]
    message = agreement.group_message([11, 12], rank=1)
    plan = records.ChainedPlan(buckets, types.SimpleNamespace(handle=7, size=2), message, 5,
                               lambda dtype, count: np.zeros(count, dtype), (10, 0), 3)
    words = plan.record
    head = words[:layout.HEADER].view(layout.HEADER_DTYPE)[0]
    assert (head['count'], head['nbuckets'], head['comm'], head['size'], head['eventfd'],
            head['one'], head['progress_us'], head['poll_us'], head['msglen']) == (
                4, 3, 7, 2, 5, 1, 10, 3, len(message))
    assert head['fns'] == records.function_table().ctypes.data
    np.testing.assert_array_equal(head['mine'][:len(message)], message)
    end = layout.HEADER + 4 * layout.SLOT
    slots = words[layout.HEADER:end].view(layout.ARRAY_DTYPE)
    assert list(slots['handle']) == [a.handle.value for a in ints + [floats, floats]]
    assert list(slots['nbytes']) == [12, 20, 16, 16]
    fused, bcast, scaled = words[end:].view(layout.BUCKET_DTYPE)
    assert [fused[f] for f in layout.BUCKET_DTYPE.names] == [
        layout.ALLREDUCE_POLLED, 0, 2, 8, c_datatype(np.int32), 0,
        layout.SCALES[np.dtype(np.int32)], plan.keep[0].ctypes.data, 1.0]
    assert [bcast[f] for f in layout.BUCKET_DTYPE.names] == [
        layout.BCAST, 2, 1, 4, c_datatype(np.float32), 1, 0, 0, 1.0]
    # a factor without an average: multiplied alone (FACTORS), the factor a float64 word
    assert [scaled[f] for f in layout.BUCKET_DTYPE.names] == [
        layout.ALLREDUCE_POLLED, 3, 1, 4, c_datatype(np.float32), 0,
        layout.FACTORS[np.dtype(np.float32)], 0, 0.25]

    op = records.ChainedOp(plan, [r for b in buckets for r in b], ints + [floats, floats],
                           print)
    try:
        assert op.address == op.record.ctypes.data != plan.record.ctypes.data
        head = op.record[:layout.HEADER].view(layout.HEADER_DTYPE)[0]
        assert head['self'] == op.address
        head['msg'][:len(message)] = message - 1
        head['stage'], head['bucket'], head['errcode'] = layout.Stage.MPI_ERROR, 1, 42
        np.testing.assert_array_equal(op.message(), message - 1)
        assert op.stage == (layout.Stage.MPI_ERROR, 1, 42)
        tensor = op.record[layout.HEADER:end].view(layout.ARRAY_DTYPE)[2:]['tensor']
        op.record[layout.HEADER + 2 * layout.SLOT + layout.A_MANAGED] = 1
        tensor['data'], tensor['byte_offset'] = 4096, 64
        tensor['device_type'], tensor['device_id'] = 3, 2
        assert op.pointer(2) == (4160, 3, 2) and op.pointer(0) is None
    finally:
        op.forget()


def test_the_compiled_op_writes_its_record_where_python_reads_it():
    """mark_ready, called as the engine calls it, takes each array's pointer and the
    engine's completion into the fields that records.NativeOp reads, marks the record
    ready and writes the eventfd."""
    import ctypes
    import os

    import mxnet as mx

    from mpi_kvstore.engine import records, takeup
    from mpi_kvstore.engine.arrays import array_pointer
    arrays = [mx.nd.ones((3,)), mx.nd.ones((6,), dtype='int64')[2:]]
    for array in arrays:
        array.wait_to_read()
    waker = takeup.Waker()
    op = records.NativeOp(arrays, [], waker.fd)
    completion = np.array([11, 22, 33], dtype=np.int64)
    run = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)(
        records.mark_ready_address())
    try:
        assert not op.ready
        run(None, completion.ctypes.data, op.address)
        assert op.ready and op.callback() == (11, 22, 33)
        assert [op.pointer(i) for i in range(2)] == [array_pointer(a) for a in arrays]
        assert os.eventfd_read(waker.fd) == 1
    finally:
        waker.close()


def test_compiled_ops_are_cached_by_the_source_they_compile_in(monkeypatch, tmp_path):
    """numba keys its on-disk cache by the compiled function's own file only: the entry
    points are keyed by the source of the files they take constants and code from too, so
    a change there compiles them again instead of loading stale machine code."""
    import numba

    from mpi_kvstore.engine import native
    monkeypatch.setattr(numba.config, 'CACHE_DIR', str(tmp_path))
    hits = []
    for key in ('one', 'one', 'another', 'one'):
        monkeypatch.setattr(native, '_compiled', {})
        monkeypatch.setattr(native, '_source_key', lambda key=key: key)
        native.address('mark_ready')
        hits.append(native._compiled['mark_ready'].cache_hits)
    assert hits == [0, 1, 0, 1]


def test_huge_pages_keep_an_arrays_content_and_report_what_the_kernel_did():
    """The promise is the content and an honest report, not huge pages: MADV_COLLAPSE is
    best effort, and a kernel under memory pressure declines it."""
    import errno

    import mxnet as mx

    from mpi_kvstore.engine.arrays import HUGE_PAGE, array_pointer, huge_pages
    values = np.arange(6 << 20, dtype=np.float32)          # 24 MB: MXNet's own memory
    array = mx.nd.array(values)
    array.wait_to_read()
    address = array_pointer(array)[0]
    result = huge_pages(address, values.nbytes)
    np.testing.assert_array_equal(array.asnumpy(), values)
    # Two answers, one per advice: 0 (taken) or a positive errno (declined).
    assert isinstance(result, tuple) and len(result) == 2
    assert all(code == 0 or code in errno.errorcode for code in result), result
    assert huge_pages(address, HUGE_PAGE) is None            # under 4 MB nothing is asked


def test_huge_pages_advise_only_the_whole_pages_inside_and_survive_a_refusal(monkeypatch, caplog):
    import ctypes
    import errno
    import logging

    from mpi_kvstore.engine import arrays
    calls = []

    class Libc:
        def __init__(self, answer):
            self.answer = answer

        def madvise(self, start, length, advice):
            calls.append((start, length, advice))
            if self.answer:
                ctypes.set_errno(self.answer)
                return -1
            return 0

    page = arrays.HUGE_PAGE
    address = 10 * page + 4096                                 # not aligned: 3 whole pages
    monkeypatch.setattr(arrays, '_libc', Libc(0))
    assert arrays.huge_pages(address, 4 * page) == (0, 0)
    assert calls == [(11 * page, 3 * page, arrays.MADV_HUGEPAGE),
                     (11 * page, 3 * page, arrays.MADV_COLLAPSE)]
    assert arrays.huge_range(address, 4 * page) == (11 * page, 14 * page)
    assert arrays.huge_range(address, 2 * page - 1) is None    # under HUGE_MIN_BYTES
    assert arrays.huge_range(page + 1, 4 * page - 2) == (2 * page, 4 * page)
    calls.clear()
    monkeypatch.setattr(arrays, '_libc', Libc(errno.EAGAIN))
    with caplog.at_level(logging.DEBUG, logger=arrays.__name__):
        assert arrays.huge_pages(address, 4 * page) == (errno.EAGAIN, errno.EAGAIN)
    assert len(calls) == 2 and 'declined' in caplog.text and str(3 * page) in caplog.text


# ---------------------------------------------------------------- defaults decided at creation

def test_auto_schedule_options_follow_the_hosts_and_keep_explicit_values(monkeypatch):
    from mpi4py import MPI

    from mpi_kvstore.comm import topology
    monkeypatch.setattr(topology, 'count_hosts', lambda comm: 2)
    config, why = topology.resolve(cfg.Config(environ={}), MPI.COMM_SELF)
    assert (config.partition_bytes, config.credit_bytes, config.progress_sleep_us) == (
        4 << 20, 8 << 20, 200.0)
    assert '2 hosts' in why and 'partition_bytes=4M' in why
    assert config.autotune is True and 'autotune=on' in why     # the search, across hosts
    assert config.origin('autotune') == 'auto: 2 hosts'
    config, _ = topology.resolve(cfg.Config(environ={'MPI_KVSTORE_CREDIT_BYTES': '1M'},
                                            partition_bytes=0), MPI.COMM_SELF)
    assert (config.partition_bytes, config.credit_bytes, config.progress_sleep_us) == (
        0, 1 << 20, 200.0)
    monkeypatch.setattr(topology, 'count_hosts', lambda comm: 1)
    config, why = topology.resolve(cfg.Config(environ={}), MPI.COMM_SELF)
    assert (config.partition_bytes, config.credit_bytes, config.progress_sleep_us) == (0, 0, 0)
    assert config.autotune is False and 'autotune=off' in why   # nothing is cut on one host
    everything = cfg.Config(environ={}, partition_bytes=1, credit_bytes=2, progress_sleep_us=3,
                            autotune=True, design='funneled')
    assert topology.resolve(everything, MPI.COMM_SELF) == (everything, None)
    monkeypatch.setattr(topology, 'oversubscribed', lambda comm: True)
    config, why = topology.resolve(cfg.Config(environ={}), MPI.COMM_SELF)
    assert (config.partition_bytes, config.credit_bytes, config.progress_sleep_us) == (
        0, 0, 200.0)
    assert 'more ranks than cores' in why and config.autotune is False


def test_ranks_outnumber_cores_by_the_union_of_their_affinities(monkeypatch):
    """One process never outnumbers its cores; more ranks on one host than the cores their
    affinities cover do (the two ranks of a 2-rank job below, each seeing one core)."""
    from mpi4py import MPI

    from mpi_kvstore.comm import topology
    assert topology.oversubscribed(MPI.COMM_SELF) is False

    class Node:
        def __init__(self, cores):
            self.cores = cores

        def allgather(self, mine):
            return self.cores

        def Get_size(self):
            return len(self.cores)

        def Free(self):
            pass

    class Comm:
        def __init__(self, cores):
            self.node = Node(cores)

        def Get_size(self):
            return 2

        def Get_rank(self):
            return 0

        def Split_type(self, kind, key):
            return self.node

        def Allreduce(self, where, flag, op):
            pass

        def Ibarrier(self):   # topology polls these: a request that completes at once
            return MPI.COMM_SELF.Ibarrier()

        def Iallreduce(self, where, flag, op):
            return MPI.COMM_SELF.Ibarrier()

    assert topology.oversubscribed(Comm([[0], [1]])) is False   # one core each, two cores
    assert topology.oversubscribed(Comm([[0], [0]])) is True    # both on core 0
    assert topology.oversubscribed(Comm([[0, 1], [0, 1]])) is False


def test_one_process_spans_one_host():
    from mpi4py import MPI

    from mpi_kvstore.comm import topology
    assert topology.count_hosts(MPI.COMM_SELF) == 1


def test_a_tune_tables_schedule_wins_over_the_hosts_and_travels_through_json(monkeypatch):
    from mpi4py import MPI

    from mpi_kvstore.comm import topology, tuning
    table = tuning.Table([1024], ['mpi'], 2, schedule={'partition_bytes': 1 << 20,
                                                       'credit_bytes': 3 << 20})
    again = tuning.Table.from_json(table.to_json())
    assert again.schedule == {'partition_bytes': 1 << 20, 'credit_bytes': 3 << 20}
    monkeypatch.setattr(topology, 'count_hosts', lambda comm: 2)
    config, why = topology.resolve(cfg.Config(environ={}), MPI.COMM_SELF, again)
    assert (config.partition_bytes, config.credit_bytes, config.progress_sleep_us) == (
        1 << 20, 3 << 20, 200.0)
    assert 'tune table' in why
    assert config.autotune is False           # the table's schedule was searched already
    config, _ = topology.resolve(cfg.Config(environ={}, autotune=True), MPI.COMM_SELF, again)
    assert config.autotune is True and config.partition_bytes == 1 << 20   # asked: from there
    assert tuning.Table.from_json(tuning.Table([1024], ['mpi'], 2).to_json()).schedule is None


@pytest.mark.parametrize('schedule, words', [
    ({'partition': 1}, 'unknown schedule option'),
    ({'credit_bytes': -1}, 'credit_bytes must be a number >= 0'),
    ({'partition_bytes': 'big'}, 'partition_bytes must be a number'),
    ([1, 2], 'schedule must be an object'),
])
def test_a_bad_schedule_in_a_tune_table_is_refused(schedule, words):
    from mpi_kvstore.comm import tuning
    with pytest.raises(ValueError, match=words):
        tuning.Table([1024], ['mpi'], 2, schedule=schedule)


def test_schedule_options_take_auto_bytes_or_numbers():
    assert cfg.Config(environ={}).partition_bytes == 'auto'
    assert cfg.Config(environ={'MPI_KVSTORE_PARTITION_BYTES': '2M'}).partition_bytes == 2 << 20
    assert cfg.Config(environ={}, credit_bytes='AUTO').credit_bytes == 'auto'
    assert cfg.Config(environ={}, progress_sleep_us='150').progress_sleep_us == 150.0
    with pytest.raises(cfg.ConfigError, match='MPI_KVSTORE_CREDIT_BYTES'):
        cfg.Config(environ={'MPI_KVSTORE_CREDIT_BYTES': '-1'})


@given(count=st.integers(0, 20000), width=st.integers(1, 64))
def test_shares_are_numpys_array_split(count, width):
    """The sharded optimizer's cut (fusion.share, fusion.pieces) is numpy's array_split: the
    same on every rank, contiguous, the larger shares first."""
    from mpi_kvstore.comm.fusion import pieces, share
    expected = np.array_split(np.arange(count), width)
    counts, displs = pieces(count, width)
    assert counts == [len(part) for part in expected]
    for index, part in enumerate(expected):
        start, stop = share(count, width, index)
        assert (start, stop) == (displs[index], displs[index] + counts[index])
        assert np.array_equal(np.arange(count)[start:stop], part)


def test_sharded_and_plain_requests_never_share_a_bucket():
    """fusion.plan fuses requests of one kind only: a reduce-scatter's shares are cut per
    request, and an allreduce beside it would be cut with them."""
    reqs = []
    for seq, kind in enumerate(['allreduce', 'reducescatter', 'reducescatter', 'allgather',
                                'allreduce']):
        reqs.append(Collective(kind, 'k%d' % seq, np.dtype('float32'), (4,), seq=seq))
    assert [[r.key for r in bucket] for bucket in plan(reqs, 1 << 20)] == [
        ['k0'], ['k1', 'k2'], ['k3'], ['k4']]


@given(sizes=st.lists(st.integers(1, 300), min_size=1, max_size=5), width=st.integers(1, 6))
def test_shares_lay_out_every_request_once_rank_major(sizes, width):
    """fusion.Shares: rank r's chunk holds share r of every request in bucket order, and the
    chunks, packed at their displacements, hold every element once (numpy's array_split)."""
    from mpi_kvstore.comm.fusion import Shares
    reqs = [Collective('reducescatter', 'k%d' % j, np.dtype('float32'), (n,))
            for j, n in enumerate(sizes)]
    layout = Shares(reqs, width)
    flat = np.full(sum(sizes), -1)
    for r in range(width):
        for j, start, stop, at in layout.spans(r):
            assert (start, stop) == (sum(len(p) for p in np.array_split(np.arange(sizes[j]),
                                                                        width)[:r]),
                                     sum(len(p) for p in np.array_split(np.arange(sizes[j]),
                                                                        width)[:r + 1]))
            flat[layout.displs[r] + at:layout.displs[r] + at + stop - start] = (
                sum(sizes[:j]) + np.arange(start, stop))
        assert sum(stop - start for _, start, stop, _ in layout.spans(r)) == layout.counts[r]
    assert sorted(flat) == list(range(sum(sizes)))


def test_window_auto_covers_a_step_of_two_collectives_a_key_when_sharded():
    """window='auto' (config.window_of): 256, or 512 with shard_optimizer; a number stays."""
    from mpi_kvstore.config import Config, window_of
    assert Config().window == 'auto'
    assert window_of(Config()) == 256
    assert window_of(Config(shard_optimizer=True)) == 512
    assert window_of(Config(window=64, shard_optimizer=True)) == 64
    with pytest.raises(cfg.ConfigError):
        Config(window=0)


def test_a_transport_that_leaves_a_collective_out_cannot_be_made():
    from mpi_kvstore.comm.transports.base import Transport

    class HalfDone(Transport):
        def __init__(self):         # no CuPy, no device: only the contract is checked
            pass

        def allreduce(self, buf, algorithm='mpi'):
            pass

    with pytest.raises(TypeError, match='abstract') as info:
        HalfDone()
    assert all(name in str(info.value) for name in ('alltoall', 'allgather', 'bcast'))


def test_the_key_table_owns_the_updater_that_set_optimizer_makes():
    """StoreOptimizer.set hands its updater to the key table's set_updater; nobody writes
    the table's field, and the updater both read is the one that applies SGD."""
    import mxnet as mx

    from mpi_kvstore.store.keys import KeyTable
    from mpi_kvstore.store.optimizer import StoreOptimizer
    config = cfg.Config(environ={})
    keys = KeyTable(config)
    optimizer = StoreOptimizer(keys, config, 0, 1, job=None, run=None)
    assert keys.updater is None and optimizer.updater is None
    with pytest.raises(AttributeError):
        keys.updater = None
    optimizer.set(mx.optimizer.SGD(learning_rate=0.5, wd=0.0, rescale_grad=1.0))
    assert optimizer.updater is keys.updater is not None
    weight, grad = np.array([1.0, -2.0, 3.0], np.float32), np.array([0.5, 1.0, -4.0], np.float32)
    out = mx.nd.array(weight)
    keys.updater(0, mx.nd.array(grad), out)
    np.testing.assert_allclose(out.asnumpy(), weight - 0.5 * grad, rtol=1e-6)


def test_designs_and_elastic_states_name_what_a_subclass_must_define():
    from mpi_kvstore.designs.base import Design
    from mpi_kvstore.designs.negotiated import Negotiated
    from mpi_kvstore.elastic.base import BaseState

    assert Design.__abstractmethods__ == {'_submit'}
    assert Negotiated.__abstractmethods__ == {'dispatch', 'set_progress'}
    assert BaseState.__abstractmethods__ == {'save', 'restore', 'sync'}
    from mpi_kvstore.designs import REGISTRY
    assert all(not cls.__abstractmethods__ for cls in REGISTRY.values()), REGISTRY
