"""Gradient compression: codecs that run a bucket's exchange in fewer bytes.

wire.py holds WireCast, twobit.py TwoBit, kernels.py their compiled host kernels and
buckets.py what both do to a bucket; this module builds them from the options.

Horovod's compression.py wraps a compress and a decompress around the
allreduce. Compressed values cannot be summed by MPI (it has no float16 or
bfloat16 SUM, and 2-bit codes do not add up), so here a codec runs the whole
exchange of a bucket instead, and the bucket runner calls it in place of the
allreduce (reduce.Reducer). Two kinds:

- :class:`WireCast` (store option ``compression``: 'fp16' or 'bf16'): float32
  and float64 gradients travel as 16-bit floats. Each rank prescales by 1/N
  (against float16 overflow), an all-to-all hands chunk j of every rank to rank
  j, which sums them in float32 in rank order, and an allgather brings the
  16-bit sums back. Every rank decodes the same bits, so results are bitwise
  identical everywhere, in the original dtype. Wire bytes: those of a ring
  allreduce at half the width.
- :class:`TwoBit` (``kv.set_gradient_compression({'type': '2bit',
  'threshold': t})``), with MXNet's semantics (src/kvstore/
  gradient_compression-inl.h): per key, ``residual += grad``; a value
  ``>= t`` sends ``+t`` and keeps ``residual - t``, a value ``<= -t`` sends
  ``-t`` and keeps ``residual + t``, any other sends 0. Four values per byte
  (16 per float32, as MXNet packs them). The result of a pushpull is the sum
  over ranks of the values sent. Codes cannot be summed, so every rank
  allgathers every rank's codes and counts: ``t * (#(+t) - #(-t))``. An
  allgather moves N times the codes, which beats a float32 allreduce while
  N < 32; from ``two_phase_min_ranks`` (32) ranks on, a two-phase exchange
  requantises the sums at each chunk's owner (TwoBit).

On GPU arrays the codecs encode and decode with CuPy kernels (device.py), bit for
bit as here, and only the compressed bytes cross to the host for MPI.

A codec's name and parameters (``spec``) are part of every request's
signature, so ranks that compress differently get a RankMismatchError, not a
hang. A rank whose own encoding fails still takes part, with zeros, and fails
that request (ranks stay paired).

It may import ``comm`` and the root modules, and CuPy for GPU arrays, never MXNet: the
designs and the store call the codecs.
"""
import math

import numpy as np

from ..config import COMPRESSIONS
from .buckets import sign
from .twobit import TwoBit
from .wire import WireCast

__all__ = ['WireCast', 'TwoBit', 'wire_cast', 'from_params', 'from_spec', 'sign', 'WIRE_TYPES']

WIRE_TYPES = COMPRESSIONS   # the option's values (config owns the vocabulary)


def wire_cast(kind):
    """The store option ``compression`` -> a WireCast, or None for 'none'."""
    if kind not in WIRE_TYPES:
        raise ValueError("compression must be one of %s, not %r" % (WIRE_TYPES, kind))
    if kind == 'none':
        return None
    name, _, ring = kind.partition('-')
    return WireCast(name, ring=bool(ring))


def from_params(params, two_phase_min_ranks=32):
    """``set_gradient_compression``'s dict -> a TwoBit, or None for {'type': 'none'}.

    Raises a ValueError that says what is wrong, before anything changes.
    """
    if not isinstance(params, dict):
        raise ValueError('set_gradient_compression takes a dict like {"type": "2bit", '
                         '"threshold": 0.5}, not %r' % (params,))
    kind = params.get('type')
    unknown = sorted(set(params) - {'type', 'threshold'})
    if unknown:
        raise ValueError('set_gradient_compression: unknown parameter(s) %s in %r (known: '
                         'type, threshold)' % (unknown, params))
    if kind == 'none':
        return None
    if kind != '2bit':
        raise ValueError("set_gradient_compression: type must be '2bit' or 'none', not %r "
                         "(MXNet's '1bit' is not supported)" % (kind,))
    threshold = params.get('threshold', 0.5)     # MXNet's default
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float, np.floating)):
        raise ValueError('set_gradient_compression: threshold must be a positive number, not %r'
                         % (threshold,))
    threshold = float(threshold)
    if not math.isfinite(threshold) or not threshold > 0 or not np.isfinite(np.float32(threshold)):
        raise ValueError('set_gradient_compression: threshold must be a positive finite number '
                         '(as a float32), not %r' % (params.get('threshold'),))
    return TwoBit(threshold, two_phase_min_ranks)


def from_spec(spec):
    """A codec from a request's spec (a joined rank's mirror of another rank's request)."""
    if spec is None:
        return None
    if spec[0] == '2bit':
        return TwoBit(*spec[1:])
    return WireCast(spec[0], ring=spec[1:] == ('ring',))
