"""What benchmarks/memory.py and the CI memory test both need: RSS, and a gate that
sends every pushpull's engine op to an engine worker thread.

An op whose arrays are ready runs inline on the pushing thread (kAsync), which
never showed the leak; gradients still being written by backward are not ready.
Holding the arrays behind a gate op reproduces that in every design.
"""
import threading

from benchmarks.harness import rss_mb
from mpi_kvstore.engine import core as engine

__all__ = ['Gate', 'gated_step', 'rss_mb']


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
