"""Which device transport each device (GPU) buffer of a communicator takes.

At the first device collective the ranks agree which transports every rank can use
(transports.agreed), pick the one ``gpu_transport`` names (under 'auto' the first that
runs, transports.decide), and build it, with every transport a tune table's device rows
name for some size (the allreduce's ``device`` rows, and each other collective's
``device_ops`` rows, which its device buffers take: an op without them takes the
allreduce's). Every rank reaches that collective at the same point of the sequence
(a collective's place is in its agreed signature; a rank that failed to read its array
sends zeros on its own device, reduce.py). Afterwards a buffer's transport is a pure
function of the agreed op and size, the same on every rank. Built once per communicator,
so no rank builds one that another does not: a buffer on another device of this rank
goes through a copy on the transports' device.
"""
import logging

from .. import debug
from ..errors import ConfigError
from . import transports
from .tuning import BySize

__all__ = ['DeviceRouter']

log = logging.getLogger(__name__)


class DeviceRouter:
    """The device transports of one host communicator (comm.Comm) and their choice by size.

    ``gpu_transport``: an option value, 'auto' or a transport's name; ``rows``: a tune
    table's device rows (tuning.BySize of transport names) or None; ``concurrent``: the
    communicator runs beside others at once (the concurrent design); ``op_rows``: the
    table's device_ops ({op: BySize of transport names})."""

    def __init__(self, comm, gpu_transport='auto', rows=None, concurrent=False, op_rows=None):
        self._comm = comm
        self.gpu_transport = gpu_transport
        self._rows = rows
        self._op_rows = op_rows or {}
        self._concurrent = concurrent
        self.chosen = None       # the agreed default transport's name, once chosen
        self.built = {}          # name -> transports.Transport, once agreed
        self._by_size = {}       # op -> (nbytes -> name), from the table's device rows
        self._last = None        # the transport of the last device collective
        self._warned = set()     # names of transports a row named that cannot run here

    def transport(self, device, nbytes=None, op='allreduce'):
        """The transport for a device buffer of ``nbytes`` on ``device`` in collective
        ``op`` ('allreduce' or a key of tuning.OPS; collective on first use). Where it
        differs from the last one handed out, its stream waits for that one's
        (Transport.follow)."""
        if not self.built:
            self._agree(device)
        by_size = self._by_size.get(op, self._by_size.get('allreduce'))
        if nbytes is None or by_size is None:
            found = self.built[self.chosen]
        else:
            found = self.built[by_size(nbytes)]
        if self._last is not found:
            if self._last is not None:
                found.follow(self._last)
            self._last = found
        return found

    def _agree(self, device):
        comm = self._comm
        usable, shared = transports.agreed(comm, device)
        self.chosen = transports.decide(self.gpu_transport, usable, shared, self._concurrent)
        wanted = {self.chosen}
        tables = dict(self._op_rows, allreduce=self._rows)
        for op, rows in tables.items():
            if rows is not None and self.gpu_transport == 'auto':
                names = [self._runnable(name, usable, shared) for name in rows.values]
                wanted.update(names)
                self._by_size[op] = BySize(rows.sizes, names)
        for name in transports.REGISTRY:   # one order on every rank: constructors may be collective
            if name in wanted:
                self.built[name] = transports.REGISTRY[name](comm, device)
        log.info('device buffers go through %s (gpu_transport=%s%s)',
                 ', '.join(self.built), self.gpu_transport,
                 ', by size from the tune table' if self._by_size else '')

    def _runnable(self, name, usable, shared):
        """``name``, or the default where a table measured elsewhere names a transport that
        cannot run here: the inputs are agreed, so every rank replaces it alike."""
        try:
            transports.decide(name, usable, shared, self._concurrent)
        except ConfigError as err:
            if self._comm.rank == 0 and name not in self._warned:   # once, not once per op
                self._warned.add(name)
                log.warning('mpi_kvstore: the tune table sends some sizes through %s, which '
                            'cannot run here (%s): %s takes them', name, err, self.chosen)
            return self.chosen
        return name

    def run(self, buf, fn, *more, op='allreduce', nbytes=None):
        """``fn(transport, buf, *more)`` for a device buffer (and ``more`` buffers on its
        device: a reduce-scatter's result) in collective ``op``, through the transport that
        ``nbytes`` (the agreed size; default ``buf.nbytes``) takes, through copies on the
        transport's device where ``buf`` is on another device of this rank."""
        transport = self.transport(buf.device.id, buf.nbytes if nbytes is None else nbytes,
                                   op)
        debug.count('transport', transport.name)
        if buf.device.id == transport.device:
            fn(transport, buf, *more)
            return
        import cupy  # CuPy only where a GPU is used
        cupy.cuda.get_current_stream().synchronize()   # the caller's work on buf's device
        with transport.scope():
            mine = (buf,) + more
            there = [cupy.empty(b.shape, dtype=b.dtype) for b in mine]
            for near, far in zip(there, mine):
                near.data.copy_from_device_async(far.data, far.nbytes, transport.stream)
            fn(transport, *there)
            for near, far in zip(there, mine):
                far.data.copy_from_device_async(near.data, far.nbytes, transport.stream)
            transport.finish()

    def free(self):
        for transport in self.built.values():
            try:
                transport.free()
            except Exception:
                log.debug('freeing the %s transport failed', transport.name, exc_info=True)
        self.built.clear()
        self._last = None
