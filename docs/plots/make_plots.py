"""The figures of docs/benchmarks.md, drawn from the committed result files.

    python -m docs.plots.make_plots            # from the repository root; writes docs/img/*.png

It prints the Markdown table that sits beside each figure, with the same rounding as the
result files' own tables (.md beside each .json), so the page quotes the files, not a copy.

peers.png: every quiet `benchmarks.overlap` job of 2026-11-25 with CPU accounting
(benchmarks/results/overlap/2026-11-25/*_cpu_*, folders without `_loaded`), one panel per job:
the step of FIFO, priority (the defaults), per-key gluon.Trainer and MXNet's dist_sync or P3,
median with min-max whiskers, and compute alone as a line. Panels are jobs, not topologies,
because only columns of one job ran interleaved: a P3 job is a panel of its own.

overlap_grid.png: the grid of 2026-11-27, the cells of the six runs (benchmarks/results/
overlap_grid/2026-11-27-{F,A2,B,C,D,G}) made with one version of the search (NOTES.md beside
them), drawn by benchmarks.overlap_grid's own plot, with its table.
"""
import glob
import json
import os

from benchmarks import harness

RESULTS = os.path.join(harness.REPO_ROOT, 'benchmarks', 'results', 'overlap', '2026-11-25')
GRID = [os.path.join(harness.REPO_ROOT, 'benchmarks', 'results', 'overlap_grid', '2026-11-27-' + run,
                     'overlap_grid.json') for run in ('F', 'A2', 'B', 'C', 'D', 'G')]
IMG = os.path.join(harness.REPO_ROOT, 'docs', 'img')
PEERS = ('fifo', 'priority', 'gluon', 'dist_sync', 'dist_sync:p3', 'horovod')
COLOURS = {'fifo': 'tab:gray', 'priority': 'tab:blue', 'gluon': 'tab:cyan',
           'dist_sync': 'tab:red', 'dist_sync:p3': 'tab:orange', 'horovod': 'tab:green'}


def quiet_jobs(root=RESULTS):
    """(folder, result) of every overlap job with CPU accounting that no other job loaded,
    by workload, hosts, link rate, then start time."""
    jobs = []
    for path in sorted(glob.glob(os.path.join(root, '*_cpu_*', 'overlap_*.json'))):
        folder = os.path.basename(os.path.dirname(path))
        if folder.endswith('_loaded'):
            continue
        with open(path) as handle:
            jobs.append((folder, json.load(handle)))
    def order(job):
        result = job[1]
        rate = int(result['config']['topology'].split(', ')[1].replace('gbit', ''))
        return (result['model'] != 'resnet50_v1', result['images_per_s'],
                result['topology']['hosts'], rate, result['config']['date'])
    return sorted(jobs, key=order)


def title(result):
    """'ResNet-50 125/s, 2 hosts, 3gbit, 23:22' from the job's own record."""
    model = {'resnet50_v1': 'ResNet-50', 'vgg16': 'VGG-16'}.get(result['model'], result['model'])
    hosts = result['topology']['hosts']
    rate = result['config']['topology'].split(', ')[1]
    clock = result['config']['date'][11:16]
    return f'{model} {result["images_per_s"]:g}/s, {hosts} hosts, {rate}, {clock}'


def columns(result):
    """{peer: row} of the columns that ran, in PEERS order; skipped ones are absent."""
    rows = {row['column']: row for row in result['columns'] if 'step' in row}
    return {name: rows[name] for name in PEERS if name in rows}


def ms(spread):
    return f'{spread["median"] * 1e3:.1f} ({spread["min"] * 1e3:.1f}-{spread["max"] * 1e3:.1f})'


def peers_table(jobs):
    """One line per job: compute alone, then each peer's step, median (min-max) ms, and
    priority's ratio to FIFO (the job's own `vs_fifo`)."""
    lines = ['| job | compute alone | fifo | priority (vs fifo) | gluon | '
             'dist_sync or P3 |', '|---|---|---|---|---|---|']
    for _, result in jobs:
        cols = columns(result)
        ps = cols.get('dist_sync') or cols.get('dist_sync:p3')
        ps_name = 'P3: ' if 'dist_sync:p3' in cols else ''
        lines.append(
            f'| {title(result)} | {result["compute_alone"]["median"] * 1e3:.1f} | '
            f'{ms(cols["fifo"]["step"])} | {ms(cols["priority"]["step"])} '
            f'({cols["priority"]["vs_fifo"]:.2f}x) | {ms(cols["gluon"]["step"])} | '
            f'{ps_name}{ms(ps["step"])} |')
    return '\n'.join(lines)


def peers_plot(jobs, path):
    plt = harness.pyplot()
    if plt is None:
        return harness.NO_MATPLOTLIB
    ncols = 4
    nrows = -(-len(jobs) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.6 * nrows), squeeze=False)
    for ax in axes.flat[len(jobs):]:
        ax.axis('off')
    for ax, (_, result) in zip(axes.flat, jobs):
        cols = columns(result)
        names = list(cols)
        med = [cols[n]['step']['median'] * 1e3 for n in names]
        low = [m - cols[n]['step']['min'] * 1e3 for m, n in zip(med, names)]
        high = [cols[n]['step']['max'] * 1e3 - m for m, n in zip(med, names)]
        ax.bar(range(len(names)), med, yerr=[low, high], capsize=3,
               color=[COLOURS[n] for n in names])
        ax.axhline(result['compute_alone']['median'] * 1e3, color='black', linestyle='--',
                   linewidth=1, label='compute alone')
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels([n.replace('dist_sync:p3', 'P3') for n in names], fontsize=8)
        ax.set_title(title(result), fontsize=9)
        ax.set_ylabel('step ms (median, min-max)', fontsize=8)
        ax.grid(True, axis='y', alpha=0.3)
    axes.flat[0].legend(fontsize=8, loc='lower left')
    fig.suptitle('GPU-like training step per peer, one interleaved job per panel '
                 '(test hosts: network namespaces on one 2-core VM, tbf-shaped TCP; '
                 'Horovod did not import in any job)', fontsize=10)
    return harness.save_figure(plt, fig, path)


def main():
    os.makedirs(IMG, exist_ok=True)
    jobs = quiet_jobs()
    print(peers_table(jobs))
    print(peers_plot(jobs, os.path.join(IMG, 'peers.png')))
    from benchmarks import overlap_grid  # brings MXNet and the test bed in: only for this figure
    runs = []
    for path in GRID:
        with open(path) as handle:
            runs.append(json.load(handle))
    combined = dict(runs[0], cells=[c for run in runs for c in run['cells']],
                    command='; '.join(run['command'] for run in runs),
                    elapsed_s=sum(run['elapsed_s'] for run in runs))
    print(overlap_grid.markdown(combined))
    print(overlap_grid.plot(combined, os.path.join(IMG, 'overlap_grid.png')))


if __name__ == '__main__':
    main()
