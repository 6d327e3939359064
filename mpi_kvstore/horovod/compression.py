"""Horovod's ``Compression`` names, mapped to the store's codecs, and a user compressor's
compress/decompress around the exchange."""
from __future__ import annotations

import numpy as np

from ..store.kvstore import MPIKVStore
from .ops import _set_store
from .process_sets import store_options


# -- compression ------------------------------------------------------------------------------
class Compressor:
    """Horovod's interface: ``compress(tensor) -> (tensor, ctx)``, ``decompress(tensor, ctx)``.
    A compressor of this module also names what the store does for it in a trainer:
    ``store_compression`` (the wire cast, config's compression) and ``params``
    (set_gradient_compression's)."""

    name = 'none'
    store_compression = 'none'
    params = None

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class NoneCompressor(Compressor):
    """No compression (the default)."""


class FP16Compressor(Compressor):
    """Float gradients travel as float16. In a trainer the store casts on the wire and sums in
    float32 (Horovod sums float16); ``compress``/``decompress`` cast, as Horovod's do."""

    name = 'fp16'
    store_compression = 'fp16'

    @staticmethod
    def compress(tensor):
        if 'float' in str(np.dtype(tensor.dtype)):
            return tensor.astype('float16', copy=False), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        if 'float' in str(np.dtype(ctx)):
            return tensor.astype(ctx, copy=False)
        return tensor


class BF16Compressor(Compressor):
    """Float gradients travel as bfloat16, summed in float32 (the store's compression='bf16');
    not in Horovod's MXNet API. compress/decompress leave the tensor as it is: the store
    casts."""

    name = 'bf16'
    store_compression = 'bf16'


class TwoBitCompressor(Compressor):
    """MXNet's 2-bit compression with error feedback (set_gradient_compression, threshold
    0.5 unless given: ``Compression.twobit_threshold(t)``); not in Horovod. Only in a
    trainer: compress/decompress leave the tensor as it is."""

    name = '2bit'
    threshold = 0.5

    @classmethod
    def params_(cls):
        return {'type': '2bit', 'threshold': cls.threshold}


class Compression:
    """Gradient compression for DistributedTrainer: Horovod's ``none`` and ``fp16``, and the
    store's ``bf16`` and ``twobit`` (``twobit_threshold(t)`` for another threshold)."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
    twobit = TwoBitCompressor

    @staticmethod
    def twobit_threshold(threshold: float) -> type[TwoBitCompressor]:
        """A 2-bit compressor of this threshold (> 0)."""
        if not float(threshold) > 0:
            raise ValueError('2-bit compression needs a threshold > 0, not %r' % (threshold,))
        return type('TwoBitCompressor', (TwoBitCompressor,), {'threshold': float(threshold)})


def _ours(compression):
    return isinstance(compression, type) and issubclass(compression, Compressor)


def _trainer_store(process_set, compression):
    """The store a trainer of this set and compression exchanges through (created once per
    kind, collectively on the set's members)."""
    base = _set_store(process_set, 'DistributedTrainer')
    if not _ours(compression) or compression.name == 'none':
        return base
    key = (compression.name, getattr(compression, 'threshold', None))
    kv = process_set._stores.get(key)
    if kv is None:
        # a communicator of the same members, duplicated in the store's collective order
        comm = base.collectives.run(lambda comm: comm.Dup(), 'hvd.dup')
        kv = MPIKVStore('dist_mpi', comm=comm,
                        **dict(store_options(), compression=compression.store_compression))
        comm.Free()   # the store keeps its own duplicate
        if compression.name == '2bit':
            kv.set_gradient_compression(compression.params_())
        process_set._stores[key] = kv
    return kv

