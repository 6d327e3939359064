"""How long a relaunch takes under the supervisor (issue 24): from a rank's death to the
relaunched job's restored state, with ``--backoff 0``.

    python -m benchmarks.relaunch_time [--runs 3] [-n 2]

Each run starts ``python -m mpi_kvstore run`` on tests/scenarios/elastic_train.py, whose
rank 1 SIGKILLs itself after step 7 (commits every 5 steps), and stamps the output lines:
hydra's report of the killed rank, the supervisor's relaunch, the relaunched job's restored
state, the end. Prints each run's stamps and the min / median / max of kill-to-restored.
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, 'tests', 'scenarios', 'elastic_train.py')
MARKS = (('BAD TERMINATION', 'rank killed (hydra reports it)'),
         ('launch 2 (', 'relaunch starts'),
         ('launch 1: starting at step', 'relaunched job restored its state'),
         ('finished', 'finished'))


def one_run(nprocs, timeout):
    folder = tempfile.mkdtemp(prefix='relaunch_time_')
    argv = [sys.executable, '-m', 'mpi_kvstore', 'run', '-n', str(nprocs), '--backoff', '0',
            '--state-dir', folder, '--', sys.executable, SCRIPT,
            os.path.join(folder, 'out.npz'), '--kill-at', '7']
    start = time.monotonic()
    stamps = {}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS='1'))
    try:
        for line in proc.stdout:
            for needle, name in MARKS:
                if needle in line and name not in stamps:
                    stamps[name] = time.monotonic() - start
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
        shutil.rmtree(folder, ignore_errors=True)
    missing = [name for _, name in MARKS if name not in stamps]
    if proc.returncode != 0 or missing:
        raise SystemExit('run failed (status %s), never saw: %s' % (proc.returncode, missing))
    return stamps


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--runs', type=int, default=3)
    parser.add_argument('-n', type=int, default=2)
    parser.add_argument('--timeout', type=float, default=300)
    args = parser.parse_args()
    took = []
    for run in range(args.runs):
        stamps = one_run(args.n, args.timeout)
        for _, name in MARKS:
            print('run %d: %7.2f s  %s' % (run + 1, stamps[name], name))
        took.append(stamps['relaunched job restored its state']
                    - stamps['rank killed (hydra reports it)'])
    print('kill to restored state, %d ranks, %d runs (%s): min %.2f s, median %.2f s, '
          'max %.2f s' % (args.n, args.runs, time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()),
                          min(took), statistics.median(took), max(took)))


if __name__ == '__main__':
    main()
