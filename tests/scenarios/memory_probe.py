"""What the memory scenarios (kv_memory.py, kv_named_soak.py, and the resets' soaks
elastic_soak.py and elastic_bcast_soak.py) share: RSS, descriptors and threads, and a gate
that sends every pushpull's engine op to an engine worker thread.

An op whose arrays are ready runs inline on the pushing thread (kAsync), which
never showed the leak; gradients still being written by backward are not ready.
Holding the arrays behind a gate op reproduces that in every design.
"""
import os
import threading

import psutil

from mpi_kvstore.engine import core as engine

__all__ = ['Gate', 'gated_step', 'rss_mb', 'usage', 'report_growth']


def rss_mb():
    """This process's resident set size in MB (2**20 bytes), as /proc/self/statm has it."""
    return psutil.Process().memory_info().rss / 2 ** 20


def usage():
    """(RSS in MB, open file descriptors, threads) of this process, as a soak records them at
    each reset."""
    return rss_mb(), len(os.listdir('/proc/self/fd')), threading.active_count()


def report_growth(worker, seen, total):
    """A soak's line for its test: how ``seen`` (:func:`usage` at each reset) grew from the
    first reset to the last, and ``total``, the sum the worker trained."""
    first, last = seen[0], seen[-1]
    print('worker %d: resets %d, rss growth %.1f MB, fd growth %d, threads %d -> %d, sum %g'
          % (worker, len(seen), last[0] - first[0], last[1] - first[1], first[2], last[2],
             total), flush=True)


class Gate:
    """An engine op that writes ``arrays`` and completes only when opened, from this thread."""

    def __init__(self, arrays):
        self.arrays = arrays
        self._held = threading.Event()
        self._completion = None

    def close(self):
        self._held.clear()
        engine.push(self._hold, mutable=self.arrays, name='memory_gate')

    def _hold(self, completion):
        self._completion = completion
        self._held.set()

    def open(self):
        self._held.wait()
        self._completion.done()


def gated_step(kv, keys, arrays, gate=None):
    """One pushpull of every key behind ``gate`` (None: as they come), then a wait."""
    if gate:
        gate.close()
    for key, array in zip(keys, arrays):
        kv.pushpull(key, array)
    if gate:
        gate.open()
    kv.wait()
