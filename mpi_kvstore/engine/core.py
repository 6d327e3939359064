"""Python functions as MXNet engine ops, and their completion (push.py makes the
engine calls and pushes compiled ops; NDArray queries live in arrays.py).

An op is a Python callable ``run(completion)`` pushed with the NDArrays it reads
(const) and writes (mutable). The engine calls it once every const array is
readable and every mutable array writable, on one of its worker threads (or, for
an op pushed ``inline_when_ready`` whose arrays are ready, on the pushing thread), and
holds later readers of the mutable arrays back until ``completion.done()`` is
called, from any thread, exactly once.

Nothing escapes a ctypes callback: an exception is handed to the op's
``on_error`` and the op completes, so the engine never stalls.
"""
import collections
import contextlib
import ctypes
import ctypes.util
import itertools
import logging
import threading
import time

from .. import debug
from .push import (  # the pushes of compiled ops, re-exported: callers use engine.core
    ASYNC,
    ASYNC_FN,
    CPU_PRIORITIZED,
    NO_SKIP,
    Handles,
    encoded,
    inline_push,
    native_fn,
    native_push_constants,
    property_address,
    push_async,
    push_failed,
    push_inline,
    push_inline_reading,
    push_native,
    push_op,
)

__all__ = ['Completion', 'Countdown', 'Handles', 'push', 'push_native', 'push_inline',
           'push_inline_reading', 'inline_push', 'push_failed',
           'push_op', 'native_fn', 'encoded', 'native_push_constants', 'python_entry', 'consume_raised',
           'quiesce', 'ASYNC', 'CPU_PRIORITIZED', 'NO_SKIP']

log = logging.getLogger(__name__)

_ENGINE_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
# The same, called with the GIL held (a native op's completion, see Completion.native).
_ENGINE_CALLBACK_HELD = ctypes.PYFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p,
                                          ctypes.c_void_p)


class _CallbackOnComplete(ctypes.Structure):
    # Lives only while the async function runs: copy the three fields.
    _fields_ = [('callback', ctypes.c_void_p), ('engine', ctypes.c_void_p),
                ('param', ctypes.c_void_p)]


class _State:
    """What this process keeps about the engine, all of it here (one instance, ``_state``)."""

    __slots__ = ('live', 'ids', 'active', 'active_lock', 'naive', 'raised', 'callbacks',
                 'held_callbacks', 'entries', 'kept')

    def __init__(self):
        self.live = {}                 # op id -> _Op, until the engine runs it
        self.ids = itertools.count(1)
        self.active = 0                # engine threads running our Python (quiesce waits)
        self.active_lock = threading.Lock()
        self.naive = False             # NaiveEngine: an op completes before it returns
        # Arrays written by an op completed with an error. The engine keeps that error
        # on them until someone reads them, and skips every later op that touches them
        # (the store's own next collective too): consume_raised() reads it off.
        self.raised = collections.deque()
        self.callbacks = {}            # engine callback address -> ctypes function
        self.held_callbacks = {}       # the same, called with the GIL held (native ops')
        self.entries = []              # python_entry's ctypes thunks, alive for the process
        self.kept = threading.local()  # .thread_state: this thread keeps its thread state


_state = _State()


class _EngineError:
    """A C++ ``std::runtime_error`` for the engine's completion callback.

    ThreadedEngine copies the error it is given (as a dmlc::Error, which adds
    nothing to runtime_error) into the op's exception, sets it on every array
    the op writes, and rethrows it at the next WaitToRead of those arrays: so
    ``asnumpy()`` of a failed collective's output raises MXNetError. Python
    cannot build a C++ object itself; libstdc++ (which libmxnet links) can.
    """

    _SIZE = 64  # sizeof(std::runtime_error) is 16 on x86-64 and aarch64
    _ctor = _dtor = None

    @classmethod
    def _bind(cls):
        if cls._ctor is None:
            lib = ctypes.CDLL(ctypes.util.find_library('stdc++') or 'libstdc++.so.6')
            cls._ctor = lib._ZNSt13runtime_errorC1EPKc
            cls._ctor.argtypes, cls._ctor.restype = [ctypes.c_void_p, ctypes.c_char_p], None
            cls._dtor = lib._ZNSt13runtime_errorD1Ev
            cls._dtor.argtypes, cls._dtor.restype = [ctypes.c_void_p], None

    @classmethod
    def complete(cls, fn, engine, param, message):
        """Call the engine's callback with an error saying ``message``."""
        try:
            cls._bind()
        except (OSError, AttributeError):  # no libstdc++ symbols: complete plainly
            log.debug('no std::runtime_error to hand to the engine', exc_info=True)
            fn(engine, param, None)
            return
        obj = ctypes.create_string_buffer(cls._SIZE)
        cls._ctor(ctypes.addressof(obj), message.encode('utf-8', 'replace'))
        try:
            fn(engine, param, ctypes.addressof(obj))  # the engine copies it
        finally:
            cls._dtor(ctypes.addressof(obj))




class Completion:
    """Completes one engine op exactly once, from any thread."""

    __slots__ = ('_fn', '_engine', '_param', '_lock', '_done', '_event', 'arrays')

    def __init__(self, record, wait_inline, arrays=()):
        fn = _state.callbacks.get(record.callback)
        if fn is None:
            fn = _state.callbacks.setdefault(record.callback, _ENGINE_CALLBACK(record.callback))
        self._fn, self._engine, self._param = fn, record.engine, record.param
        self._lock = threading.Lock()
        self._done = False
        self._event = threading.Event() if wait_inline else None
        self.arrays = arrays

    @classmethod
    def native(cls, callback, engine, param, arrays):
        """The completion of a native op, from the record it copied (see native.py).

        Its callback is called with the GIL held, as libmxnet's quick calls are
        (libmxnet.py): the engine's completion only updates its variables and queues the
        ops they release (never runs one inline: only a pusher thread does), so it takes
        engine locks under the GIL, the order every push already takes them in. Given up
        and taken back, the GIL cost more than the call on the negotiation thread, once
        per op: behind a user's thread issuing calls it waited for the switch interval."""
        self = cls.__new__(cls)
        fn = _state.held_callbacks.get(callback)
        if fn is None:
            fn = _state.held_callbacks.setdefault(callback, _ENGINE_CALLBACK_HELD(callback))
        self._fn, self._engine, self._param = fn, engine, param
        self._lock = threading.Lock()
        self._done = False
        self._event = None
        self.arrays = arrays
        return self

    def done(self, error=None):
        """Complete the op; with ``error`` (a message), readers of its outputs raise it.

        NaiveEngine ignores errors; the store raises them on the user's thread anyway.
        """
        with self._lock:
            if self._done:
                return
            self._done = True
        if error is None or _state.naive:
            self._fn(self._engine, self._param, None)
        else:
            _state.raised.extend(self.arrays)
            _EngineError.complete(self._fn, self._engine, self._param, str(error))
        if self._event is not None:
            self._event.set()

    def wait(self):
        if self._event is not None:
            self._event.wait()


class Countdown:
    """Completes one engine op after ``count`` parts of it are done (with the first error)."""

    __slots__ = ('_completion', '_left', '_lock', '_error', '_forward')

    def __init__(self, completion, count, forward_errors=True):
        self._completion, self._left = completion, count
        self._lock = threading.Lock()
        self._error = None
        self._forward = forward_errors

    def pass_errors(self):
        """Let the first error of the parts not done yet reach the engine (a lost world's
        op, whose outputs' readers must raise: store.job)."""
        self._forward = True

    def done(self, error=None):
        with self._lock:
            self._left -= 1
            last = self._left == 0
            if self._error is None and self._forward:
                self._error = error
        if last:
            self._completion.done(self._error)


def consume_raised():
    """Read the engine's error off every array whose op failed, so later ops run again.

    Only arrays whose op already completed are listed, so this never waits on MPI.
    """
    from mxnet.base import MXNetError  # mxnet is loaded; keep the top light
    while _state.raised:
        array = _state.raised.popleft()
        try:
            array.wait_to_read()
        except MXNetError:
            pass


class _Op:
    __slots__ = ('run', 'on_error', 'keep')

    def __init__(self, run, on_error, keep):
        self.run, self.on_error, self.keep = run, on_error, keep


def _keep_thread_state():
    """Let this thread keep its Python thread state from now on.

    ctypes' callback thunk brackets every call with PyGILState_Ensure/Release.
    On a thread Python did not create (an engine worker), that builds a thread
    state and destroys it again on every op, and its first frame mmaps a 16 KB
    data stack that is munmapped again. Each mmap/munmap pair costs ~144 bytes
    of RSS for good once MPI is initialized (MPICH's UCX netmod hooks memory
    events; UCX_MEM_EVENTS=no makes that cost vanish): ~14 MB per 100,000
    pushpulls. One Ensure never released keeps the state (CPython's advice for
    foreign threads), so later callbacks reuse it. A Python thread (an op run
    inline) gets an extra count on a state it keeps anyway; its exit ignores it.

    Exit: Py_Finalize frees the kept states; an engine thread that enters a
    callback after that is ended by take_gil, which checks the finalizing
    thread before it touches the (dangling) state, exactly as for a daemon
    thread. quiesce() keeps ours out of that window, as before.
    """
    if not getattr(_state.kept, 'thread_state', False):
        ctypes.pythonapi.PyGILState_Ensure()
        _state.kept.thread_state = True


@contextlib.contextmanager
def _python_on_engine_thread():
    """Bracket Python code that an engine thread entered: keep its thread state, count
    the entry (debug: engine_python), and let quiesce() see it running."""
    _keep_thread_state()
    with _state.active_lock:
        _state.active += 1
        debug.count('engine_python')
    try:
        yield
    finally:
        with _state.active_lock:
            _state.active -= 1


@ASYNC_FN
def _trampoline(_run_ctx, on_complete, param):
    with _python_on_engine_thread():
        # The op runs exactly once: dropping it here needs no Python deleter,
        # which the engine could call during interpreter shutdown.
        op = _state.live.pop(param)
        record = ctypes.cast(on_complete, ctypes.POINTER(_CallbackOnComplete)).contents
        completion = Completion(record, _state.naive, op.keep[1])
        try:
            op.run(completion)
        except BaseException as err:  # nothing may escape into C
            _report(op, err)
            completion.done()
        # NaiveEngine checks, right after this returns, that the op completed.
        completion.wait()


_ENTRY_FN = ctypes.CFUNCTYPE(None, ctypes.c_int64)


def python_entry(fn):
    """A C function ``void f(int64)`` that runs ``fn(arg)`` in Python, for a native op's
    rare paths (native.py). It counts as Python on an engine thread (debug: engine_python),
    keeps the thread's state like the trampoline, and lets nothing escape into C:
    ``fn`` must complete its op itself, whatever happens."""
    def entry(arg):
        with _python_on_engine_thread():
            try:
                fn(arg)
            except BaseException:  # nothing may escape into C
                log.exception('mpi_kvstore: a native op\'s Python path failed')
    thunk = _ENTRY_FN(entry)
    _state.entries.append(thunk)
    return thunk


def quiesce(timeout=10.0):
    """Wait until no engine thread runs Python code of ours.

    A foreign (engine) thread that needs the GIL after the interpreter began
    finalizing is killed with pthread_exit, which aborts a C++ thread; so at
    exit, after waitall, let every op's epilogue finish first.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with _state.active_lock:
            if _state.active == 0:
                return True
        time.sleep(1e-3)
    return False


def _report(op, err):
    try:
        op.on_error(err)
    except BaseException:  # the error sink itself failed: log, never raise into C
        log.exception('mpi_kvstore: error while reporting an engine-op failure')


def set_naive(flag):
    """Under NaiveEngine an async op must complete before its function returns."""
    _state.naive = bool(flag)


def push(run, const=(), mutable=(), priority=0, name='mpi_kvstore', on_error=None,
         inline_when_ready=False, always=False):
    """Push ``run(completion)`` as an async engine op on the CPU priority queue
    (kCPUPrioritized: the engine runs ready ops by ``priority``).

    ``inline_when_ready``: run it on this thread when its arrays are ready now (kAsync),
    which saves waking an engine worker, ~100 us on a VM; otherwise it queues, in
    push order, on the normal CPU worker. Only for a ``run`` that returns at once: it
    would otherwise block the caller, or the compute worker.
    ``always``: run it even where an earlier op failed on its arrays (kNoSkip, the normal
    CPU worker).
    """
    const, mutable = list(const), list(mutable)
    op_id = next(_state.ids)
    _state.live[op_id] = _Op(run, on_error or _log_error, (const, mutable))
    try:
        push_async(_trampoline, op_id, const, mutable,
                   property_address(inline_when_ready, always), priority, name)
    except RuntimeError:
        _state.live.pop(op_id, None)
        raise


def _log_error(err):
    log.error('mpi_kvstore engine op failed: %r', err)


