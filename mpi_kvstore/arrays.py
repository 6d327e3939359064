"""NDArray memory seen as numpy (host) or CuPy (GPU) arrays, without copies.

Called inside an engine op that holds the array, so nothing here may wait on
the engine. CuPy is imported lazily, only when a GPU array shows up.
"""
import ctypes

import numpy as np

from .engine import array_pointer

__all__ = ['flat_view', 'require_cupy']

# DLPack device types
_DL_CPU, _DL_CUDA, _DL_CUDA_HOST = 1, 2, 3


def require_cupy():
    try:
        import cupy  # noqa: WPS433 (optional dependency, loaded on first GPU array)
    except ImportError as err:
        raise ImportError('mpi_kvstore needs CuPy for GPU arrays: pip install cupy-cuda12x '
                          '(or the wheel matching your CUDA)') from err
    return cupy


_views = {}        # (address, nbytes, dtype) -> numpy view; arrays are reused every step
_MAX_VIEWS = 4096


def host_view(address, nbytes, dtype):
    """A numpy view of host memory. Building a ctypes array type costs more than
    the rest of a small collective's Python path, so views are cached by address."""
    key = (address, nbytes, dtype)
    view = _views.get(key)
    if view is None:
        if len(_views) >= _MAX_VIEWS:
            _views.clear()
        view = np.frombuffer((ctypes.c_char * nbytes).from_address(address), dtype=dtype)
        _views[key] = view
    return view


def device_view(address, nbytes, dtype, device_id, owner):
    cupy = require_cupy()
    mem = cupy.cuda.UnownedMemory(address, nbytes, owner, device_id)
    return cupy.ndarray((nbytes // np.dtype(dtype).itemsize,), dtype=dtype,
                        memptr=cupy.cuda.MemoryPointer(mem, 0))


def flat_view(array, nbytes, dtype):
    """1-D view of an NDArray's memory: numpy for host memory, CuPy for GPU memory."""
    address, dev_type, dev_id = array_pointer(array)
    if dev_type in (_DL_CPU, _DL_CUDA_HOST):
        return host_view(address, nbytes, dtype)
    if dev_type == _DL_CUDA:
        return device_view(address, nbytes, dtype, dev_id, array)
    raise TypeError('unsupported device type %d for array of shape %s' % (dev_type, array.shape))
