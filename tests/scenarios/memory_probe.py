"""What the memory scenarios (kv_memory.py, kv_named_soak.py) share: RSS, and a gate that
sends every pushpull's engine op to an engine worker thread.

An op whose arrays are ready runs inline on the pushing thread (kAsync), which
never showed the leak; gradients still being written by backward are not ready.
Holding the arrays behind a gate op reproduces that in every design.
"""
import threading

import psutil

from mpi_kvstore.engine import core as engine

__all__ = ['Gate', 'gated_step', 'rss_mb']


def rss_mb():
    """This process's resident set size in MB (2**20 bytes), as /proc/self/statm has it."""
    return psutil.Process().memory_info().rss / 2 ** 20


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
