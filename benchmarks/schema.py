"""What a result file under benchmarks/results/ holds, written down once and checked.

Every JSON there is one of these kinds (:func:`kind` tells them apart), each with the keys
below at least; a script's own results come beside them (results, models, columns, rows...):

    table      a table of docs/benchmarks.md (report.table_record, beside it NAME.md, its
               rendering): table, title, command, date, machine, unit, over, columns, ratios,
               rows (each with label, hosts, rate and cells: {column: {min, median, max} or
               None}, min <= median <= max)
    run        one script's run, written by harness.Run.write on rank 0: benchmark (the
               script's name), versions (VERSIONS), env (the OMP_/MXNET_/MPI_KVSTORE_/...
               variables it saw), nranks, config (its arguments plus CONFIG: the script, the
               rank count, argv, the date the run started and the command that reruns it),
               time (when the file was written) and skipped ({method: why})
    grid       grid.py's combined record: benchmark, mode, time, config, cells (each a cell
               on a test bed of its own, with its jobs' run records under results)
    cost_model cost_model's report (cost_model.json): time, assumptions, prediction
    overlap    cost_model's learned overlap (overlap_model.json): points, fitted,
               predictions, fit_on, assumptions
    tune       a tune table (the store's autotune writes the schedule entry): version,
               comm_size; mpi_kvstore.comm.tuning.Table.from_json validates what is inside
    gpu_bandwidth  gpu_bandwidth.py --json: title, bytes, ranks, device, rows (each with
               what, seconds, min, median, max, baseline)

The other files are not checked: NAME.md (a table's rendering, a script's tables) and
log.txt (a job's output).
"""
import json
import os

VERSIONS = ('python', 'numpy', 'mxnet', 'mpi4py', 'mpi_kvstore', 'mpi_library', 'hostname',
            'platform', 'cpu_count')
CONFIG = ('script', 'nranks', 'argv', 'date', 'command')
KINDS = {
    'table': ('table', 'title', 'command', 'date', 'machine', 'unit', 'over', 'columns', 'ratios',
              'rows'),
    'run': ('benchmark', 'versions', 'env', 'nranks', 'config', 'time', 'skipped'),
    'grid': ('benchmark', 'mode', 'time', 'config', 'cells'),
    'cost_model': ('time', 'assumptions', 'prediction'),
    'overlap': ('points', 'fitted', 'predictions', 'fit_on', 'assumptions'),
    'tune': ('version', 'comm_size'),
    'gpu_bandwidth': ('title', 'bytes', 'ranks', 'device', 'rows'),
}
NESTED = {('run', 'versions'): VERSIONS, ('run', 'config'): CONFIG}


class SchemaError(ValueError):
    """A result file that does not hold what its kind must."""


def kind(record):
    """Which kind of result a JSON record is (see the module docstring)."""
    if not isinstance(record, dict):
        return None
    if 'table' in record and 'rows' in record:
        return 'table'
    if record.get('benchmark') == 'grid' and 'cells' in record:
        return 'grid'
    if 'benchmark' in record:
        return 'run'
    if 'prediction' in record:
        return 'cost_model'
    if 'fitted' in record:
        return 'overlap'
    if 'comm_size' in record:
        return 'tune'
    if 'device' in record and 'rows' in record:
        return 'gpu_bandwidth'
    return None


def check(record, where='record'):
    """record's kind, or SchemaError naming `where` and what is missing."""
    found = kind(record)
    if found is None:
        raise SchemaError(f'{where}: not a result of any kind ({", ".join(KINDS)}): keys '
                          f'{sorted(record) if isinstance(record, dict) else type(record).__name__}')
    missing = [key for key in KINDS[found] if key not in record]
    for (of, key), wanted in NESTED.items():
        if of == found and isinstance(record.get(key), dict):
            missing += [f'{key}.{sub}' for sub in wanted if sub not in record[key]]
    if found == 'grid':
        for cell in record['cells']:
            for job, result in (cell.get('results') or {}).items():
                check(result, f'{where}: cell {cell.get("job")} {job}')
    if found == 'table' and not missing:
        _check_rows(record, where)
    if missing:
        raise SchemaError(f'{where}: a {found} result without {", ".join(missing)}')
    return found


def _check_rows(record, where):
    """Every row of a table has its hosts, rate and cells, and every cell min <= median <= max."""
    for row in record['rows']:
        lacks = [key for key in ('label', 'hosts', 'rate', 'cells') if key not in row]
        if lacks:
            raise SchemaError(f'{where}: row {row.get("label")!r} without {", ".join(lacks)}')
        for column, cell in row['cells'].items():
            if column not in record['columns']:
                raise SchemaError(f'{where}: row {row["label"]!r} has a cell {column!r} of no column')
            if cell is not None and not cell['min'] <= cell['median'] <= cell['max']:
                raise SchemaError(f'{where}: row {row["label"]!r}, {column}: not min <= median <= max')


def check_tree(root):
    """{path: kind} of every JSON under root, each checked; other files are passed over."""
    checked = {}
    for folder, _, files in sorted(os.walk(root)):
        for name in sorted(files):
            if not name.endswith('.json'):
                continue        # NAME.md, NOTES.md, log.txt, load.txt: prose and logs
            path = os.path.join(folder, name)
            with open(path) as handle:
                checked[path] = check(json.load(handle), path)
    return checked
