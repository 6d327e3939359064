"""Waiting for an MPI request without pinning a core (the option progress_sleep_us).

Ranks reach a collective at different times; a blocking wait spins a core that the
other rank's compute needs. docs/benchmarks.md (progress) has the measurements behind
the constants.
"""
import time

__all__ = ['wait_polling', 'PROGRESS_TESTS', 'AGREEMENT_POLL_US']

# MPI_Test calls per wake-up: MPICH moves a bounded amount of data per Test, so one Test
# per sleep throttles a large allreduce; a few in a row drain what arrived meanwhile.
PROGRESS_TESTS = 8
# The longest sleep between polls of a polled agreement (config's poll_us default).
AGREEMENT_POLL_US = 50.0
_SPIN_S = 50e-6   # spin this long first: most waits on one host end within it


def wait_polling(request, poll_us, tests=1):
    """Wait for ``request``: spin briefly, then sleep with doubling sleeps of at most
    ``poll_us``, calling Test up to ``tests`` times in a row at each wake-up."""
    start = time.perf_counter()
    sleep = 1e-6
    while not request.Test():
        if time.perf_counter() - start < _SPIN_S:
            continue
        time.sleep(sleep)
        sleep = min(sleep * 2, poll_us * 1e-6)
        for _ in range(tests - 1):
            if request.Test():
                return
