"""The figures of docs/benchmarks.md, drawn from the committed tables (benchmarks/results/).

    python -m docs.plots.make_plots            # from the repository root; writes docs/img/*.png

peers.png: overlap.json, a panel per job (only columns of one job ran interleaved): each
trainer's step, median with min-max whiskers, and compute alone as a dashed line.
grid.png: grid.json, a panel per cell: each column's step, median with min-max whiskers.
small.png: small.json, a panel per case: each column's time, median with min-max whiskers.
Both drawn by benchmarks.report.plot_bars, the plot every benchmark uses.
"""
import json
import os

from benchmarks import harness, report

RESULTS = os.path.join(harness.REPO_ROOT, 'benchmarks', 'results')
IMG = os.path.join(harness.REPO_ROOT, 'docs', 'img')


def panels(table, skip=()):
    """{row name: {column: spread}} of a table's rows, the columns that ran, and the row
    name with its hosts and rate."""
    return {f'{row["label"]}, {row["hosts"]} hosts, {row["rate"]}': {
        column: spread for column, spread in row['cells'].items() if spread and column not in skip}
        for row in table['rows']}


def main():
    os.makedirs(IMG, exist_ok=True)
    with open(os.path.join(RESULTS, 'overlap.json')) as handle:
        peers = json.load(handle)
    compute = {name: ('compute alone', row['cells']['compute alone']['median'])
               for name, row in zip(panels(peers), peers['rows'])}
    print(report.plot_bars(os.path.join(IMG, 'peers.png'), panels(peers, skip=('compute alone',)),
                           'step ms', peers['title'], lines=compute, dpi=60))
    with open(os.path.join(RESULTS, 'grid.json')) as handle:
        grid = json.load(handle)
    print(report.plot_bars(os.path.join(IMG, 'grid.png'), panels(grid), 'step ms', grid['title'], dpi=60))
    with open(os.path.join(RESULTS, 'small.json')) as handle:
        small = json.load(handle)
    print(report.plot_bars(os.path.join(IMG, 'small.png'), {row['label']: {
        column: spread for column, spread in row['cells'].items() if spread} for row in small['rows']},
        'us', small['title'], dpi=60))


if __name__ == '__main__':
    main()
