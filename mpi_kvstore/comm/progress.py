"""Waiting for an MPI request without pinning a core, and without the GIL (the option
progress_sleep_us).

Ranks reach a collective at different times; a blocking wait spins a core that the
other rank's compute needs, so a wait polls MPI_Test with sleeps. It polls in compiled
code (numba) with the GIL released: a loop in Python took the GIL again at every wake-up,
and in a training process whose other threads hold it (a data pipeline, Python layers)
each wake-up waited for them, up to the interpreter's switch interval. Horovod's
background thread, in C++, never waits for the GIL; neither does this wait.
docs/benchmarks.md (progress) has the measurements behind the constants.

The wait returns to Python every ``_SLICE_US`` to let the main thread's signal handlers
run (Ctrl-C), and calls MPI_Test on the request object's own handle
(``MPI._addressof``), so that mpi4py sees the request complete as after its own Test.
"""
import ctypes
import threading

import numba
import numpy as np
from numba import types

from . import abandoned, ccall
from .mpiabi import MPI, c_api

__all__ = ['wait_polling', 'prepare', 'poll', 'spin', 'set_abort_check', 'PROGRESS_TESTS',
           'SPIN_TESTS', 'AGREEMENT_POLL_US']

# MPI_Test calls per wake-up: MPICH moves a bounded amount of data per Test, so one Test
# per sleep throttles a large allreduce; a few in a row drain what arrived meanwhile.
PROGRESS_TESTS = 8
# A wait first calls MPI_Test this many times in a row: most waits on one host, and those
# where the other ranks are there already, end within them.
SPIN_TESTS = 32
# The longest sleep between polls of a polled agreement (config's poll_us default).
AGREEMENT_POLL_US = 50.0
_SLICE_US = 100_000     # back in Python (signals) at least this often while waiting
_PENDING = 1            # poll's answer when the slice ended first (MPI's codes are >= 0)
# set_abort_check: called between slices (then every _ABORT_SLICE_US), it may raise to end a
# wait whose peer is gone (an elastic world: MPI never completes such a request)
_abort = [None, _SLICE_US]
_ABORT_SLICE_US = 10_000

_call_test = ccall.caller(32, (64, 64, 64))         # MPI_Test(request*, flag*, status*)
_call_usleep = ccall.caller(32, (32,))              # usleep(us)
_call_clock = ccall.caller(32, (32, 64))            # clock_gettime(clock, timespec*)
_CLOCK_MONOTONIC = 1                                # Linux's clockid_t
# MPI_Test calls between two looks at the clock while spinning
_SPIN_BATCH = 16
_i64 = ccall.typed_pointer(types.int64)


@numba.njit
def _tests(test_fn, request, box, flag, n):
    """MPI_Test(``request``) up to ``n`` times in a row: -> 0 once it completes, MPI_Test's
    error code, or -_PENDING. ``flag``: ``box`` seen as int64 words (the flag first)."""
    for _ in range(n):
        flag[0] = 0
        err = _call_test(test_fn, (request, box, box + 8))
        if err != 0:
            return err
        if flag[0] & 0xffffffff:
            return 0
    return -_PENDING


@numba.njit
def poll(test_fn, usleep_fn, request, box, poll_us, tests, slice_us):
    """MPI_Test(``request``) SPIN_TESTS times in a row, then after sleeps doubling from
    1 us up to ``poll_us``, up to ``tests`` times a wake-up, until the request completes
    (-> 0), MPI_Test fails (-> its error code, a positive int) or the sleeps reach
    ``slice_us`` (-> -_PENDING; 0: no limit). ``box``: the address of 8 int64 words of
    scratch, the flag and then the status. Compiled into the native ops as well
    (engine/native.py)."""
    flag = numba.carray(_i64(box), 8)
    n, sleep, slept = SPIN_TESTS, 1, 0
    while True:
        err = _tests(test_fn, request, box, flag, n)
        if err != -_PENDING:
            return err
        if slice_us > 0 and slept >= slice_us:
            return -_PENDING
        _call_usleep(usleep_fn, (sleep,))
        slept += sleep
        sleep = min(2 * sleep, poll_us)
        n = tests


@numba.njit
def spin(test_fn, clock_fn, request, box, spin_ns):
    """MPI_Test(``request``) in a row, without sleeping, for up to ``spin_ns`` nanoseconds
    of the monotonic clock (``clock_fn``: clock_gettime): -> 0 once it completes, MPI_Test's
    error, or -_PENDING when the time ran out. ``box``: 10 int64 words of scratch, poll's 8
    and a timespec."""
    flag = numba.carray(_i64(box), 10)
    _call_clock(clock_fn, (_CLOCK_MONOTONIC, box + 64))
    end = flag[8] * 1_000_000_000 + flag[9] + spin_ns
    while True:
        err = _tests(test_fn, request, box, flag, _SPIN_BATCH)
        if err != -_PENDING:
            return err
        _call_clock(clock_fn, (_CLOCK_MONOTONIC, box + 64))
        if flag[8] * 1_000_000_000 + flag[9] >= end:
            return -_PENDING


def _entry(key):
    """The wait that Python calls, released from the GIL: a closure over ``key`` (this
    file's and ccall's source), which numba's on-disk cache keys it by, as native.py's
    entry points are keyed (numba keys a function by its own file only)."""
    def wait(test_fn, usleep_fn, clock_fn, request, poll_us, tests, slice_us, spin_ns):
        _ = key
        box = np.zeros(10, np.int64)
        if spin_ns > 0:
            err = spin(test_fn, clock_fn, request, box.ctypes.data, spin_ns)
            if err != -_PENDING:
                return err
        return poll(test_fn, usleep_fn, request, box.ctypes.data, poll_us, tests, slice_us)
    return wait


# (MPI_Test, usleep, clock_gettime, the request's handle address, poll_us, tests, slice_us,
# spin_ns) -> 0, MPI's error or -_PENDING; typed, so that prepare() compiles (or loads) it
# there and then.
_SIGNATURE = types.int64(*[types.int64] * 8)
_lock = threading.Lock()
_compiled = []     # [(the compiled wait, MPI_Test's, usleep's, clock_gettime's address)], once


def _waiter():
    if not _compiled:
        with _lock:
            if not _compiled:
                key = ccall.source_key((__file__, ccall.__file__))
                fn = numba.njit(_SIGNATURE, nogil=True, cache=True)(_entry(key))
                libc = ctypes.CDLL(None)
                usleep = ctypes.cast(libc.usleep, ctypes.c_void_p).value
                clock = ctypes.cast(libc.clock_gettime, ctypes.c_void_p).value
                _compiled.append((fn, c_api().test, usleep, clock))
    return _compiled[0]


def prepare():
    """Compile the wait (or load it from numba's cache) now rather than at the first
    wait: a rank that compiles inside a collective keeps the others waiting."""
    _waiter()


def set_abort_check(check):
    """``check()`` runs between slices of every wait from now on and may raise to end it
    (None: no check). Waits then slice every 10 ms instead of 100 ms."""
    _abort[:] = [check, _SLICE_US if check is None else _ABORT_SLICE_US]


def wait_polling(request, poll_us, tests=1, spin_us=0):
    """Wait for the mpi4py ``request`` without the GIL: MPI_Test in compiled code, in a row
    for up to ``spin_us`` microseconds (at least SPIN_TESTS times), then after sleeps of at
    most ``poll_us`` microseconds, ``tests`` times a wake-up. Raises MPI.Exception where
    MPI_Test fails."""
    fn, test, usleep, clock = _waiter()
    address = MPI._addressof(request)
    poll_us = max(1, int(poll_us))
    spin_ns = int(spin_us * 1000)
    while True:
        err = fn(test, usleep, clock, address, poll_us, tests, _abort[1], spin_ns)
        spin_ns = 0     # the spin only before the first sleep
        if err == 0:
            return
        if err != -_PENDING:
            raise MPI.Exception(err)
        if _abort[0] is not None:
            try:
                _abort[0]()
            except BaseException:
                abandoned.keep(request)   # MPI may still write into its buffers
                raise
