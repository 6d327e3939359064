"""Pushing into MXNet's dependency engine through ctypes: MXEnginePushAsyncND, its
constants, the engine's handle arrays, and the pushes of compiled ops (``void f(run_ctx,
on_complete, param)``), with nothing of Python run when the engine calls them. core.py
pushes Python functions through :func:`push_async` and re-exports the rest.
"""
import ctypes
import functools

from .libmxnet import bind, bind_plain, last_error

__all__ = ['ASYNC', 'CPU_PRIORITIZED', 'NO_SKIP', 'ASYNC_FN', 'Handles', 'push_async',
           'push_native', 'push_inline', 'push_inline_reading', 'push_op', 'native_fn', 'encoded',
           'inline_push', 'push_failed',
           'native_push_constants', 'property_address']

# FnProperty values of include/mxnet/engine.h: Horovod and BytePS push their
# collectives as kCPUPrioritized on the CPU context, so the engine's priority
# queue honours the priorities gluon.Trainer and Module pass.
CPU_PRIORITIZED = 3
# An op pushed as kAsync whose arrays are ready at push time runs inline on the
# pushing thread (ThreadedEnginePerDevice::PushToExecute); otherwise it queues
# on the normal CPU worker. Only for ops that return at once and never block.
ASYNC = 4
# kNoSkip: the engine runs such an op even where an earlier op's error sits on its arrays
# (any other op is skipped and passes that error on, leaving its outputs as they were).
NO_SKIP = 7
_CPU = 1

_ASYNC_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
class _Context(ctypes.Structure):
    _fields_ = [('dev_type', ctypes.c_int32), ('dev_id', ctypes.c_int32)]


# Pushing never waits either, and keeping the GIL means the engine worker that
# picks the op up cannot take it from us half-way through a pushpull call. The
# engine runs ops without holding its own locks, so no lock order inverts; under
# NaiveEngine the op runs inline on this thread, which re-enters the GIL.
_push_async = bind('MXEnginePushAsyncND', _ASYNC_FN, ctypes.c_void_p, ctypes.c_void_p,
                     ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                     ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_void_p,
                     ctypes.c_int, ctypes.c_char_p, ctypes.c_bool)

_push_async_released = bind('MXEnginePushAsyncND', *_push_async.argtypes, release_gil=True)
# The same without argument types, for push_native (its arguments as ctypes objects).
_push_plain = bind_plain('MXEnginePushAsyncND')

_cpu_context = _Context(_CPU, 0)
_properties = {prop: ctypes.c_int(prop) for prop in (CPU_PRIORITIZED, ASYNC, NO_SKIP)}
_CPU_CONTEXT = ctypes.addressof(_cpu_context)
_PROPERTY_ADDRESSES = {prop: ctypes.addressof(value) for prop, value in _properties.items()}
# push_native's arguments that never change, as _push_plain takes them
_CPU_CONTEXT_ARG = ctypes.c_void_p(_CPU_CONTEXT)
_PROPERTY_ARGS = {inline: ctypes.c_void_p(_PROPERTY_ADDRESSES[ASYNC if inline else CPU_PRIORITIZED])
                  for inline in (False, True)}
_NO_WAIT, _NONE = ctypes.c_bool(False), ctypes.c_int(0)
_native_fns = {}   # C function address -> its ctypes function
_names = {}        # op name -> its bytes
ASYNC_FN = _ASYNC_FN


def property_address(inline_when_ready=False, always=False):
    """The address of the FnProperty a push passes: kNoSkip with ``always``, else kAsync
    with ``inline_when_ready``, else kCPUPrioritized."""
    return _PROPERTY_ADDRESSES[NO_SKIP if always else ASYNC if inline_when_ready
                               else CPU_PRIORITIZED]


def _handles(arrays):
    return (ctypes.c_void_p * max(1, len(arrays)))(*[a.handle.value for a in arrays])


def push_async(fn, param, const, mutable, prop, priority, name):
    """MXEnginePushAsyncND of ``fn`` (an ASYNC_FN) with ``param`` over the arrays ``const``
    and ``mutable``; ``prop``: from :func:`property_address`. RuntimeError if refused."""
    if _push_async(fn, param, None, _CPU_CONTEXT, _handles(const), len(const),
                   _handles(mutable), len(mutable), prop, int(priority), _encoded(name),
                   False) != 0:
        raise RuntimeError('MXEnginePushAsyncND failed: ' + last_error())


class Handles:
    """The engine's array of NDArray handles for ``arrays``, built once for many pushes.

    It holds the handle values only: whoever pushes keeps the arrays alive until the op
    completes (a handle reused by a new NDArray names that array, which is what a cache
    keyed by handle values wants)."""

    __slots__ = ('array', 'count', 'count_arg')

    def __init__(self, arrays):
        self.array, self.count = _handles(arrays), len(arrays)
        self.count_arg = ctypes.c_int(self.count)


_NO_HANDLES = _handles(())


def push_native(fn_address, param_address, mutable, priority=0, name='mpi_kvstore',
                inline_when_ready=False, may_block=False):
    """Push a C function (``void f(run_ctx, on_complete, param)``) as an async engine op.

    No Python runs when the engine calls it. The caller keeps ``param``'s memory and
    the arrays alive until the op completes. ``mutable``: arrays, or :class:`Handles`.
    ``may_block``: the op may run inline and wait for other ranks (the chained op), so
    the push gives the GIL up meanwhile: other threads (the stall inspector) go on.
    """
    fn = native_fn(fn_address)
    if not isinstance(mutable, Handles):
        mutable = Handles(list(mutable))
    if not may_block:   # once a call for each op of a burst: its arguments as ctypes objects
        _push_held(fn, param_address, mutable, _PROPERTY_ARGS[bool(inline_when_ready)],
                   ctypes.c_int(priority), _encoded(name))
        return
    if _push_async_released(
            fn, param_address, None, _CPU_CONTEXT, _NO_HANDLES, 0, mutable.array,
            mutable.count, _PROPERTY_ADDRESSES[ASYNC if inline_when_ready else CPU_PRIORITIZED],
            priority, _encoded(name), False) != 0:
        raise RuntimeError('MXEnginePushAsyncND failed: ' + last_error())


def native_fn(fn_address):
    """The engine's function object of the C function at ``fn_address``, for
    :func:`push_inline` (made once per address)."""
    fn = _native_fns.get(fn_address)
    if fn is None:
        fn = _native_fns.setdefault(fn_address, _ASYNC_FN(fn_address))
    return fn


def encoded(name):
    """An op name as the engine takes it, for :func:`push_inline` (made once per name)."""
    return _encoded(name)


_INLINE = _PROPERTY_ARGS[True]


def push_inline(fn, param_address, handles, priority, name):
    """push_native(..., inline_when_ready=True) for a caller that pushes an op per call:
    ``fn`` from :func:`native_fn`, ``handles`` a :class:`Handles`, ``name`` from
    :func:`encoded`; ``priority`` a plain int (ctypes passes it as a C int);
    ``param_address`` an int or its ctypes.c_void_p. _push_held's body, not a call of it:
    one frame less on every call (issue 43)."""
    if param_address.__class__ is int:
        param_address = ctypes.c_void_p(param_address)
    if _push_plain(fn, param_address, None, _CPU_CONTEXT_ARG, _NO_HANDLES,
                   _NONE, handles.array, handles.count_arg, _INLINE, priority, name,
                   _NO_WAIT) != 0:
        raise RuntimeError('MXEnginePushAsyncND failed: ' + last_error())


def inline_push(fn, param_address, handles, priority, name):
    """:func:`push_inline` of these arguments made once: a callable of no arguments (a
    functools.partial of the C function: no Python frame when called) that pushes the op
    and returns MXEnginePushAsyncND's code, 0 where pushed (else :func:`push_failed`). For
    an op pushed again and again with the same arguments (a chained call's follow op)."""
    if param_address.__class__ is int:
        param_address = ctypes.c_void_p(param_address)
    return functools.partial(_push_plain, fn, param_address, None, _CPU_CONTEXT_ARG,
                             _NO_HANDLES, _NONE, handles.array, handles.count_arg, _INLINE,
                             priority, name, _NO_WAIT)


def push_failed():
    """Raise what a push refused (a non-zero code of an :func:`inline_push` call)."""
    raise RuntimeError('MXEnginePushAsyncND failed: ' + last_error())


def push_inline_reading(fn, param_address, reads, writes, priority, name):
    """:func:`push_inline` of an op that also reads the arrays of ``reads`` (a
    :class:`Handles`): it runs at its push exactly when none of them is being written."""
    if _push_plain(fn, param_address, None, _CPU_CONTEXT_ARG, reads.array, reads.count_arg,
                   writes.array, writes.count_arg, _INLINE, priority, name, _NO_WAIT) != 0:
        raise RuntimeError('MXEnginePushAsyncND failed: ' + last_error())


def push_op(fn, param_address, handles, priority, name):
    """push_native(..., inline_when_ready=False) for a caller that pushes an op per call,
    with :func:`push_inline`'s arguments: to the engine's priority worker, at ``priority``."""
    _push_held(fn, param_address, handles, _QUEUED, priority, name)


_QUEUED = _PROPERTY_ARGS[False]


def _push_held(fn, param_address, handles, prop, priority, name):
    """MXEnginePushAsyncND with the GIL held (the op does not wait for other ranks).
    ``param_address``: an int, or the c_void_p of one that a caller made once."""
    if param_address.__class__ is int:
        param_address = ctypes.c_void_p(param_address)
    if _push_plain(fn, param_address, None, _CPU_CONTEXT_ARG, _NO_HANDLES,
                   _NONE, handles.array, handles.count_arg, prop, priority, name,
                   _NO_WAIT) != 0:
        raise RuntimeError('MXEnginePushAsyncND failed: ' + last_error())


_native_name = ctypes.create_string_buffer(b'mpi_kvstore_chained')


def native_push_constants():
    """(CPU context, kCPUPrioritized property, op name) addresses, for native code that
    pushes an op itself (the chained op's re-push to the priority worker)."""
    return (_CPU_CONTEXT, _PROPERTY_ADDRESSES[CPU_PRIORITIZED],
            ctypes.addressof(_native_name))


def _encoded(name):
    text = _names.get(name)
    if text is None:
        text = _names.setdefault(name, name.encode())
    return text
