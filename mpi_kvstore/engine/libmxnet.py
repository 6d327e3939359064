"""The ctypes handle on libmxnet that core.py, arrays.py and records.py share.

Quick, non-blocking calls are bound through PyDLL, which keeps the GIL across
the call: through CDLL every call gives the GIL up and queues to get it back
behind the engine and communication threads, which costs more than the call.
"""
import ctypes

from mxnet.base import _LIB

__all__ = ['bind', 'bind_plain', 'last_error', 'address_of']

_QUICK = ctypes.PyDLL(_LIB._name)
_RELEASED = ctypes.CDLL(_LIB._name)
_LIB.MXGetLastError.restype = ctypes.c_char_p


def bind(name, *argtypes, release_gil=False):
    """libmxnet's ``name`` (returning int), called with the GIL held (``release_gil``:
    given up during the call, for a call that may wait)."""
    fn = getattr(_RELEASED if release_gil else _QUICK, name)
    fn.restype, fn.argtypes = ctypes.c_int, list(argtypes)
    return fn


def bind_plain(name):
    """libmxnet's ``name`` (returning int), called with the GIL held and without argument
    types: its caller passes ctypes objects (a pointer as c_void_p, an int as c_int),
    made once where they can be, since converting a dozen arguments on every call
    cost as much as the call itself."""
    fn = _QUICK[name]   # a function object of its own: getattr's is shared with bind's
    fn.restype = ctypes.c_int
    return fn


def last_error():
    """The message of the last failed libmxnet call on this thread."""
    return _LIB.MXGetLastError().decode()


def address_of(name):
    """The address of libmxnet's C function ``name``, for native code to call."""
    return ctypes.cast(getattr(_LIB, name), ctypes.c_void_p).value
