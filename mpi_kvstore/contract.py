"""The MXNet key/value grammar, normalised and validated on the user's thread.

key   : int or str, or a list of them (not mixed)
value : an NDArray, or a list of NDArrays (one per device, summed first);
        for a list of keys, one such entry per key
out   : the same grammar; None means in place into value
"""
import numpy as np
import mxnet as mx

__all__ = ['normalize', 'check_dense', 'SUPPORTED_DTYPES', 'UnknownKeyError']

SUPPORTED_DTYPES = tuple(np.dtype(t) for t in
                         ('float32', 'float64', 'float16', 'int32', 'int64', 'int8', 'uint8'))


class UnknownKeyError(KeyError):
    """A key was used before init() or broadcast() registered it."""

    def __str__(self):
        return str(self.args[0]) if self.args else ''


def _is_array(obj):
    return isinstance(obj, mx.nd.NDArray)


def _keys(key):
    if isinstance(key, (int, np.integer, str)):
        return [key], True
    if isinstance(key, (list, tuple)) and key:
        keys = list(key)
        kinds = {isinstance(k, str) for k in keys}
        if all(isinstance(k, (int, np.integer, str)) for k in keys) and len(kinds) == 1:
            return keys, False
        raise TypeError('keys must be all int or all str, not mixed: %r' % (key,))
    raise TypeError('key must be an int, a str, or a non-empty list of them; got %r' % (key,))


def _arrays(entry, what, key):
    """One key's entry: an NDArray or a non-empty list of NDArrays."""
    arrays = [entry] if _is_array(entry) else entry
    if not isinstance(arrays, (list, tuple)) or not arrays or not all(map(_is_array, arrays)):
        raise TypeError('%s for key %r must be an NDArray or a non-empty list of NDArrays; '
                        'got %s' % (what, key, type(entry).__name__))
    return list(arrays)


def _per_key(entries, keys, single, what):
    if single:
        return [_arrays(entries, what, keys[0])]
    if _is_array(entries) or not isinstance(entries, (list, tuple)) or len(entries) != len(keys):
        raise ValueError('%s must be a list with one entry per key (%d keys); got %s'
                         % (what, len(keys), _describe(entries)))
    return [_arrays(e, what, k) for e, k in zip(entries, keys)]


def _describe(obj):
    if isinstance(obj, (list, tuple)):
        return 'a list of %d' % len(obj)
    return type(obj).__name__


def check_dense(key, arrays, what):
    """Same shape and dtype across devices, dense, and a dtype MPI can sum."""
    first = arrays[0]
    for arr in arrays:
        if arr.stype != 'default':
            raise TypeError('%s for key %r is %s; mpi_kvstore reduces dense arrays only'
                            % (what, key, arr.stype))
        if arr.shape != first.shape or arr.dtype != first.dtype:
            raise ValueError('%s arrays for key %r differ between devices: %s %s vs %s %s'
                             % (what, key, first.shape, np.dtype(first.dtype).name,
                                arr.shape, np.dtype(arr.dtype).name))
    if np.dtype(first.dtype) not in SUPPORTED_DTYPES:
        raise TypeError('%s for key %r has dtype %s, which mpi_kvstore cannot reduce; '
                        'supported: %s' % (what, key, np.dtype(first.dtype).name,
                                           ', '.join(d.name for d in SUPPORTED_DTYPES)))


def check_same(key, values, outs):
    ref = values[0]
    for out in outs:
        if out.shape != ref.shape or out.dtype != ref.dtype:
            raise ValueError('out for key %r has shape %s and dtype %s, but value has shape %s '
                             'and dtype %s' % (key, out.shape, np.dtype(out.dtype).name,
                                               ref.shape, np.dtype(ref.dtype).name))


def normalize(key, value, out=None):
    """-> list of (key, [value arrays], [out arrays] or None), validated."""
    keys, single = _keys(key)
    values = _per_key(value, keys, single, 'value')
    outs = _per_key(out, keys, single, 'out') if out is not None else [None] * len(keys)
    for k, vals, outs_k in zip(keys, values, outs):
        check_dense(k, vals, 'value')
        if outs_k is not None:
            check_dense(k, outs_k, 'out')
            check_same(k, vals, outs_k)
    return list(zip(keys, values, outs))


def normalize_out(key, out):
    """For pull: -> list of (key, [out arrays])."""
    keys, single = _keys(key)
    outs = _per_key(out, keys, single, 'out')
    for k, outs_k in zip(keys, outs):
        check_dense(k, outs_k, 'out')
    return list(zip(keys, outs))
