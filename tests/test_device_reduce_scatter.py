"""The sharded optimizer's compressed reduce-scatter, host and device alike (seed 003 on
device buffers): which path a bucket takes, and the sums.

The device path is WireCast.reduce_scatter on CuPy arrays: CuPy's cast kernels and the
device transport's all-to-all, around the code the host path runs. Here, without a GPU:
the choice of path (comm.reduce.shares_route, through Reducer.reduce_scatter), where the
16-bit pieces go (compression.buckets.alltoall: the transport the bucket's own size takes),
and the shared code against numpy at 2 and 3 ranks (tests/scenarios/compressed_shares.py).
tests/test_gpu.py runs the device path itself against numpy and the host path.
"""
import contextlib
import types

import numpy as np
import pytest

from mpi_kvstore import compression, debug
from mpi_kvstore.comm import reduce as reduce_mod
from mpi_kvstore.comm.collective import Collective
from mpi_kvstore.comm.reduce import Reducer, shares_route
from mpi_kvstore.compression import buckets

from mpi_harness import run_mpi

CODECS = {'none': None, 'fp16': compression.wire_cast('fp16'),
          'bf16-ring': compression.wire_cast('bf16-ring'), '2bit': compression.TwoBit(0.5)}


def _bucket(place, codec, sizes=(5, 3)):
    """``codec``: a name in CODECS, or the codec itself."""
    codec = CODECS[codec] if isinstance(codec, str) else codec
    return [Collective('reducescatter', 'k%d' % i, np.dtype('float32'), (n,), place=place,
                       average=True, seq=i, view=np.arange(n, dtype=np.float32), codec=codec)
            for i, n in enumerate(sizes)]


@pytest.mark.parametrize('place, codec, route', [
    ('cpu', 'none', 'plain'), ('gpu', 'none', 'plain'),
    ('cpu', 'fp16', 'coded'), ('gpu', 'fp16', 'coded'), ('gpu', 'bf16-ring', 'coded'),
    ('cpu', '2bit', 'coded'),
    ('gpu', '2bit', 'allreduce'),   # TwoBit reduce-scatters host memory only
])
def test_shares_route_by_place_and_codec(place, codec, route):
    assert shares_route(_bucket(place, codec)) == route


class _Recorder:
    """A codec and a two-rank host communicator that record what the Reducer asks of
    them and change nothing: the test is about which call runs."""

    size, rank, spec = 2, 0, ('fake',)

    def __init__(self, device_shares):
        self.device_shares, self.calls = device_shares, []

    def reduce_scatter(self, *args):
        self.calls.append('codec.reduce_scatter' if len(args) == 2 else 'comm.reduce_scatter')
        return {}

    def exchange(self, reqs, comm):
        self.calls.append('codec.exchange')
        return {}


@pytest.mark.parametrize('place, device_shares, codec, calls', [
    ('gpu', True, True, ['codec.reduce_scatter']),     # the wire casts: 16 bits on the GPU
    ('gpu', False, True, ['codec.exchange']),          # 2-bit: the whole bucket, allreduced
    ('cpu', False, True, ['codec.reduce_scatter']),    # on the host, every codec's own
    ('gpu', True, False, ['comm.reduce_scatter']),     # uncompressed: the transport's
])
def test_the_reducer_takes_the_route(monkeypatch, place, device_shares, codec, calls):
    """Reducer.reduce_scatter on a two-rank bucket; the device scope (CuPy's device and
    stream) is replaced by the host's, which is all a GPU-less machine can run."""
    monkeypatch.setattr(reduce_mod, '_scope', lambda bucket, comm, op='allreduce': contextlib.nullcontext())
    fake = _Recorder(device_shares)
    reqs = _bucket(place, fake if codec else 'none')
    Reducer(2, None, None).reduce_scatter(reqs, fake)
    assert fake.calls == calls


class _Transport:
    def __init__(self, device):
        self.device, self.name, self.calls = device, 'fake', []

    def alltoall(self, send, recv):
        self.calls.append((send, recv))


class _DeviceComm:
    """What buckets.alltoall asks of a Comm for device buffers."""

    def __init__(self, transport):
        self.transport, self.asked, self.routed = transport, [], []
        self.router = types.SimpleNamespace(run=self._run)

    def device_transport(self, device, nbytes, op='allreduce'):
        self.asked.append((device, nbytes, op))
        return self.transport

    def _run(self, buf, fn, *more, op='allreduce', nbytes=None):
        self.routed.append((buf, op, nbytes))
        fn(self.transport, buf, *more)


def _on_device(device):
    return types.SimpleNamespace(device=types.SimpleNamespace(id=device))


def test_device_pieces_take_the_transport_of_the_buckets_size():
    """The transport reduce.py's scope made current: chosen by the bucket's bytes (4000
    here), not the halved buffer's, so one stream orders the casts and the all-to-all."""
    send, recv = _on_device(0), _on_device(0)
    comm = _DeviceComm(_Transport(0))
    before = debug.snapshot()
    buckets.alltoall(comm, send, recv, 4000)
    assert comm.asked == [(0, 4000, 'alltoall')] and comm.transport.calls == [(send, recv)]
    assert comm.routed == [] and debug.since(before, 'transport') == {'fake': 1}


def test_device_pieces_on_another_device_go_through_the_router():
    send, recv = _on_device(1), _on_device(1)
    comm = _DeviceComm(_Transport(0))
    buckets.alltoall(comm, send, recv, 4000)
    assert comm.routed == [(send, 'alltoall', 4000)] and comm.transport.calls == [(send, recv)]


def test_host_pieces_take_mpi_alltoall():
    calls = []
    comm = types.SimpleNamespace(alltoall=lambda send, recv: calls.append((send, recv)))
    send, recv = np.zeros(4, np.uint16), np.zeros(4, np.uint16)
    buckets.alltoall(comm, send, recv, 16)
    assert len(calls) == 1 and calls[0][0] is send and calls[0][1] is recv


def test_compressed_shares_equal_numpy(mpi_available):
    """fp16, bf16 and the fp16 ring's reduce-scatter of float32 and float64 buckets, alone
    (uneven shares), fused (odd sizes) and tiny (empty shares), with and without averaging,
    at 3 ranks and then 2 of them (one job): each rank's share bit for bit numpy's sum of
    the ranks' 16-bit gradients, the rest of its buffer untouched; an fp16 overflow in one
    share fails the bucket on every rank."""
    out = run_mpi(3, 'compressed_shares.py', timeout=120)
    for ranks in (3, 2):
        assert 'compressed_shares: 84 shares at %d ranks equal numpy' % ranks in out, out[-3000:]
    assert 'compressed_shares: OK at 3 ranks' in out, out[-3000:]
