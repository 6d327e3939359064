"""Horovod's HOROVOD_* environment variables, read as the store options they ask for.

No MXNet and no MPI here: hvd.init (basics.py) passes the options on to its store.
"""
from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ['HONOURED', 'environment_options', 'apply_log_level']


# -- the environment --------------------------------------------------------------------------
def _seconds(text):
    return float(text)


def _on_off(text):
    return 'on' if text.strip().lower() in ('1', 'true', 'yes', 'on') else 'off'


# HOROVOD_* variable -> (store option, parse); MPI_KVSTORE_<OPTION> wins over it
HONOURED: dict[str, tuple[str, Callable[[str], Any]]] = {
    'HOROVOD_FUSION_THRESHOLD': ('fusion_threshold', int),
    'HOROVOD_TIMELINE': ('timeline', str),
    'HOROVOD_HIERARCHICAL_ALLREDUCE': ('hierarchical', _on_off),
    'HOROVOD_STALL_CHECK_TIME_SECONDS': ('stall_warning', _seconds),
    'HOROVOD_STALL_SHUTDOWN_TIME_SECONDS': ('stall_abort', _seconds),
    # Horovod's bound on its response cache; here on the named collectives' staging buffers
    'HOROVOD_CACHE_CAPACITY': ('name_cache_capacity', int),
}
# Read here for what they mean, not passed to the store.
_HANDLED = ('HOROVOD_STALL_CHECK_DISABLE', 'HOROVOD_LOG_LEVEL')
_LOG_LEVELS = {'trace': logging.DEBUG, 'debug': logging.DEBUG, 'info': logging.INFO,
               'warning': logging.WARNING, 'error': logging.ERROR, 'fatal': logging.CRITICAL}


def environment_options(environ: Mapping[str, str] | None = None
                        ) -> tuple[dict[str, Any], list[str]]:
    """The store options that Horovod's environment variables ask for, and the HOROVOD_*
    variables that have no meaning here (sorted) -> (options, ignored). An
    ``MPI_KVSTORE_*`` variable of the same option wins over the Horovod one."""
    environ = os.environ if environ is None else environ
    options = {}
    for var, (option, parse) in HONOURED.items():
        if var in environ and 'MPI_KVSTORE_%s' % option.upper() not in environ:
            try:
                options[option] = parse(environ[var])
            except ValueError as err:
                raise ValueError('%s=%r: %s' % (var, environ[var], err)) from err
    disable = environ.get('HOROVOD_STALL_CHECK_DISABLE', '').strip().lower()
    if disable in ('1', 'true', 'yes', 'on') and 'MPI_KVSTORE_STALL_WARNING' not in environ:
        options['stall_warning'] = 0.0
    if options.get('timeline', '').upper() == 'DYNAMIC':
        options['timeline'] = os.path.join(tempfile.gettempdir(),
                                           'mpi_kvstore-hvd-timeline-%d.json' % os.getpid())
    ignored = sorted(var for var in environ
                     if var.startswith('HOROVOD_') and var not in HONOURED
                     and var not in _HANDLED)
    return options, ignored


def apply_log_level(environ: Mapping[str, str]) -> None:
    """HOROVOD_LOG_LEVEL sets the level of the library's logger."""
    level = environ.get('HOROVOD_LOG_LEVEL', '').strip().lower()
    if level in _LOG_LEVELS:
        logging.getLogger('mpi_kvstore').setLevel(_LOG_LEVELS[level])
