"""Where the command-line tools (doctor, tune, the options table) write: the logger
``mpi_kvstore.cli``. The library only logs; ``python -m mpi_kvstore`` attaches a handler
that writes those records, bare, to standard output."""
import logging
import sys

__all__ = ['console', 'to_stdout']

console = logging.getLogger('mpi_kvstore.cli')


def to_stdout():
    """Write the tools' records to standard output, as lines (once per process)."""
    if not any(getattr(h, '_mpi_kvstore_cli', False) for h in console.handlers):
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter('%(message)s'))
        handler._mpi_kvstore_cli = True
        console.addHandler(handler)
    console.setLevel(logging.INFO)
    console.propagate = False
