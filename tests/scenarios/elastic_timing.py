"""From a worker's SIGKILL to rank 0's next completed step: survivors in memory
(``python -m mpi_kvstore run --elastic``) against the supervisor's relaunch from disk
(``python -m mpi_kvstore run --backoff 0 --state-dir D``), on the same training script
(elastic_world.py), runs interleaved. docs/elastic.md quotes its medians.

usage: python tests/scenarios/elastic_timing.py RANKS RUNS [STEP_SECONDS] [--store]

``--store``: the training script is elastic_store.py (a Gluon model, hvd.DistributedTrainer
on the store, hvd.elastic.run with MXNetState) instead of elastic_world.py (the world's own
allreduce on numpy arrays).
"""
import os
import re
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
SCRIPT = os.path.join(HERE, 'elastic_world.py')
STORE_SCRIPT = os.path.join(HERE, 'elastic_store.py')
ENV = dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=os.pathsep.join([REPO, HERE]))


def recovery(output, folder):
    """Seconds from the kill (the killed worker's stamp) to rank 0's next completed step."""
    with open(os.path.join(folder, 'w.killed')) as fh:
        killed = float(fh.read())
    done = [float(t) for t in re.findall(r'worker 0: step \d+ done at ([0-9.]+)', output)]
    return min(t for t in done if t > killed) - killed


def one(nranks, elastic, step_seconds, store=False):
    folder = tempfile.mkdtemp(prefix='elastic_timing_')
    mode = ['--elastic'] if elastic else ['--backoff', '0', '--state-dir',
                                          os.path.join(folder, 'state')]
    argv = [sys.executable, '-m', 'mpi_kvstore', 'run', '-n', str(nranks)] + mode + [
        '--', sys.executable, STORE_SCRIPT if store else SCRIPT, os.path.join(folder, 'w'),
        '--steps', '40',
        '--commit-every', '5', '--kill-id', '1', '--kill-at', '22',
        '--step-seconds', str(step_seconds)]
    done = subprocess.run(argv, env=ENV, capture_output=True, text=True, timeout=300,
                          cwd=REPO)
    output = done.stdout + done.stderr
    if done.returncode != 0:
        raise SystemExit(output[-3000:])
    return recovery(output, folder)


def main():
    argv = [a for a in sys.argv[1:] if a != '--store']
    store = '--store' in sys.argv[1:]
    nranks, runs = int(argv[0]), int(argv[1])
    step_seconds = float(argv[2]) if len(argv) > 2 else 0.05
    memory, relaunch = [], []
    for run in range(runs):
        memory.append(one(nranks, True, step_seconds, store))
        relaunch.append(one(nranks, False, step_seconds, store))
        print('run %d: in memory %.3f s, relaunch %.3f s' % (run + 1, memory[-1],
                                                             relaunch[-1]), flush=True)
    print('%s, %d ranks, %d runs: in memory median %.3f s (%.3f-%.3f), relaunch median %.2f s '
          '(%.2f-%.2f)' % ('the store' if store else "the world's allreduce",
                           nranks, runs, statistics.median(memory), min(memory), max(memory),
                           statistics.median(relaunch), min(relaunch), max(relaunch)))


if __name__ == '__main__':
    main()
