"""``python -m mpi_kvstore doctor``: what this machine and this MPI give the store.

The first thing to run on a new cluster, alone or under the launcher
(``mpiexec -n 2 python -m mpi_kvstore doctor``). It reads everything and
changes nothing: it creates no store, and it runs no collective, so it cannot
hang on a rank that is missing. Under a launcher, every rank writes its own
report, prefixed with its rank.
"""
import argparse
import importlib
import json
import os

from ..comm import mpiabi, topology, transports, tuning
from ..comm.mpiabi import MPI
from ..comm.tuning import OPS, Table
from ..config import _LOCAL_RANK_VARS, Config, format_bytes, launcher_local_rank
from ..designs import NEGOTIATED_NAMES, REGISTRY, autotune, get_design
from ..errors import ConfigError
from ..launch.console import HelpFormatter, console

__all__ = ['report']


def _version(module):
    try:
        found = importlib.import_module(module)
    except Exception as err:
        return 'not available (%s: %s)' % (type(err).__name__, err)
    return getattr(found, '__version__', 'present')


def _nccl():
    try:
        from cupy.cuda import nccl  # optional dependency, loaded where used
    except Exception as err:
        return 'not available (%s)' % type(err).__name__
    try:
        return 'version %d' % nccl.get_version()
    except Exception as err:
        return 'present, version unknown (%s)' % err


def _local():
    found = launcher_local_rank()
    if found is None:
        return ('not set by the launcher (none of %s): the store asks MPI (COMM_TYPE_SHARED) '
                'on first use' % ', '.join(r for r, _ in _LOCAL_RANK_VARS))
    source = next(r for r, s in _LOCAL_RANK_VARS if r in os.environ and s in os.environ)
    return 'local rank %d of %d (from %s)' % (found[0], found[1], source)


def _designs(config, provided):
    lines = []
    for name, cls in REGISTRY.items():
        ok = provided >= cls.thread_level
        mark = '*' if name == config.design else ' '
        why = ('usable' if ok else 'needs %s, MPI gives %s'
               % (mpiabi.thread_level_name(cls.thread_level), mpiabi.thread_level_name(provided)))
        lines.append('  %s %-10s %s' % (mark, name, why))
    return lines


def _gpus():
    try:
        import cupy  # CuPy only where a GPU is used
        return cupy.cuda.runtime.getDeviceCount(), None
    except Exception as err:
        return 0, '%s: %s' % (type(err).__name__, err)


def _gpu_transports(config):
    """Which GPU transport this rank could use, and what gpu_transport would pick, judged
    from this rank alone (the store's choice is agreed by every rank: transports.choose)."""
    count, why = _gpus()
    if not count:
        return ['  GPU arrays:     none here (%s)' % why]
    found = launcher_local_rank()
    shared = found is not None and found[1] > count
    probe = type('Probe', (), {'cuda_aware_setting': config.cuda_aware})()
    usable = {name: cls.usable(probe) for name, cls in transports.REGISTRY.items()}
    try:
        chosen = transports.decide(config.gpu_transport, usable, shared,
                                   config.design == 'concurrent')
        verdict = 'would pick %s' % chosen
    except ConfigError as err:
        chosen, verdict = None, 'cannot run: %s' % err
    lines = ['  GPU arrays:     %d GPU(s); gpu_transport=%s %s (ranks agree at the first GPU '
             'collective)%s' % (count, config.gpu_transport, verdict,
                                '; %d ranks on this host share them, which NCCL refuses'
                                % found[1] if shared else '')]
    for name, (ok, why) in usable.items():
        lines.append('    %s %-9s %s' % ('*' if name == chosen else ' ', name,
                                         'usable' if ok else why))
    return lines


def _tune_table(config):
    """What the option tune_table would give this job, read here by this rank alone (the
    store's rank 0 reads it and broadcasts it: tuning.load)."""
    path = config.tune_table
    if not path:
        return ['tune table:       none (every collective takes the store\'s default; GPU buffers take '
                'gpu_transport\'s choice)']
    try:
        with open(path) as fh:
            table = Table.from_json(json.load(fh))
    except (OSError, ValueError, KeyError, TypeError) as err:
        return ['tune table:       %s cannot be used: %s: %s (creating a store raises '
                'ConfigError)' % (path, type(err).__name__, err)]
    size = MPI.COMM_WORLD.Get_size()
    lines = ['tune table:       %s, measured on %d ranks%s' % (
        path, table.comm_size, '' if table.comm_size == size
        else ' (this job has %d: ignored)' % size)]
    if table.schedule:   # tune's or autotune's choice, where a store starts
        lines.append('  schedule:       ' + autotune.describe(table.schedule))
    lines.append('  allreduce:      ' + ', '.join(
        '%s %s' % (_bytes(n), name) for n, name in zip(table.sizes, table.backends)))
    for op in OPS:   # the other collectives' rows; none: the store's own choice
        rows = table.ops.get(op)
        lines.append('  %-15s ' % (op + ':') + ("none (the store's default)" if rows is None else ', '.join(
            '%s %s%s' % (_bytes(n), c.algorithm, '' if c.chunk_bytes is None
                         else ' (chunks of %s)' % _bytes(c.chunk_bytes))
            for n, c in zip(rows.sizes, rows.values))))
    if table.device is not None or table.device_ops:
        lines += _device_rows(config, table)
    return lines


def _device_rows(config, table):
    """The table's GPU transport by size: allreduce's ``device`` rows, then each other
    op's ``device_ops`` rows (an op without them takes allreduce's)."""
    def shown(rows):
        return ', '.join('%s %s' % (_bytes(n), name) for n, name in zip(rows.sizes, rows.values))
    wins = (' (gpu_transport=%s wins)' % config.gpu_transport
            if config.gpu_transport != 'auto' else '')
    allreduce = ("none (gpu_transport's choice)" if table.device is None
                 else shown(table.device))
    lines = ['  GPU allreduce:  ' + allreduce + wins]
    for op in OPS:
        rows = table.device_ops.get(op)
        lines.append('  %-15s ' % ('GPU %s:' % op) + (
            'as allreduce' if rows is None else shown(rows) + wins))
    return lines


def _keepidle():
    value, who = mpiabi.ucx_keepidle()
    if value is None:
        return ("UCX's default, keepalive on (%s): a cut link between steps can crash MPICH; "
                'set UCX_TCP_KEEPIDLE=inf in the environment (docs/faults.md)' % who)
    return 'UCX_TCP_KEEPIDLE=%s (%s%s)' % (
        value, who, ', TCP keepalive off: a cut link ends as a named stall'
        if value == mpiabi.KEEPIDLE_DEFAULT else '')


def _bytes(n):
    return format_bytes(n, ' B')


def report(environ=None):
    """The doctor's report, as lines of text."""
    config = Config()
    try:
        table = tuning.load(config.tune_table, MPI.COMM_WORLD)
    except ConfigError:
        table = None          # _tune_table says why
    config, chosen = topology.resolve(config, MPI.COMM_WORLD, table, warn=False)
    provided = mpiabi.provided_thread_level()
    library = ' '.join(MPI.Get_library_version().split('\n')[0].split())
    aware = mpiabi.cuda_aware(config.cuda_aware)
    how = {'auto': 'asked of the MPI library', 'on': 'forced on by cuda_aware=on',
           'off': 'forced off by cuda_aware=off'}[config.cuda_aware]
    design = get_design(config.design)
    lines = [
        'mpi_kvstore doctor: rank %d of %d on %s' % (MPI.COMM_WORLD.Get_rank(),
                                                    MPI.COMM_WORLD.Get_size(),
                                                    MPI.Get_processor_name()),
        'MPI library:      %s (MPI %d.%d)' % ((library,) + MPI.Get_version()),
        'mpi4py:           %s' % _version('mpi4py'),
        'thread level:     %s provided' % mpiabi.thread_level_name(provided),
        'CUDA-aware MPI:   %s (%s)' % ('yes' if aware else 'no', how),
        'UCX keepalive:    %s' % _keepidle(),
        'numba:            %s' % _version('numba'),
        'MXNet:            %s' % _version('mxnet'),
        'CuPy:             %s' % _version('cupy'),
        'NCCL:             %s' % _nccl(),
        'ml_dtypes (bf16): %s' % _version('ml_dtypes'),
        'local rank:       %s' % _local(),
        'designs (* = the one a store runs: design=%s, from %s):'
        % (config.design, config.origin('design')),
    ]
    lines += _designs(config, provided)
    warning = topology.design_warning(config.design, topology.count_hosts(MPI.COMM_WORLD))
    if warning:
        lines.append('  warning: ' + warning.split(': ', 1)[1])
    if provided < design.thread_level:
        lines.append('  the chosen design cannot run here: creating a store raises '
                     'ThreadLevelError')
    lines += [
        'transports:',
        '  host arrays:    MPI (%s)' % library.split(',')[0],
    ]
    lines += _gpu_transports(config)
    lines += [
        'allreduce:        hierarchical=%s (auto keeps every allreduce flat: measured no faster '
        'over TCP); progress_sleep_us=%g%s' % (
            config.hierarchical, config.progress_sleep_us,
            '' if config.progress_sleep_us else ' (blocking MPI: busy-polls a core)'),
        'compression:      %s (2-bit: kv.set_gradient_compression)' % config.compression,
        'schedule:         partition_bytes=%s, credit_bytes=%s (%s)' % (
            _bytes(config.partition_bytes) if config.partition_bytes else '0 (never cut)',
            _bytes(config.credit_bytes) if config.credit_bytes else '0 (all agreed at once)',
            chosen.split(': ', 1)[1] if chosen else 'as given'),
        'autotune:         %s' % _autotune(config),
    ]
    return lines + _tune_table(config)


def _autotune(config):
    """Whether the store would search its schedule online, over which knobs, and where its
    choice would go (designs/autotune.py)."""
    if not config.autotune:
        return 'off (%s; autotune=1 searches the schedule while the job trains)' % (
            config.origin('autotune'))
    if config.design not in NEGOTIATED_NAMES:
        return 'on, but design=%s has no negotiation rounds: nothing is searched' % config.design
    free = autotune.free_knobs(config)
    return 'on (%s), %d steps a sample, searching %s%s; the choice goes %s' % (
        config.origin('autotune'), config.autotune_steps,
        ', '.join(free) or 'nothing (every knob set by the user)',
        '' if len(free) == len(autotune.KNOBS) else ' (the rest set by the user)',
        'into %s' % config.tune_table if config.tune_table else 'to the log alone (no tune_table)')


def main(argv=None):
    """``python -m mpi_kvstore doctor``: the report, prefixed with the rank under a launcher.
    -> exit status 0 (a wrong MPI_KVSTORE_* variable raises ConfigError, which the command
    line words in one line)."""
    argparse.ArgumentParser(
        prog='python -m mpi_kvstore doctor', description=__doc__, formatter_class=HelpFormatter,
        epilog='It reads the MPI_KVSTORE_* environment variables as a store would (python -m '
               'mpi_kvstore options lists them).').parse_args(argv)
    prefix = '[%d] ' % MPI.COMM_WORLD.Get_rank() if MPI.COMM_WORLD.Get_size() > 1 else ''
    console.info('\n'.join(prefix + line for line in report()))
    return 0
