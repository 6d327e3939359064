"""How long from the discovery script listing a new host to that host's worker's first
completed step, under ``python -m mpi_kvstore run --host-discovery-script`` (docs/elastic.md).

usage: python tests/scenarios/elastic_hosts_timing.py [RUNS]

Each run starts 2 workers of elastic_hosts_train.py (127.0.0.1 and 127.0.0.2, commits every 5
steps of 0.04 s), waits for step 5, lists 127.0.0.3 in the hosts file, and reads the time of
the new worker's first step; then it stops the job (SIGTERM) and checks nothing is left. It
prints each run, then min, median and max.
"""
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, REPO)
from mpi_kvstore.launch import processes  # noqa: E402

RUN_LIMIT = 180.0


def one_run(folder):
    hosts = os.path.join(folder, 'hosts')
    with open(hosts, 'w') as fh:
        fh.write('127.0.0.1:1\n127.0.0.2:1\n')
    run_id = uuid.uuid4().hex
    env = dict(os.environ, OMP_NUM_THREADS='1', MPI_HARNESS_RUN_ID=run_id,
               PYTHONPATH=os.pathsep.join([REPO, HERE]))
    log_path = os.path.join(folder, 'log')
    argv = [sys.executable, '-m', 'mpi_kvstore', 'run', '--host-discovery-script',
            'cat %s' % hosts, '--min-np', '2', '--', sys.executable,
            os.path.join(HERE, 'elastic_hosts_train.py'), os.path.join(folder, 'w'),
            '--steps', '2000', '--step-seconds', '0.04']
    with open(log_path, 'wb') as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                start_new_session=True)
    started, listed, first, joined = time.monotonic(), None, None, None
    try:
        while first is None and time.monotonic() - started < RUN_LIMIT:
            time.sleep(0.02)
            with open(log_path, errors='replace') as fh:
                out = fh.read()
            if listed is None and 'worker 0: step 5 done' in out:
                tmp = hosts + '.tmp'
                with open(tmp, 'w') as fh:
                    fh.write('127.0.0.1:1\n127.0.0.2:1\n127.0.0.3:1\n')
                os.replace(tmp, hosts)
                listed = time.time()
            found = re.search(r'worker 2: step \d+ done at ([0-9.]+)', out)
            if found:
                first = float(found.group(1))
                joined = re.search(r'worker 2 on \S+ joined: .*, ([0-9.]+) s after', out)
    finally:
        processes.signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            processes.signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
        left = processes.kill_marked('MPI_HARNESS_RUN_ID', run_id, 5.0)
    if first is None:
        raise SystemExit('no step of the new worker within %g s; see %s' % (RUN_LIMIT, log_path))
    return first - listed, float(joined.group(1)) if joined else None, len(left)


def main():
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    took = []
    for number in range(runs):
        with tempfile.TemporaryDirectory() as folder:
            seconds, joined, left = one_run(folder)
        took.append(seconds)
        print('run %d: listed -> first step %.2f s (world formed with it %.2f s after the '
              'discovery saw it); processes left: %d' % (number + 1, seconds, joined or -1,
                                                         left), flush=True)
    print('listed -> first step over %d runs: min %.2f s, median %.2f s, max %.2f s'
          % (runs, min(took), statistics.median(took), max(took)))


if __name__ == '__main__':
    main()
