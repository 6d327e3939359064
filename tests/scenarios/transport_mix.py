"""Device transports mixed by message size from a tune table, on this CPU-only machine.

Two stand-in transports play the GPU ones: they take "device" buffers (numpy memory behind
an object that is not an ndarray, as a CuPy array is not) and reduce them over host MPI,
recording what ran and each hand-over of control. Comm's own logic runs as it is: the
collective agreement of which transports every rank can use, the table's choice per
size, the hand-over (Transport.follow) and the fallback where the table names a
transport that cannot run here. The sums are checked against numpy. test_gpu.py runs the
real transports where a GPU exists.
"""
import sys

# No MXNet: nothing here needs it (the MXNet-free contract), and each rank starts about
# 3 s of CPU sooner.
sys.modules.setdefault('mxnet', None)

import numpy as np  # noqa: E402

from mpi_kvstore import debug  # noqa: E402
from mpi_kvstore.comm import transports  # noqa: E402
from mpi_kvstore.comm.host import Comm  # noqa: E402
from mpi_kvstore.comm.transports.base import Transport, register  # noqa: E402
from mpi_kvstore.comm.tuning import Table  # noqa: E402
from mpi_kvstore.errors import ConfigError  # noqa: E402

from common import RANK, SIZE, WORLD, done  # noqa: E402

HANDOVERS = []   # (to, from): every Transport.follow, in order


class _Device:
    id = 0


class DeviceArray:
    """What Comm reads of a CuPy array: device.id, nbytes, and it is not an ndarray."""
    device = _Device()

    def __init__(self, host):
        self.host = host
        self.nbytes, self.shape, self.dtype = host.nbytes, host.shape, host.dtype


class StandIn(Transport):
    def __init__(self, comm, device):   # no CuPy: no stream, no device
        self.comm, self.device, self.stream = comm, device, None
        self.built_at = len(HANDOVERS)

    def allreduce(self, buf, algorithm='mpi'):
        self.comm.allreduce_host(buf.host, algorithm)

    def bcast(self, buf, root):
        self.comm.bcast_host(buf.host, root)

    def _unused(self, *args):
        raise AssertionError('%s: this scenario runs allreduce and broadcast only' % self.name)

    reduce_scatter = allgather = alltoall = _unused

    def follow(self, other):
        HANDOVERS.append((self.name, other.name))

    def finish(self):
        pass


@register
class Small(StandIn):
    name = 'small'


@register
class Large(StandIn):
    name = 'large'
    concurrent_safe = False     # as NCCL: the concurrent design's lanes must not use it


@register
class Rank0Only(StandIn):
    """Usable on rank 0 alone: the agreement must drop it on every rank."""
    name = 'rank0only'

    @classmethod
    def usable(cls, comm):
        return (True, '') if comm.rank == 0 else (False, 'missing on this rank')


# No GPU here: no two ranks share one, and auto's order holds the stand-ins.
transports.devices_shared = lambda comm, device: False
transports.AUTO_ORDER = ('small',) + transports.AUTO_ORDER


def table(rows):
    return Table([4], ['mpi'], SIZE, device=rows)


def summed(n, comm):
    """An allreduce of n floats through comm; checked against numpy."""
    data = np.arange(n, dtype=np.float32) * (RANK + 1)
    comm.allreduce(DeviceArray(data))
    expected = np.arange(n, dtype=np.float64) * SIZE * (SIZE + 1) / 2
    np.testing.assert_allclose(data, expected, rtol=1e-6, err_msg='%d floats' % n)


def ran(before):
    return debug.since(before, 'transport')


# 1. Round trip, and a name no transport has is refused.
rows = [(4096, 'small'), (1 << 20, 'large')]
assert Table.from_json(table(rows).to_json()).device.values == ['small', 'large']
try:
    table([(4096, 'carrier-pigeon')])
    raise AssertionError('an unknown transport was accepted')
except ValueError as err:
    assert 'carrier-pigeon' in str(err), err

# 2. By size: 4 KB and under 'small', from the log-scale midpoint (64 KB) on 'large';
# each hand-over is recorded once, in order, and the sums are numpy's.
comm = Comm(WORLD, 'off', table=table(rows))
before = debug.snapshot()
for n in (16, 1000, 16384, 300000, 16, 16):
    summed(n, comm)
assert comm.router.chosen == 'small', comm.router.chosen          # auto's own choice
by_size, handovers = ran(before), list(HANDOVERS)
assert by_size == {'small': 4, 'large': 2}, by_size
assert handovers == [('large', 'small'), ('small', 'large')], handovers
assert comm.device_transport(0, 65536).name == 'large'   # the midpoint is the larger's
assert comm.device_transport(0, 65535).name == 'small'
b = np.full(5, float(RANK), np.float32)                   # a broadcast takes its size's too
comm.bcast(DeviceArray(b), SIZE - 1)
np.testing.assert_array_equal(b, SIZE - 1)
comm.free()

# 3. A named gpu_transport wins over the table.
HANDOVERS.clear()
comm = Comm(WORLD, 'off', table=table(rows), gpu_transport='large')
before = debug.snapshot()
for n in (16, 300000):
    summed(n, comm)
named = ran(before)
assert named == {'large': 2} and HANDOVERS == [], (named, HANDOVERS)
comm.free()

# 4. Rows that cannot run here give way to auto's choice on every rank alike: one that
# only rank 0 can use, and one the concurrent design's lanes must not use.
comm = Comm(WORLD, 'off', table=table([(4096, 'rank0only'), (1 << 20, 'large')]),
            concurrent=True)
before = debug.snapshot()
for n in (16, 300000):
    summed(n, comm)
fallback, built = ran(before), sorted(comm.router.built)
assert fallback == {'small': 2}, fallback
assert built == ['small'], built
comm.free()

# 5. rank0only named outright fails on every rank alike, with the reason.
comm = Comm(WORLD, 'off', gpu_transport='rank0only')
try:
    summed(16, comm)
    raise AssertionError('rank0only was used')
except ConfigError as err:
    assert 'rank0only' in str(err), err
comm.free()
done('transport_mix', by_size=by_size, handovers=handovers, named=named, fallback=fallback,
     built=built)
