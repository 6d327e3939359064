"""Device rows for every collective (the tune table's ``device_ops``) on CuPy arrays, without
MXNet.

usage: gpu_tune_ops.py EXPECT [tune]

EXPECT: the transports that must run, 'a+b' ('nccl+staged' where NCCL can run, 'staged'
where two ranks share one GPU). 'tune' first runs ``python -m mpi_kvstore tune`` in this
process on small sizes and checks its JSON: device rows for every op, each naming a
transport this job can run, every runnable one timed.

Then a hand-written table sends device buffers under 512 KB through NCCL and larger ones
through staged MPI, for every op (allreduce the other way round, so an op that took
allreduce's rows would show). At one rank the store moves nothing, so each op runs through
the transport the Comm hands out for its size, directly. At more ranks the store's path
runs: Reducer buckets for a broadcast from the last rank, a reduce-scatter and an
allgather, Comm.alltoall for the all-to-all; where NCCL cannot run (one GPU), its rows
give way to staged on every rank, with a warning. Results against numpy from (rank, size);
which transport ran, from debug's counters.
"""
import json
import math
import os
import sys
import tempfile

# No MXNet on the GPU machines: the communicator and the transports need none.
sys.modules['mxnet'] = None

import cupy  # noqa: E402
import numpy as np  # noqa: E402

from mpi_kvstore import debug  # noqa: E402
from mpi_kvstore.comm import host as comm_mod  # noqa: E402
from mpi_kvstore.comm import reduce as reduce_mod  # noqa: E402
from mpi_kvstore.comm.collective import Collective  # noqa: E402
from mpi_kvstore.comm.fusion import pieces  # noqa: E402
from mpi_kvstore.comm.tuning import OPS, Table  # noqa: E402

from common import RANK, SIZE, WORLD, done  # noqa: E402

RAN = set(sys.argv[1].split('+'))
DEVICE = RANK % cupy.cuda.runtime.getDeviceCount()
SMALL, LARGE = 1024, 1 << 20                  # float32 elements: 4 KB and 4 MB
TABLE = Table([4096], ['mpi'], SIZE,
              device=[(4096, 'staged'), (64 << 20, 'nccl')],
              device_ops={op: [(4096, 'nccl'), (64 << 20, 'staged')] for op in OPS})


def want(op, count):
    """The transport the table gives ``op`` on ``count`` float32 values, here."""
    name = TABLE.choose_device_op(op, 4 * count)
    return name if name in RAN else 'staged'   # NCCL's rows give way where it cannot run


def check_tune():
    """tune at this job's size, small and fast: rows for every op from the runnable ones."""
    from mpi_kvstore.cli import tune
    out = WORLD.bcast(os.path.join(tempfile.mkdtemp(prefix='gpu_tune_'), 't.json')
                      if RANK == 0 else None)
    assert tune.main(['--sizes', '4K,1M', '--trials', '1', '--out', out]) == 0
    WORLD.Barrier()
    with open(out) as fh:
        payload = json.load(fh)
    table = Table.from_json(payload)
    assert sorted(table.device_ops) == sorted(OPS), payload.get('device_ops')
    for op in OPS:
        rows = payload['device_ops'][op]
        assert [r['bytes'] for r in rows] == [4096, 1 << 20], (op, rows)
        assert {r['transport'] for r in rows} <= RAN, (op, rows, RAN)
        for nbytes, times in payload['device_ops_ms'][op].items():
            assert set(times) == RAN, (op, nbytes, times)
            assert all(math.isfinite(t) and t > 0 for t in times.values()), (op, times)
    assert {r['transport'] for r in payload['device']} <= RAN, payload['device']
    if RANK == 0:
        print('tune: device rows for %s from %s' % (', '.join(OPS), ', '.join(sorted(RAN))))


def on_device(host):
    with cupy.cuda.Device(DEVICE):
        return cupy.asarray(host)


def read(buf):
    with cupy.cuda.Device(DEVICE):
        cupy.cuda.Device(DEVICE).synchronize()
        return cupy.asnumpy(buf)


def mine(count, rank=RANK):
    """Rank ``rank``'s values: distinct per rank and element, exact in float32."""
    return (np.arange(count) % 97 + 1000 * (rank + 1)).astype(np.float32)


def ran_through(fn):
    """fn() -> the one transport that ran it (debug's counters)."""
    before = debug.snapshot()
    fn()
    ran = debug.since(before, 'transport')
    assert len(ran) == 1, ran
    return next(iter(ran))


def one_rank(comm, count):
    """At one rank: each op through the transport the Comm hands out for its size."""
    for op in OPS:
        transport = comm.device_transport(DEVICE, 4 * count, op)
        assert transport.name == want(op, count), (op, count, transport.name)
        src = mine(count)
        buf, out = on_device(src), on_device(np.zeros(count, np.float32))
        with transport.scope():
            if op == 'broadcast':
                transport.bcast(buf, 0)
            elif op == 'allgather':
                transport.allgather(buf, [count], [0])
            elif op == 'reducescatter':
                transport.reduce_scatter(buf, out, [count])
            else:
                transport.alltoall(buf, out)
            transport.finish()
        got = read(out if op in ('reducescatter', 'alltoall') else buf)
        assert np.array_equal(got, src), (op, transport.name, got[:4], src[:4])
    return {op: want(op, count) for op in OPS}


def request(kind, buf, root=0):
    return Collective(kind, kind, np.dtype(buf.dtype), buf.shape, root=root, place='gpu',
                      view=buf)


def many_ranks(comm, count):
    """At several ranks: the store's path for each op, against numpy."""
    reducer = reduce_mod.Reducer(SIZE, None, None)
    ran, root = {}, SIZE - 1
    buf = on_device(mine(count))
    ran['broadcast'] = ran_through(lambda: reducer.bcast(request('bcast', buf, root), comm))
    assert np.array_equal(read(buf), mine(count, root)), 'broadcast from %d' % root
    counts, displs = pieces(count, SIZE)
    start, stop = displs[RANK], displs[RANK] + counts[RANK]
    buf = on_device(mine(count))
    ran['reducescatter'] = ran_through(
        lambda: reducer.reduce_scatter([request('reducescatter', buf)], comm))
    total = sum(mine(count, r) for r in range(SIZE))
    got = read(buf)
    assert np.array_equal(got[start:stop], total[start:stop]), 'reduce-scatter: my share'
    assert np.array_equal(got[stop:], mine(count)[stop:]), 'reduce-scatter: the rest kept'
    gathered = np.concatenate([mine(count, r)[displs[r]:displs[r] + counts[r]]
                               for r in range(SIZE)])
    buf = on_device(mine(count))
    ran['allgather'] = ran_through(lambda: reducer.allgather([request('allgather', buf)], comm))
    assert np.array_equal(read(buf), gathered), 'allgather'
    piece = count // SIZE
    send = on_device(mine(piece * SIZE))
    recv = on_device(np.zeros(piece * SIZE, np.float32))

    def alltoall():
        comm.alltoall(send, recv)
        comm.device_transport(DEVICE, send.nbytes, 'alltoall').finish()
    ran['alltoall'] = ran_through(alltoall)
    expected = np.concatenate([mine(piece * SIZE, r)[RANK * piece:(RANK + 1) * piece]
                               for r in range(SIZE)])
    assert np.array_equal(read(recv), expected), 'alltoall'
    return ran


if 'tune' in sys.argv[2:]:
    check_tune()
comm = comm_mod.Comm(WORLD, 'off', table=TABLE)
start = debug.snapshot()
for count in (SMALL, LARGE):
    ran = one_rank(comm, count) if SIZE == 1 else many_ranks(comm, count)
    assert ran == {op: want(op, count) for op in OPS}, (count, ran)
    if RANK == 0:
        print('%d bytes: %s' % (4 * count, ', '.join('%s through %s' % kv
                                                   for kv in sorted(ran.items()))))
if SIZE > 1:
    assert set(debug.since(start, 'transport')) == RAN, debug.since(start, 'transport')
assert set(comm.router.built) == RAN, comm.router.built
if RANK == 0:
    for name in sorted(RAN):
        print('transport %s ran' % name)
comm.free()
done('gpu_tune_ops[%s]' % '+'.join(sorted(RAN)))
