"""Tables and plots, the same for every benchmark script.

Tables go through tabulate: :func:`markdown` (GitHub tables, cells not padded, as tests read
``^| name | figure``), :func:`text` (console); :func:`spread_text` is the one way to write a
median (min-max); :func:`table_record` and :func:`table_markdown`, a documented table and its
rendering. :func:`plot_bars` (matplotlib's Agg backend, optional) returns a line saying what
happened.
"""
import json
import os

from benchmarks import schema

NO_MATPLOTLIB = 'matplotlib is not installed: no plot (pip install matplotlib)'


def markdown(headers, rows):
    """A GitHub table of rows (lists of cells, shorter rows filled with empty cells), its
    rule line short: '|---|---|'."""
    from tabulate import tabulate  # here, not on import: Horovod's environment may lack it
    lines = tabulate(rows, headers, tablefmt='pipe', disable_numparse=True, stralign=None,
                     numalign=None, missingval='').splitlines()
    lines[1] = '|' + '---|' * len(headers)
    return '\n'.join(lines)


def text(headers, rows, align=None, indent=''):
    """A console table: columns two spaces apart, numbers and ``align``'s 'right' columns to
    the right, every line after ``indent``."""
    from tabulate import tabulate
    table = tabulate(rows, headers, tablefmt='plain', disable_numparse=True,
                     colalign=align, missingval='-')
    return '\n'.join(indent + line for line in table.splitlines())


def cell(value, spec, suffix=''):
    """A table's cell: value formatted by spec (and suffix), '-' for None."""
    return '-' if value is None else format(value, spec) + suffix


def number(value):
    """A figure to three significant digits, whole numbers from 100 on: 1234.5 -> '1234',
    56.78 -> '56.8', 87.0 -> '87', 0.04612 -> '0.0461'; '-' for None."""
    if value is None:
        return '-'
    return f'{value:.0f}' if abs(value) >= 100 else f'{value:.3g}'


def spread_text(spread, scale=1.0):
    """'median (min-max)' of a harness.spread ({'min', 'median', 'max'}), each times scale
    (1e3: seconds to ms): the one way every table writes a spread; '-' for None."""
    if not spread:
        return '-'
    low, mid, high = (number(spread[key] * scale) for key in ('min', 'median', 'max'))
    return f'{mid} ({low}-{high})'


# ---------------------------------------------------------------- a documented table

def table_record(name, title, command, date, machine, unit, columns, rows, over, ratios=(),
                 notes=()):
    """A table of docs/benchmarks.md as its result file holds it (schema kind 'table'): the
    command and date that made it, the machine, and rows of {'label', 'hosts', 'rate',
    'cells': {column: harness.spread in `unit`, or None}}; ratios: (a, b) pairs, shown as
    the median of a over the median of b."""
    return {'table': name, 'title': title, 'command': command, 'date': date, 'machine': machine,
            'unit': unit, 'over': over, 'columns': list(columns), 'ratios': [list(r) for r in ratios],
            'rows': rows, 'notes': list(notes)}


def _ratio(cells, a, b):
    if not cells.get(a) or not cells.get(b):
        return '-'
    return f'{cells[a]["median"] / cells[b]["median"]:.2f}x'


def table_markdown(record):
    """The Markdown of a table_record: title, command, date and machine, then the table
    (every cell median (min-max), spread_text) and its notes."""
    commands = record['command'] if isinstance(record['command'], list) else [record['command']]
    network = any(row['rate'] for row in record['rows'])     # else one machine: no hosts, rate
    rows = [[row['label'], *([str(row['hosts']), row['rate'] or '-'] if network else []),
             *[spread_text(row['cells'].get(c)) for c in record['columns']],
             *[_ratio(row['cells'], a, b) for a, b in record['ratios']]] for row in record['rows']]
    headers = ['', *(['hosts', 'rate'] if network else []), *record['columns'],
               *[f'{a} / {b}' for a, b in record['ratios']]]
    return '\n'.join([
        f'### {record["title"]}', '', *[f'    {c}' for c in commands], '',
        f'{record["date"]}; {record["machine"]}. {record["unit"]}, median (min-max) over '
        f'{record["over"]}.', '', markdown(headers, rows),
        *([''] + [f'- {n}' for n in record['notes']] if record['notes'] else [])]) + '\n'


def write_table(folder, record):
    """record as folder/NAME.json and its Markdown as NAME.md, checked against the schema."""
    schema.check(record, record['table'])
    base = os.path.join(folder, record['table'])
    with open(base + '.json', 'w') as handle:
        json.dump(record, handle, indent=1)
        handle.write('\n')
    with open(base + '.md', 'w') as handle:
        handle.write(table_markdown(record))
    return base + '.md'


def plot_bars(path, panels, ylabel, title, lines=None, dpi=120):
    """Bar charts, one per {panel: {label: value}} (each with its own scale: models differ by
    orders of magnitude), four to a row. A value may be a harness.spread: its median with
    min-max whiskers. lines: {panel: (label, y)}, a dashed line across that panel (compute
    alone). Returns a message saying what happened."""
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        return NO_MATPLOTLIB
    ncols = min(4, max(1, len(panels)))
    nrows = -(-max(1, len(panels)) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(1 + 4.2 * ncols, 0.5 + 3.6 * nrows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.axis('off')
    for ax, (name, bars) in zip(axes.flat, panels.items()):
        spreads = [v if isinstance(v, dict) else {'min': v, 'median': v, 'max': v} for v in bars.values()]
        heights = [s['median'] for s in spreads]
        ax.bar(range(len(bars)), heights, yerr=[[h - s['min'] for h, s in zip(heights, spreads)],
                                                [s['max'] - h for h, s in zip(heights, spreads)]],
               capsize=3, color=[f'C{i}' for i in range(len(bars))])
        if lines and name in lines:
            label, y = lines[name]
            ax.axhline(y, color='black', linestyle='--', linewidth=1, label=label)
            ax.legend(fontsize=7, loc='lower left')
        ax.set_xticks(range(len(bars)))
        ax.set_xticklabels(list(bars), rotation=40, ha='right', fontsize=8)
        ax.set_title(name, fontsize=9)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.grid(True, axis='y', alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return f'plot written to {path}'
