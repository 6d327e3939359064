"""The MXNet key/value grammar, normalised and validated on the user's thread.

key   : int or str, or a list of them (not mixed)
value : an NDArray, or a list of NDArrays (one per device, summed first);
        for a list of keys, one such entry per key
out   : the same grammar; None means in place into value
"""
import mxnet as mx
import numpy as np

from ..engine.arrays import array_meta

__all__ = ['normalize', 'check_root', 'normalize_out', 'check_dense', 'check_priority', 'Entry',
           'SUPPORTED_DTYPES']

SUPPORTED_DTYPES = tuple(np.dtype(t) for t in
                         ('float32', 'float64', 'float16', 'int32', 'int64', 'int8', 'uint8'))


# Priorities travel in the collective's signature and order rounds: keep them small ints.
_PRIORITY_LIMIT = 1 << 30


def check_priority(priority):
    """priority: an int (gluon and Module pass -index), not a bool, a str or a float."""
    if isinstance(priority, bool) or not isinstance(priority, (int, np.integer)):
        raise TypeError('priority must be an int, not %r (%s)'
                        % (priority, type(priority).__name__))
    if not -_PRIORITY_LIMIT < priority < _PRIORITY_LIMIT:
        raise ValueError('priority must lie between -2**30 and 2**30, not %d' % priority)


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


def _meta(arr):
    """(shape, dtype, stype): each is a call into libmxnet, so ask once per array."""
    shape, dtype, stype = array_meta(arr)
    if dtype is None:
        raise TypeError('array of shape %s has a dtype numpy cannot represent (%s)'
                        % (shape, arr.dtype))
    return shape, dtype, stype


def check_dense(key, arrays, what):
    """Same shape and dtype across devices, dense, and a dtype MPI can sum -> (shape, dtype)."""
    metas = [_meta(arr) for arr in arrays]
    shape, dtype, _ = metas[0]
    if not shape:
        raise TypeError('%s for key %r is a 0-d array (shape ()), which MXNet 1.9.1 cannot '
                        'allocate buffers for: reshape it to (1,)' % (what, key))
    for other_shape, other_dtype, stype in metas:
        if stype != 'default':
            raise TypeError('%s for key %r is %s; mpi_kvstore reduces dense arrays only'
                            % (what, key, stype))
        if other_shape != shape or other_dtype != dtype:
            raise ValueError('%s arrays for key %r differ between devices: %s %s vs %s %s'
                             % (what, key, shape, dtype.name, other_shape, other_dtype.name))
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError('%s for key %r has dtype %s, which mpi_kvstore cannot reduce; '
                        'supported: %s' % (what, key, dtype.name,
                                           ', '.join(d.name for d in SUPPORTED_DTYPES)))
    return shape, dtype


class Entry:
    """One key of a call: its arrays, and the shape and dtype they share."""

    __slots__ = ('key', 'values', 'outs', 'shape', 'dtype')

    def __init__(self, key, values, outs, shape, dtype):
        self.key, self.values, self.outs, self.shape, self.dtype = key, values, outs, shape, dtype


def _entry(key, values, outs):
    shape, dtype = check_dense(key, values, 'value')
    if outs is not None:
        out_shape, out_dtype = check_dense(key, outs, 'out')
        if (out_shape, out_dtype) != (shape, dtype):
            raise ValueError('out for key %r has shape %s and dtype %s, but value has shape %s '
                             'and dtype %s' % (key, out_shape, out_dtype.name, shape, dtype.name))
    return Entry(key, values, outs, shape, dtype)


def normalize(key, value, out=None):
    """-> list of validated :class:`Entry` (outs None means in place)."""
    keys, single = _keys(key)
    values = _per_key(value, keys, single, 'value')
    outs = _per_key(out, keys, single, 'out') if out is not None else [None] * len(keys)
    return [_entry(k, v, o) for k, v, o in zip(keys, values, outs)]


def normalize_out(key, out):
    """For pull: -> list of validated :class:`Entry` whose values are the outs."""
    keys, single = _keys(key)
    outs = _per_key(out, keys, single, 'out')
    return [Entry(k, o, o, *check_dense(k, o, 'out')) for k, o in zip(keys, outs)]


def check_root(root, size):
    """root: a rank of a ``size``-process store."""
    if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < size:
        raise ValueError('root must be a rank of this %d-process store (0..%d), not %r'
                         % (size, size - 1, root))
