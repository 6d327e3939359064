"""Render mpi_kvstore timeline traces (MPI_KVSTORE_TIMELINE) to a PNG.

    python -m benchmarks.plot_timeline trace.rank0.json trace.rank1.json -o timeline.png

One band per rank, one row per key inside it; each collective is drawn as its
phases: QUEUED (waiting for its data in the engine), NEGOTIATE (ready, waiting
for agreement and earlier buckets) and the collective itself. Where QUEUED bars
of later keys overlap collectives of earlier ones, communication overlapped
the backward pass.
"""
import argparse
import json
import sys

from benchmarks import report

COLORS = {'QUEUED': '#d9d9d9', 'NEGOTIATE': '#fdae61'}
COLLECTIVE_COLOR = '#2c7bb6'
MAX_LABELLED_ROWS = 60


def load(paths):
    """-> {rank: [complete events]} from one or more trace files."""
    ranks = {}
    for path in paths:
        with open(path) as fh:
            trace = json.load(fh)
        for event in trace['traceEvents']:
            if event.get('ph') == 'X':
                ranks.setdefault(event['pid'], []).append(event)
    if not ranks:
        raise SystemExit(f'no complete events in {", ".join(paths)}')
    return ranks


def layout(ranks):
    """Row index per (rank, key), ranks stacked, keys in first-seen order."""
    rows, labels = {}, []
    for rank in sorted(ranks):
        for event in sorted(ranks[rank], key=lambda e: e['ts']):
            key = (rank, event['args']['key'])
            if key not in rows:
                rows[key] = len(rows)
                labels.append(f'r{key[0]} {key[1]}')
    return rows, labels


def draw(plt, ranks, output, title):
    rows, labels = layout(ranks)
    fig, ax = plt.subplots(figsize=(12, min(14, max(3, 0.18 * len(rows) + 1.5))))
    for rank, events in ranks.items():
        for e in events:
            y = rows[(rank, e['args']['key'])]
            color = COLORS.get(e['name'], COLLECTIVE_COLOR)
            ax.barh(y, e['dur'] / 1e3, left=e['ts'] / 1e3, height=0.8, color=color, lw=0)
    if len(labels) <= MAX_LABELLED_ROWS:
        ax.set_yticks(range(len(labels)))
        ax.set_yticklabels(labels, fontsize=6)
    else:  # too many keys to name: label each rank's band instead
        starts = [i for i, label in enumerate(labels)
                  if i == 0 or label.split()[0] != labels[i - 1].split()[0]]
        ax.set_yticks(starts)
        ax.set_yticklabels([f'rank {labels[i].split()[0][1:]}' for i in starts], fontsize=8)
        for y in starts[1:]:
            ax.axhline(y - 0.5, color='black', lw=0.5)
    ax.set_ylabel('one row per key')
    ax.invert_yaxis()
    ax.set_xlabel('time since the store was created (ms)')
    ax.set_title(title)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in (*COLORS.values(), COLLECTIVE_COLOR)]
    ax.legend(handles, [*COLORS, 'collective'], loc='lower right', fontsize=8)
    return report.save_figure(plt, fig, output)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('traces', nargs='+', help='trace files (one per rank)')
    parser.add_argument('-o', '--output', default='timeline.png')
    parser.add_argument('--title', default='mpi_kvstore timeline')
    args = parser.parse_args(argv)
    plt = report.pyplot()
    if plt is None:
        sys.exit(report.NO_MATPLOTLIB)
    print(draw(plt, load(args.traces), args.output, args.title))


if __name__ == '__main__':
    main()
