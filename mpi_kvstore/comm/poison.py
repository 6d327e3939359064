"""What a failed collective leaves in its output (deferred.py says why): never a
plausible number. No MXNet here: device transports use it on CuPy arrays alone."""
import numpy as np

__all__ = ['poison', 'poison_value']


def poison_value(dtype):
    """The value a failed collective leaves in its output, by dtype."""
    dtype = np.dtype(dtype)
    if dtype.kind == 'f':
        return np.nan
    if dtype.kind == 'i':
        return np.iinfo(dtype).min
    if dtype.kind == 'u':
        return np.iinfo(dtype).max
    raise TypeError('no poison value for dtype %s' % dtype)


def poison(buf):
    """Fill a numpy or CuPy buffer with :func:`poison_value` of its dtype (None: nothing)."""
    if buf is not None:
        buf.fill(poison_value(buf.dtype))
