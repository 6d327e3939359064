"""Device (CuPy) buffers through one GPU transport, as the store runs them, without MXNet.

usage: gpu_transport.py TRANSPORT [EXPECT [mixed]]

TRANSPORT is the gpu_transport option (auto, nccl, cuda_mpi, staged); EXPECT is the
transport that must run (default: TRANSPORT), 'a+b' where each of a and b must run and
nothing else, or 'refused' where the ranks must all refuse it with ConfigError (NCCL with
two ranks on one GPU). 'mixed' gives the communicator a tune table whose device rows send
buffers under 512 KB through NCCL and larger ones through staged MPI.

Every bucket runs on a fresh thread, as on the store's communication threads, which have
no CuPy device or stream of their own; results are read on another, non-blocking stream,
so a bucket that completed before its stream finished reads stale data. Checked against
sums from (rank, size): six dtypes, more than 8 arrays fused, averaging, a broadcast
from the last rank, a local fusion failure and an unreadable array (zeros of the agreed
size on the device, the ranks stay paired), and which transport ran. Reduce-scatter and
allgather buckets (the sharded optimizer's) on the device: shares even (NCCL's own
collectives) and uneven, fused and alone, checked against numpy sums and the host path.
"""
import sys
import threading

import cupy
import numpy as np

from mpi_kvstore import debug
from mpi_kvstore.comm import host as comm_mod
from mpi_kvstore.comm import reduce as reduce_mod
from mpi_kvstore.comm import transports
from mpi_kvstore.comm.collective import Collective
from mpi_kvstore.comm.fusion import pieces, plan
from mpi_kvstore.comm.tuning import Table
from mpi_kvstore.errors import ConfigError

from common import RANK, SIZE, WORLD, close, done, expect_raises

TRANSPORT = sys.argv[1]
EXPECT = sys.argv[2] if len(sys.argv) > 2 else TRANSPORT
DTYPES = ('float16', 'float32', 'float64', 'int32', 'int64', 'uint8')
ARRAYS = 12                                   # fused into one bucket (more than 8)
DEVICE = RANK % cupy.cuda.runtime.getDeviceCount()
READER = cupy.cuda.Stream(non_blocking=True)  # the "next op" reads on a stream of its own
THRESHOLD = 64 << 20

RAN = set(EXPECT.split('+'))
TABLE = (Table([4], ['mpi'], SIZE, device=[(4096, 'nccl'), (64 << 20, 'staged')])
         if sys.argv[3:] == ['mixed'] else None)

comm = comm_mod.Comm(WORLD, 'off', gpu_transport=TRANSPORT, table=TABLE)
START = debug.snapshot()
failed = []                                   # (key, error) this rank's requests failed with


def fail(req, err):
    req.fail(err)
    failed.append((req.key, err))


def fail_all(reqs, err):
    """As Design.fail_all: host zeros for what could not be read (the reducer moves them
    to the device), and the failure recorded."""
    for req in reqs:
        req.withdraw()
        if req.error is None:
            fail(req, err)


reducer = reduce_mod.Reducer(SIZE, fail, fail_all)
seq = [0]


def on_fresh_thread(fn, *args):
    box = {}

    def run():
        try:
            box['value'] = fn(*args)
        except BaseException as err:
            box['error'] = err
    thread = threading.Thread(target=run)
    thread.start()
    thread.join(120)
    assert not thread.is_alive(), 'rank %d: a bucket hung' % RANK
    if 'error' in box:
        raise box['error']
    return box.get('value')


def request(key, buf, average=False, kind='allreduce', root=0, place='gpu', array=None,
            read=True):
    """A numbered request on ``buf``; ``read=False``: its array could not be read."""
    req = Collective(kind, key, np.dtype(buf.dtype), buf.shape, root=root, average=average,
                     place=place, array=array, seq=seq[0], view=buf if read else None)
    seq[0] += 1
    return req


def read(buf):
    """The buffer as the next op sees it: copied on another stream."""
    with cupy.cuda.Device(DEVICE):
        return cupy.asnumpy(buf, stream=READER)


def filled(n, dtype, scale):
    """Rank r's array: (r + 1) * scale + (j mod 3), small enough for uint8 and float16.
    Its stream is synchronised, as MXNet completes an op only once its GPU work is done
    (the transports read it on their own streams)."""
    with cupy.cuda.Device(DEVICE):
        array = (cupy.arange(n, dtype='int64') % 3 + (RANK + 1) * scale).astype(dtype)
        cupy.cuda.get_current_stream().synchronize()
        return array


def expected(n, scale, average=False, dtype='float64'):
    total = np.arange(n) % 3 * SIZE + scale * SIZE * (SIZE + 1) // 2
    if not average:
        return total
    return total / SIZE if np.dtype(dtype).kind == 'f' else total // SIZE


def run_buckets(reqs):
    for bucket in plan(reqs, 1 << 20, THRESHOLD):
        if bucket[0].kind == 'bcast':
            on_fresh_thread(reducer.bcast, bucket[0], comm)
        else:
            on_fresh_thread(reducer.allreduce, bucket, comm)


def check_dtypes():
    for dtype in DTYPES:
        for average in (False, True):
            bufs = [filled(1000 + 37 * i, dtype, i + 1) for i in range(ARRAYS)]
            reqs = [request('%s%d%s' % (dtype, i, average), b, average)
                    for i, b in enumerate(bufs)]
            buckets = plan(reqs, 1 << 20, THRESHOLD)
            assert len(buckets) == 1, 'all %d arrays fuse into one bucket' % ARRAYS
            run_buckets(reqs)
            for i, b in enumerate(bufs):
                close(read(b), expected(b.size, i + 1, average, dtype),
                      '%s allreduce (average=%s) of array %d' % (dtype, average, i))


def check_large():
    """One 64 MB buffer reduced in its own memory: long enough that a bucket completed
    before its stream finished would be read stale."""
    n = 16 << 20
    buf = filled(n, 'float32', 1)
    run_buckets([request('large', buf)])
    close(read(buf)[::4099], expected(n, 1)[::4099], 'a 64 MB allreduce')


def check_broadcast():
    root = SIZE - 1
    for dtype in DTYPES:
        buf = filled(5000, dtype, 10 + RANK)   # the root's differs from everyone else's
        with cupy.cuda.Device(DEVICE):
            want = cupy.asnumpy(buf) if RANK == root else None
        want = WORLD.bcast(want, root=root)
        run_buckets([request('b' + dtype, buf, kind='bcast', root=root)])
        close(read(buf), want, '%s broadcast from rank %d' % (dtype, root))


def run_on_fresh_thread(kind, bucket):
    on_fresh_thread(getattr(reducer, kind), bucket, comm)


def check_shares():
    """Reduce-scatter then allgather of device buckets. Each request's share r (the agreed
    cut, fusion.pieces) holds the sum after the reduce-scatter on rank r, the rest of its
    buffer is untouched; after the allgather every rank holds every share's sum. Sizes:
    a multiple of the ranks (equal shares: NCCL's reduceScatter and allGather), uneven
    ones, one element fewer than the ranks (empty shares), and 12 fused."""
    cases = [('even', [SIZE * 1000]), ('uneven', [1000 * SIZE + 3]),
             ('fused', [500 + 37 * i for i in range(ARRAYS)])]
    if SIZE > 2:
        cases.append(('tiny', [SIZE - 1]))
    for dtype in ('float32', 'float64', 'float16', 'int32'):
        for name, sizes in cases:
            for average in (False, True):
                label = '%s %s reduce-scatter (average=%s)' % (dtype, name, average)
                bufs = [filled(n, dtype, i + 1) for i, n in enumerate(sizes)]
                with cupy.cuda.Device(DEVICE):
                    before = [cupy.asnumpy(b) for b in bufs]
                reqs = [request('rs%s%s%s%d' % (dtype, name, average, i), b, average,
                                kind='reducescatter') for i, b in enumerate(bufs)]
                run_on_fresh_thread('reduce_scatter', reqs)
                host = [b.copy() for b in before]   # the host path, the same bucket
                host_reqs = [request('h' + r.key, h, average, kind='reducescatter',
                                     place='cpu') for r, h in zip(reqs, host)]
                run_on_fresh_thread('reduce_scatter', host_reqs)
                for i, b in enumerate(bufs):
                    counts, displs = pieces(b.size, SIZE)
                    start, stop = displs[RANK], displs[RANK] + counts[RANK]
                    got = read(b)
                    want = expected(b.size, i + 1, average, dtype)
                    close(got[start:stop], want[start:stop], label + ' of array %d' % i)
                    assert np.array_equal(got[:start], before[i][:start]) and \
                        np.array_equal(got[stop:], before[i][stop:]), label + ': outside the share'
                    assert np.array_equal(got, host[i]), label + ': the host path differs'
                label = label.replace('reduce-scatter', 'allgather')
                reqs = [request('ag%s%s%s%d' % (dtype, name, average, i), b,
                                kind='allgather') for i, b in enumerate(bufs)]
                run_on_fresh_thread('allgather', reqs)
                for i, b in enumerate(bufs):
                    close(read(b), expected(b.size, i + 1, average, dtype),
                          label + ' of array %d' % i)


class _Unreadable:
    """An array whose engine op could not read it (view None): only its context is known."""

    class context:
        device_id = DEVICE


def check_local_failures():
    """Rank 1's fusion fails once, then rank 0 cannot read one array: the others get the
    sum without that rank's part, the failing rank its error, and the next bucket is right
    on every rank (nobody skipped a collective)."""
    bad = 1 % SIZE
    real = reduce_mod._xp
    armed = [RANK == bad]

    class FailingConcatenate:
        def concatenate(self, views, out):
            armed[0] = False
            raise RuntimeError('rank %d: injected fusion failure' % RANK)

    reduce_mod._xp = lambda a: FailingConcatenate() if armed[0] else real(a)
    try:
        bufs = [filled(100 + i, 'float32', 1) for i in range(3)]
        run_buckets([request('fail%d' % i, b) for i, b in enumerate(bufs)])
    finally:
        reduce_mod._xp = real
    if RANK == bad:
        assert failed and 'injected fusion failure' in str(failed[-1][1]), failed
    else:
        for b in bufs:
            close(read(b), expected(b.size, 1) - (np.arange(b.size) % 3 + bad + 1),
                  'a fused sum without rank %d' % bad)
    unreadable = request('unreadable', filled(300, 'float32', 1),
                         array=_Unreadable() if RANK == 0 else None, read=RANK != 0)
    if RANK == 0:
        fail_all([unreadable], RuntimeError('rank 0: injected unreadable array'))
    run_buckets([unreadable])
    if RANK != 0:
        close(read(unreadable.view), expected(300, 1) - (np.arange(300) % 3 + 1),
              'a sum without rank 0\'s unreadable array')
    after = filled(4000, 'float32', 2)
    run_buckets([request('after', after)])
    close(read(after), expected(4000, 2), 'the bucket after the failures')


def check_transport_directly():
    """At one rank the store reduces nothing; the transport itself still runs here."""
    transport = transports.REGISTRY[EXPECT](comm, DEVICE)
    try:
        with transport.scope():
            buf = filled(3000, 'float32', 3)
            transport.allreduce(buf)
            transport.bcast(buf, 0)
            transport.finish()
        close(read(buf), expected(3000, 3), '%s at one rank' % EXPECT)
    finally:
        transport.free()


if EXPECT == 'refused':
    buf = filled(64, 'float32', 1)
    expect_raises(ConfigError, on_fresh_thread, reducer.allreduce, [request('r', buf)], comm,
                  contains='one GPU')
    assert comm.router.chosen is None
    if RANK == 0:
        print('%s refused on every rank: two ranks share one GPU' % TRANSPORT)
    done('gpu_transport[%s]' % TRANSPORT, chosen=comm.router.chosen)
    comm.free()
    sys.exit(0)

if SIZE == 1:
    assert transports.choose(comm, TRANSPORT, DEVICE) == EXPECT
    check_transport_directly()
check_dtypes()
check_large()
check_broadcast()
check_shares()
if SIZE > 1:   # at one rank the store reduces nothing, so nothing can fail
    check_local_failures()
ran = debug.since(START, 'transport')
mpi_calls = debug.since(START, 'algorithm').get('mpi', 0)   # host MPI_Allreduce calls
if SIZE > 1:
    assert comm.router.chosen in RAN and set(ran) == RAN, (comm.router.chosen, ran)
    assert mpi_calls > 0 if RAN & {'staged', 'cuda_mpi'} else mpi_calls == 0, mpi_calls
    if RANK == 0:
        for name in sorted(RAN):
            print('transport %s ran %d collectives' % (name, ran[name]))
chosen = comm.router.chosen
comm.free()
done('gpu_transport[%s->%s]' % (TRANSPORT, EXPECT), chosen=chosen, ran=dict(ran),
     mpi_calls=mpi_calls, failed=[key for key, _ in failed])
