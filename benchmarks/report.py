"""Tables and plots, the same for every benchmark script.

Tables go through tabulate: :func:`markdown` for GitHub tables (results files, and reports
that tests read with ``^| name | figure``: cells are not padded), :func:`text` for the
fixed-width tables printed on a console. Callers format their figures into strings first,
so that a table's figures read exactly as the script's own format says. Plots draw with
matplotlib's Agg backend into files, and return a line saying what happened (matplotlib is
optional: without it the line says so).
"""
from tabulate import tabulate

NO_MATPLOTLIB = 'matplotlib is not installed: no plot (pip install matplotlib)'


def markdown(headers, rows):
    """A GitHub table of rows (lists of cells, shorter rows filled with empty cells)."""
    return tabulate(rows, headers, tablefmt='pipe', disable_numparse=True, stralign=None,
                    numalign=None, missingval='')


def text(headers, rows, align=None, indent=''):
    """A console table: columns two spaces apart, numbers and ``align``'s 'right' columns to
    the right, every line after ``indent``."""
    table = tabulate(rows, headers, tablefmt='plain', disable_numparse=True,
                     colalign=align, missingval='-')
    return '\n'.join(indent + line for line in table.splitlines())


def cell(value, spec, suffix=''):
    """A table's cell: value formatted by spec (and suffix), '-' for None."""
    return '-' if value is None else format(value, spec) + suffix


def spread_ms(spread):
    """'median (min-max)' in ms of a harness.spread of seconds."""
    return f'{spread["median"] * 1e3:.1f} ({spread["min"] * 1e3:.1f}-{spread["max"] * 1e3:.1f})'


def pyplot():
    """matplotlib.pyplot drawing into files (the Agg backend), or None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_figure(plt, fig, path, dpi=120):
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return f'plot written to {path}'


def plot_lines(path, series, xlabel, ylabel, title):
    """Log-log plot, one line per {label: (xs, ys)}; returns a message saying what happened."""
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, marker='o', label=label)
    ax.set(xscale='log', yscale='log', xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(True, which='both', alpha=0.3)
    ax.legend()
    return save_figure(plt, fig, path)


def plot_bars(path, panels, ylabel, title):
    """Bar charts side by side, one per {panel: {label: value}} (each panel with its own
    scale: models differ by orders of magnitude); returns a message saying what happened."""
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(1 + 4.5 * max(1, len(panels)), 5.5),
                             squeeze=False)
    for ax, (name, bars) in zip(axes[0], panels.items()):
        positions = range(len(bars))
        ax.bar(positions, list(bars.values()))
        ax.set_xticks(list(positions))
        ax.set_xticklabels(list(bars), rotation=40, ha='right', fontsize=8)
        ax.set(title=name, ylabel=ylabel)
        ax.grid(True, axis='y', alpha=0.3)
    fig.suptitle(title)
    return save_figure(plt, fig, path)
