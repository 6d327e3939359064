"""A collective request is built whole: its codec, shard and signature are decided before
construction (store.keys.request, designs.join.mirror), and a joined rank's mirror plans
exactly as the active rank's request (the same signature, unit, codec and size)."""
import zlib

import mxnet as mx
import numpy as np

from mpi_kvstore import compression
from mpi_kvstore.comm.collective import SIG_LIMIT, Collective
from mpi_kvstore.designs import join
from mpi_kvstore.store.contract import normalize
from mpi_kvstore.store.keys import KeyState, request


def _crc(text):
    return zlib.crc32(text.encode()) % SIG_LIMIT


def _state(key, shape, dtype='float32'):
    entry, = normalize(key, mx.nd.zeros(shape, dtype=dtype))
    return KeyState(entry)


def test_a_compressed_request_is_signed_with_its_codec_at_construction():
    state = _state('w', (3, 4))
    codec = compression.TwoBit(0.5, 32)
    req = request('reducescatter', state, state.stored(), codec=codec, shard=True)
    # the signature written out from its definition (comm.collective.signature, then
    # compression.sign): kind, key, dtype, shape, root; then the codec's spec
    plain = _crc("reducescatter|'w'|float32|(3, 4)|0")
    assert req.sig == _crc('%d|%r' % (plain, codec.spec))
    assert req.codec is codec and req.shard is True and req.in_place is False
    assert req.nbytes == 48 and req.place == 'cpu'
    bare = request('reducescatter', state, state.stored())
    assert bare.sig == plain and bare.codec is None and bare.shard is False


def test_a_mirror_plans_as_the_active_rank_request():
    dtype = np.dtype('float32')
    active = Collective('reducescatter', ('rows', 1), dtype, (100, 10), unit=10,
                        codec=compression.WireCast('fp16'), shard=True, average=True,
                        priority=-3, seq=17)
    # a unit of 10 elements is part of the signature, once
    assert active.sig == (_crc("reducescatter|('rows', 1)|float32|(100, 10)|0") * 31 + 10) \
        % SIG_LIMIT
    mirror = join.mirror(join.describe(active))
    for slot in ('seq', 'kind', 'key', 'dtype', 'shape', 'nbytes', 'root', 'sig', 'place',
                 'average', 'priority', 'unit', 'shard'):
        assert getattr(mirror, slot) == getattr(active, slot), slot
    assert mirror.codec.spec == active.codec.spec and mirror.mirror and not active.mirror
    assert mirror.view.dtype == dtype and mirror.view.shape == (1000,) and not mirror.view.any()
