"""The launcher of an elastic job: one ``mpiexec -n 1`` launch a worker, so that a worker's
death does not end the others, and a signed word to the survivors when one ends.

    workers = Workers(['python', 'train.py'], 3, directory)
    workers.start()
    statuses = workers.wait(timeout=600)   # announces each lost worker as it goes

The workers meet and re-form their world themselves (mpi_kvstore.elastic.world); this side
gives them the rendezvous directory, the job's secret and their ids, watches their processes,
and announces a worker that ended with a non-zero status (rendezvous.announce_lost), which
turns the survivors' pending collectives into HorovodInternalError at once instead of at
their deadline. No MPI here.
"""
import logging
import os
import subprocess
import time

from . import discovery, processes, rendezvous

__all__ = ['Workers']

log = logging.getLogger(__name__)

POLL_S = 0.005   # seconds between looks at the workers


class Workers:
    """``count`` workers running ``argv``, each its own ``launcher -n 1`` job."""

    def __init__(self, argv, count, directory, secret=None, env=None, launcher=('mpiexec',),
                 stdout=None, stderr=None):
        self.argv, self.count, self.directory = list(argv), int(count), directory
        self.secret = secret or rendezvous.new_secret()
        self.env = dict(os.environ if env is None else env)
        self.launcher = list(launcher)
        self.stdout, self.stderr = stdout, stderr
        self.procs = {}
        self.statuses = {}
        self.lost_at = {}   # worker: time.time() when its end was announced

    def start(self, only=None):
        """Start the workers (``only``: just those ids, the others later)."""
        for worker in range(self.count) if only is None else only:
            self.start_one(worker)

    def start_one(self, worker, host=None, join=False):
        """Start worker ``worker`` (on ``host``: None or this machine's name for here);
        ``join``: it joins the running world instead of forming the first one."""
        os.makedirs(self.directory, exist_ok=True)
        env = dict(self.env, **{rendezvous.DIR_ENV: self.directory,
                                rendezvous.SECRET_ENV: self.secret,
                                rendezvous.ID_ENV: str(worker),
                                rendezvous.NP_ENV: str(self.count),
                                rendezvous.JOIN_ENV: '1' if join else '0',
                                rendezvous.GUARD_ENV: self.env.get(rendezvous.GUARD_ENV, '1')})
        local = host is None or discovery.is_local(host)
        env[rendezvous.HOST_ENV] = 'localhost' if local else host   # every local name alike
        where = [] if local else ['-hosts', host]
        self.procs[worker] = processes.start_group(
            self.launcher + where + ['-n', '1'] + self.argv, env=env, stdin=subprocess.DEVNULL,
            stdout=self.stdout, stderr=self.stderr)

    def poll(self):
        """Record the workers that ended since the last look, and announce the lost ones
        (a non-zero status); [(worker, status)] of those that ended."""
        ended = []
        for worker, proc in self.procs.items():
            if worker in self.statuses:
                continue
            status = proc.poll()
            if status is None:
                continue
            self.statuses[worker] = status
            ended.append((worker, status))
            if status != 0:
                rendezvous.announce_lost(self.directory, self.secret, worker, status)
                self.lost_at[worker] = time.time()
                log.warning('mpi_kvstore elastic: worker %d ended with status %d; the '
                            'survivors go on in memory', worker, status)
        return ended

    def running(self, worker):
        """Whether ``worker`` was started and has not ended."""
        return worker in self.procs and worker not in self.statuses

    def wait(self, timeout):
        """Watch until every worker ended or ``timeout`` seconds passed (then stop them
        all); {worker: status}, None for one that had to be stopped."""
        ends = time.monotonic() + timeout
        try:
            while len(self.statuses) < len(self.procs) and time.monotonic() < ends:
                self.poll()
                time.sleep(POLL_S)
        finally:
            self.stop()
        return {worker: self.statuses.get(worker) for worker in self.procs}

    def stop(self, grace=2.0, only=None):
        """Stop every worker still running (its whole process group); ``only``: those ids."""
        for worker, proc in self.procs.items():
            if (only is None or worker in only) and proc.poll() is None:
                processes.stop_group(proc, grace)
        if only is not None:
            return
        # hydra starts each rank in a session of its own: the job's secret marks them all
        processes.kill_marked(rendezvous.SECRET_ENV, self.secret, grace)
