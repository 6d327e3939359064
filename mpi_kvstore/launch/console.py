"""What the command-line tools (doctor, tune, run, the options table) share: where they write,
the logger ``mpi_kvstore.launch.console`` (the library only logs; ``python -m mpi_kvstore`` attaches a
handler that writes those records, bare, to standard output), and how their ``--help`` reads."""
import argparse
import logging
import sys

__all__ = ['console', 'to_stdout', 'HelpFormatter']

console = logging.getLogger('mpi_kvstore.launch.console')


def to_stdout():
    """Write the tools' records to standard output, as lines (once per process)."""
    if not any(getattr(h, '_mpi_kvstore_cli', False) for h in console.handlers):
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter('%(message)s'))
        handler._mpi_kvstore_cli = True
        console.addHandler(handler)
    console.setLevel(logging.INFO)
    console.propagate = False


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every option's default shown after its help; the description kept as written (the
    tools' docstrings, whose usage examples would not survive rewrapping)."""
