"""NDArray metadata, and NDArray memory seen as numpy (host) or CuPy (GPU) arrays,
without copies.

Called inside an engine op that holds the array, so nothing here may wait on
the engine. CuPy is imported lazily, only when a GPU array shows up.
"""
import ctypes
import logging

import mxnet as mx
import numpy as np
from mxnet.ndarray.ndarray import _DTYPE_MX_TO_NP, _DTYPE_NP_TO_MX, _STORAGE_TYPE_ID_TO_STR

from ..errors import ArrayLayoutError
from .libmxnet import bind, last_error

log = logging.getLogger(__name__)

__all__ = ['flat_view', 'view_at', 'require_cupy', 'array_meta', 'array_pointer', 'huge_pages',
           'huge_range', 'dense_meta', 'storage_of', 'copy_of', 'copy_into', 'Blank']

# DLPack device types
_DL_CPU, _DL_CUDA, _DL_CUDA_HOST = 1, 2, 3


class _DLTensor(ctypes.Structure):
    _fields_ = [('data', ctypes.c_void_p), ('device_type', ctypes.c_int32),
                ('device_id', ctypes.c_int32), ('ndim', ctypes.c_int32),
                ('code', ctypes.c_uint8), ('bits', ctypes.c_uint8), ('lanes', ctypes.c_uint16),
                ('shape', ctypes.POINTER(ctypes.c_int64)),
                ('strides', ctypes.POINTER(ctypes.c_int64)), ('byte_offset', ctypes.c_uint64)]


_to_dlpack = bind('MXNDArrayToDLPack', ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p))
_get_shape = bind('MXNDArrayGetShapeEx', ctypes.c_void_p, ctypes.POINTER(ctypes.c_int),
                  ctypes.POINTER(ctypes.POINTER(ctypes.c_int)))
_get_dtype = bind('MXNDArrayGetDType', ctypes.c_void_p, ctypes.POINTER(ctypes.c_int))
_get_stype = bind('MXNDArrayGetStorageType', ctypes.c_void_p, ctypes.POINTER(ctypes.c_int))
_dlpack_delete = bind('MXNDArrayCallDLPackDeleter', ctypes.c_void_p)


_NP_DTYPES = {code: np.dtype(t) for code, t in _DTYPE_MX_TO_NP.items() if t is not None}


def array_meta(array):
    """(shape, numpy dtype, storage type name) in three direct calls.

    The NDArray properties cost several times more, and a pushpull asks for
    them for every array it gets.
    """
    handle = array.handle
    ndim, dims, code, stype = ctypes.c_int(), ctypes.POINTER(ctypes.c_int)(), ctypes.c_int(), \
        ctypes.c_int()
    if (_get_shape(handle, ctypes.byref(ndim), ctypes.byref(dims)) or
            _get_dtype(handle, ctypes.byref(code)) or _get_stype(handle, ctypes.byref(stype))):
        raise RuntimeError(last_error())
    shape = tuple(dims[:ndim.value]) if ndim.value > 0 else ()
    return shape, _NP_DTYPES.get(code.value), _STORAGE_TYPE_ID_TO_STR.get(stype.value, 'unknown')


def array_pointer(array):
    """(address, device_type, device_id) of an NDArray's row-major data.

    Safe inside an op that holds the array: it neither waits on the engine nor
    reorders. An MKLDNN-layout array raises :class:`ArrayLayoutError`, because its
    bytes are not row-major and reading them raw would give a wrong sum.
    """
    managed = ctypes.c_void_p()
    if _to_dlpack(array.handle, ctypes.byref(managed)) != 0:
        msg = last_error()
        raise ArrayLayoutError('array of shape %s cannot be read in place: %s'
                               % (array.shape, msg.strip().splitlines()[-1]))
    try:
        t = ctypes.cast(managed, ctypes.POINTER(_DLTensor)).contents
        return t.data + t.byte_offset, t.device_type, t.device_id
    finally:
        _dlpack_delete(managed)


_GPU = 2   # MXNet's Context.devtype2str: 1 cpu, 2 gpu, 3 cpu_pinned, 5 cpu_shared
_get_context = bind('MXNDArrayGetContext', ctypes.c_void_p, ctypes.POINTER(ctypes.c_int),
                    ctypes.POINTER(ctypes.c_int))


def dense_meta(array):
    """(shape, numpy dtype, place) of a dense NDArray ('cpu' or 'gpu', as
    collective.place_of), from its metadata alone; None for a sparse one.

    Nothing here touches the array's memory: MXNDArrayToDLPack would, and on the user's
    thread it raced with the engine op that allocates a fresh array (a sum in 4,000 came
    out wrong), so where the memory is row-major is only known inside the op that holds
    it (flat_view raises ArrayLayoutError for an MKLDNN layout)."""
    shape, dtype, stype = array_meta(array)
    if stype != 'default' or dtype is None:
        return None
    kind, device = ctypes.c_int(), ctypes.c_int()
    if _get_context(array.handle, ctypes.byref(kind), ctypes.byref(device)):
        raise RuntimeError(last_error())
    return shape, dtype, 'gpu' if kind.value == _GPU else 'cpu'


_invoke = bind('MXImperativeInvokeEx', ctypes.c_void_p, ctypes.c_int,
               ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int),
               ctypes.POINTER(ctypes.POINTER(ctypes.c_void_p)), ctypes.c_int, ctypes.c_void_p,
               ctypes.c_void_p, ctypes.POINTER(ctypes.POINTER(ctypes.c_int)))
_copy_op = []   # [MXNet's _copy operator (mx.nd.identity)], looked up once


def _copy_operator():
    if not _copy_op:
        op = ctypes.c_void_p()
        if mx.base._LIB.NNGetOpHandle(mx.base.c_str('_copy'), ctypes.byref(op)) != 0:
            raise RuntimeError(last_error())
        _copy_op.append(op)
    return _copy_op[0]


def copy_of(array):
    """A new NDArray of ``array``'s values, made by MXNet's identity operator (one engine op,
    asynchronous like it; an input in an MKLDNN layout gives a row-major copy) in one C
    call: mx.nd.identity builds the same call's arguments in Python, which took about
    twice as long as the rest. ``array``: a legacy NDArray (``mx.nd.NDArray``)."""
    inputs = (ctypes.c_void_p * 1)(array.handle.value)
    count, outputs = ctypes.c_int(0), ctypes.POINTER(ctypes.c_void_p)()
    stypes = ctypes.POINTER(ctypes.c_int)()
    if _invoke(_copy_operator(), 1, inputs, ctypes.byref(count), ctypes.byref(outputs), 0, None,
               None, ctypes.byref(stypes)) != 0:
        raise RuntimeError(last_error())
    handle = ctypes.c_void_p(outputs[0])
    if stypes[0] == 0:   # kDefaultStorage
        return mx.nd.NDArray(handle)
    return mx.nd.sparse._ndarray_cls(handle, stype=stypes[0])


def copy_into(array, out):
    """Push MXNet's copy of ``array`` into ``out`` (same shape, dtype and context): one
    engine op, as :func:`copy_of`'s."""
    inputs = (ctypes.c_void_p * 1)(array.handle.value)
    outputs = (ctypes.c_void_p * 1)(out.handle.value)
    count, given = ctypes.c_int(1), ctypes.cast(outputs, ctypes.POINTER(ctypes.c_void_p))
    stypes = ctypes.POINTER(ctypes.c_int)()
    if _invoke(_copy_operator(), 1, inputs, ctypes.byref(count), ctypes.byref(given), 0, None,
               None, ctypes.byref(stypes)) != 0:
        raise RuntimeError(last_error())


_create = bind('MXNDArrayCreateEx', ctypes.POINTER(ctypes.c_uint), ctypes.c_uint, ctypes.c_int,
               ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p))


class Blank:
    """New NDArrays like ``array`` (a dense one): its shape, dtype and context, memory
    allocated, values not set and no engine op pending on them (one C call each)."""

    __slots__ = ('shape', 'ndim', 'dev_type', 'dev_id', 'dtype')

    def __init__(self, array):
        shape = array.shape
        self.shape, self.ndim = (ctypes.c_uint * max(1, len(shape)))(*shape), len(shape)
        context = array.context
        self.dev_type, self.dev_id = context.device_typeid, context.device_id
        self.dtype = _DTYPE_NP_TO_MX[np.dtype(array.dtype).type]

    def new(self):
        handle = ctypes.c_void_p()
        if _create(self.shape, self.ndim, self.dev_type, self.dev_id, 0, self.dtype,
                   ctypes.byref(handle)) != 0:
            raise RuntimeError(last_error())
        return mx.nd.NDArray(handle)


def _chunk(array):
    # The first word of MXNet 1.9's NDArray object (its handle points to it) is the
    # shared_ptr to its storage chunk, which holds the engine variable: a view (slice,
    # reshape, detach) shares it with its base. Read without touching the array's memory.
    return ctypes.c_void_p.from_address(array.handle.value).value


_chunk_works = []   # [bool], once: whether _chunk tells views apart from other arrays


def storage_of(array):
    """An id of the storage (and engine variable) an NDArray shares with its views and
    only with them, or None where this MXNet's layout does not show it (checked once on
    a slice, a reshape and an unrelated array)."""
    if not _chunk_works:
        base, other = mx.nd.zeros((4,)), mx.nd.zeros((4,))
        ids = [_chunk(a) for a in (base, base[1:3], base.reshape((2, 2)), other)]
        _chunk_works.append(bool(ids[0]) and ids[0] == ids[1] == ids[2] != ids[3])
        if not _chunk_works[0]:
            log.debug('NDArray storage ids unknown for this MXNet: views go unchecked')
    return _chunk(array) if _chunk_works[0] else None


def require_cupy():
    try:
        import cupy  # optional dependency, loaded on first GPU array
    except ImportError as err:
        raise ImportError("mpi_kvstore needs CuPy for GPU arrays: pip install 'mpi_kvstore[gpu]' "
                          '(cupy-cuda11x 13.6.0, the last CuPy for CUDA 11, which the '
                          'mxnet-cu11x 1.9.1 wheels need)') from err
    return cupy


# Transparent huge pages for large host arrays that MPI reads and writes in place. numpy
# asks for them on its own buffers of 4 MB and more; MXNet's allocator does not, and an
# MPI_Allreduce over shared memory then took 1.5x as long on MXNet's memory as on numpy's at
# 16 MB (docs/benchmarks.md). MADV_COLLAPSE (Linux 6.1) makes them now, once (a few ms for
# 16 MB); again it only checks (~3 us). The kernel may decline either advice (an older
# kernel, THP off, no free huge page at that moment): the memory then stays in small pages,
# which is slower but equally correct, so a refusal is reported to the caller, not raised.
HUGE_PAGE = 2 << 20
HUGE_MIN_BYTES = 4 << 20
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int


def huge_range(address, nbytes):
    """(start, end) of the whole huge pages inside [address, address + nbytes), or None
    where there is none or the range is under HUGE_MIN_BYTES."""
    if nbytes < HUGE_MIN_BYTES:
        return None
    start = (address + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    end = (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    return (start, end) if end > start else None


def huge_pages(address, nbytes):
    """Ask for the whole huge pages inside [address, address + nbytes) to be huge pages
    (from HUGE_MIN_BYTES on). The content does not change.

    Returns None where nothing was asked (too small, no whole huge page inside), else
    ``(hugepage_errno, collapse_errno)``: 0 where the kernel took the advice, the errno of
    its refusal otherwise. A refusal is logged at debug level and changes nothing else.
    """
    span = huge_range(address, nbytes)
    if span is None:
        return None
    start, end = span
    errnos = []
    for advice in (MADV_HUGEPAGE, MADV_COLLAPSE):
        ok = _libc.madvise(start, end - start, advice) == 0
        errnos.append(0 if ok else (ctypes.get_errno() or -1))
    if any(errnos):
        log.debug('huge pages for %d bytes at %#x declined by the kernel (errno %s): '
                  'the memory stays in small pages', end - start, start, errnos)
    return tuple(errnos)


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
        huge_pages(address, nbytes)   # once per view: MPI will read and write it
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
    return view_at(*array_pointer(array), nbytes, dtype, array)


def view_at(address, dev_type, dev_id, nbytes, dtype, array):
    """1-D view of memory at ``address`` (as a DLPack tensor of ``array`` describes it)."""
    if dev_type in (_DL_CPU, _DL_CUDA_HOST):
        return host_view(address, nbytes, dtype)
    if dev_type == _DL_CUDA:
        return device_view(address, nbytes, dtype, dev_id, array)
    raise TypeError('unsupported device type %d for array of shape %s' % (dev_type, array.shape))
