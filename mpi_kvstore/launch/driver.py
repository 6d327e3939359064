"""The elastic launcher: ``python -m mpi_kvstore run --elastic``, each worker its own
``mpiexec -n 1`` launch (workers.py), the hosts from a discovery script (discovery.py).

    driver = Driver(command, launcher, env, root, min_np=2, max_np=4,
                    script='./discover.sh', slots=1, timeout=600)
    status = driver.run()

Every second it runs the discovery script. A new slot (a host, or more slots on one) gets a
new worker, which joins the running world: once it says it is ready, the driver writes a
signed notice of the world's members (rendezvous.announce_hosts); the world's next commit
raises HostsUpdatedInterrupt and the world re-forms with it (mpi_kvstore.elastic.world). A
slot the script no longer lists is left out of the next notice, and its worker leaves at
the next commit. A worker that fails is announced lost (the survivors re-form in memory) and
its host blacklisted (for good, or for a ``cooldown`` that doubles with each failure). Below
``min_np`` workers the job waits up to ``timeout`` seconds for the script to bring hosts back,
then ends with a message.

Each recovery is logged with its path: in memory (the survivors' processes go on), or a
relaunch of every worker from the last commit on disk, for what memory cannot survive (the
world's root lost while the world re-formed, or no survivor left). No MPI here.
"""
import logging
import os
import shutil
import subprocess
import sys
import time

from . import discovery, processes, rendezvous, supervision
from .console import console
from .workers import Workers

__all__ = ['Driver']

log = logging.getLogger(__name__)

POLL_S = 0.02           # seconds between looks at the workers and the rendezvous
DISCOVERY_EVERY = 1.0   # seconds between runs of the discovery script (Horovod's default)
READY_WAIT = 120.0      # seconds a new worker may take to start before it is given up
REFORM_LIMIT = 90.0     # seconds the survivors of a loss may take to re-form (their deadline 30)


class Driver:
    """One elastic job: its hosts, its workers, the notices and the recoveries."""

    def __init__(self, command, launcher, env, root, np=None, min_np=1, max_np=None,
                 script=None, slots=1, timeout=600.0, max_relaunches=3, state_dir=None,
                 interval=DISCOVERY_EVERY, cooldown=None):
        if script:
            self.hosts = discovery.Hosts(lambda: discovery.run_script(script, slots), cooldown)
        else:
            fixed = [('localhost', int(np or 1))]
            self.hosts = discovery.Hosts(lambda: fixed, cooldown)
        self.command, self.launcher, self.root = list(command), list(launcher), root
        self.np, self.min_np, self.max_np = np, int(min_np), max_np
        self.timeout, self.interval = float(timeout), float(interval)
        self.max_relaunches, self.state_dir = int(max_relaunches), state_dir
        self.env = dict(env, **{rendezvous.MIN_NP_ENV: str(self.min_np),
                                rendezvous.TIMEOUT_ENV: '%g' % self.timeout})
        self.secret = rendezvous.new_secret()
        self.relaunches = 0
        self.workers = None
        self._discovery_error = None
        self.said_shared = False

    # -- the job -------------------------------------------------------------------------
    def run(self):
        """Run the job to its end; its exit status."""
        try:
            wanted = self._wait_for_hosts(time.monotonic() + self.timeout)
            if wanted is None:
                return 1
            self._launch(wanted)
            while True:
                status = self._step()
                if status is not None:
                    return status
                time.sleep(POLL_S)
        except KeyboardInterrupt:
            console.info('mpi_kvstore run: interrupted; stopped every worker')
            return 130
        finally:
            if self.workers is not None:
                self.workers.stop()
            for proc in getattr(self, 'standins', {}).values():
                processes.stop_group(proc, 1.0)

    def _discover(self):
        try:
            return self.hosts.update()
        except (RuntimeError, ValueError, OSError) as err:
            if str(err) != self._discovery_error:   # once, not every second
                log.warning('mpi_kvstore elastic: %s; keeping the hosts found before', err)
            self._discovery_error = str(err)
            return False

    def _wait_for_hosts(self, ends):
        """The first slots, once there are at least --min-np; None after the timeout."""
        while True:
            self._discover()
            wanted = self.hosts.wanted(set(), self.max_np)
            if len(wanted) >= self.min_np:
                return wanted[:self.np] if self.np else wanted
            if time.monotonic() > ends:
                console.info('mpi_kvstore run: elastic: %d slot(s) found, fewer than --min-np '
                             '%d, for %g s (--elastic-timeout): ending the job', len(wanted),
                             self.min_np, self.timeout)
                return None
            time.sleep(self.interval)

    def _launch(self, wanted):
        """Start the first world (or, after a relaunch, a new one) on the slots ``wanted``."""
        directory = os.path.join(self.root, '.elastic', 'launch-%d' % self.relaunches)
        shutil.rmtree(directory, ignore_errors=True)
        env = dict(self.env, **{supervision.LAUNCH_ENV: str(self.relaunches)})
        self.workers = Workers(self.command, len(wanted), directory, secret=self.secret,
                               env=env, launcher=self.launcher)
        self.slot_of = {}          # worker -> (host, index)
        self.members = set()       # the workers meant to be in the world
        self.pending = {}          # newcomer -> (started at, discovery time of its slot)
        self.ready = {}            # newcomer ready to join -> discovery time of its slot
        self.removed = set()
        self.notice = 0
        self.formed = (-1, [])
        self.joined = {}           # newcomer -> (discovered at, joined at)
        self.standins = {}
        self.below_since = None
        self.finished = 0
        # the root of the re-forming under way (the first world's, or after a loss the
        # oldest survivor's), and since when: its death leaves the others waiting on it
        self.reform_root, self.reform_since, self.relaunch_why = 0, time.monotonic(), None
        self.reform_limit = max(self.timeout, REFORM_LIMIT)   # the first world: every start
        self.next_discovery = time.monotonic() + self.interval
        for worker, slot in enumerate(wanted):
            self.slot_of[worker] = slot
            self.members.add(worker)
            self._start(worker, slot[0])
        self.next_id = len(wanted)
        console.info('mpi_kvstore run: elastic: %d worker(s), each its own launch, on %s: %s',
                     len(wanted), _where(wanted), ' '.join(self.command))

    def _start(self, worker, host, join=False):
        if not self.state_dir and not discovery.is_local(host) and not self.said_shared:
            self.said_shared = True   # the workers meet through files: say where, once
            console.info('mpi_kvstore run: workers on other hosts (%s) meet through the files '
                         'of %s: it must be on a filesystem every host shares (else give '
                         '--state-dir on one)', host, self.workers.directory)
        self.workers.start_one(worker, host, join=join)

    def _step(self):
        """One look at everything; the job's status once it ended, else None."""
        self._read_formed()   # first: a root that formed its world and then died is no reason
        changed = self._reap()
        now = time.monotonic()
        if self.relaunch_why is None and self.reform_root is not None \
                and now - self.reform_since > self.reform_limit:
            self.relaunch_why = 'the world did not form in %g s' % self.reform_limit
        if self.relaunch_why is not None:
            return self._relaunch(self.relaunch_why)
        if now >= self.next_discovery:
            self.next_discovery = now + self.interval
            # once a worker finished its training the job is ending: no new worker then
            if (self._discover() or changed or not self._full()) and not self.finished:
                changed |= self._place(time.time())
        changed |= self._check_ready()
        if changed:
            self._announce()
        relaunch = self._stand_in()
        if relaunch:
            return self._relaunch(relaunch)
        if not self.members and (self.finished or not self.ready):
            return self._end()   # a newcomer not yet in the world has nothing left to join
        return self._check_min_np(now)

    # -- workers that end -------------------------------------------------------------------
    def _reap(self):
        changed = False
        for worker, status in self.workers.poll():
            host = self.slot_of[worker][0]
            was_member = worker in self.members or worker in self.ready
            self.members.discard(worker)
            self.ready.pop(worker, None)
            self.pending.pop(worker, None)
            if status == 0:
                self.finished += worker not in self.removed
                if worker in self.removed:
                    console.info('mpi_kvstore run: worker %d on %s left the job (its slot is '
                                 'no longer listed)', worker, host)
                continue
            if worker in self.removed:
                continue
            self.hosts.blacklist(host)   # no notice for a loss: the survivors hear of it
            self._reforming(worker)
            if self.relaunch_why is not None:
                console.info('mpi_kvstore run: worker %d on %s was lost (status %d); host %s '
                             'blacklisted', worker, host, status, host)
            elif was_member and self.members:
                console.info('mpi_kvstore run: worker %d on %s was lost (status %d); host %s '
                             'blacklisted; recovery in memory: %d survivor(s) re-form the '
                             'world', worker, host, status, host, len(self.members))
            else:
                console.info('mpi_kvstore run: worker %d on %s was lost (status %d) before '
                             'it joined; host %s blacklisted', worker, host, status, host)
        return changed

    def _reforming(self, worker):
        """After the loss of ``worker``: the survivors re-form, the oldest as the root; the
        loss of the root of a re-forming under way cannot be recovered in memory."""
        if worker == self.reform_root:
            if self.members:
                self.relaunch_why = ('worker %d, the root of the world being formed, was lost'
                                     % worker)
            return
        if worker in self.formed[1]:
            alive = [w for w in self.formed[1] if self.workers.running(w)]
            if alive:
                self.reform_root, self.reform_since = alive[0], time.monotonic()
                self.reform_limit = REFORM_LIMIT

    def _alive(self):
        return self.members | set(self.ready) | set(self.pending)

    def _full(self):
        return self.max_np is not None and len(self._alive()) >= self.max_np

    # -- hosts that come and go ---------------------------------------------------------------
    def _place(self, discovered_at):
        """Leave out the workers of slots no longer listed; start workers on new slots."""
        held = {self.slot_of[w]: w for w in self._alive()}
        wanted = self.hosts.wanted(set(held), self.max_np)
        changed = False
        for slot, worker in sorted(held.items(), key=lambda item: item[1]):
            if slot in wanted:
                continue
            self.removed.add(worker)
            changed = True
            if worker in self.pending:
                self.pending.pop(worker)
                self.workers.stop(only={worker})
            else:
                self.members.discard(worker)
                self.ready.pop(worker, None)
            console.info('mpi_kvstore run: %s slot %d is no longer listed: worker %d leaves '
                         'at the next commit', slot[0], slot[1], worker)
        for slot in wanted:
            if slot in held or self._full():
                continue
            worker, self.next_id = self.next_id, self.next_id + 1
            self.slot_of[worker] = slot
            self.pending[worker] = (time.monotonic(), discovered_at)
            self._start(worker, slot[0], join=True)
            console.info('mpi_kvstore run: %s slot %d found: worker %d starts and joins at '
                         'the next commit%s', slot[0], slot[1], worker,
                         ' (the host is back after its blacklist cooldown)'
                         if self.hosts.failures.get(slot[0]) else '')
        return changed

    def _check_ready(self):
        changed = False
        for worker, (started, discovered_at) in list(self.pending.items()):
            if rendezvous.read_signed(rendezvous.ready_path(self.workers.directory, worker),
                                      self.secret):
                self.pending.pop(worker)
                self.ready[worker] = discovered_at
                changed = True
                console.info('mpi_kvstore run: worker %d is ready to join, %.2f s after it '
                             'started', worker, time.monotonic() - started)
            elif time.monotonic() - started > READY_WAIT:
                console.info('mpi_kvstore run: worker %d did not start in %g s: stopped',
                             worker, READY_WAIT)
                self.pending.pop(worker)
                self.removed.add(worker)
                self.workers.stop(only={worker})
        return changed

    def _announce(self):
        self.notice += 1
        members = sorted(self.members | set(self.ready))
        rendezvous.announce_hosts(self.workers.directory, self.secret, self.notice, members,
                                  not self.ready, time.time())
        log.info('mpi_kvstore elastic: notice %d: members %s', self.notice, members)

    def _read_formed(self):
        found = rendezvous.read_signed(rendezvous.formed_path(self.workers.directory),
                                       self.secret)
        if not found or found.get('generation', -1) <= self.formed[0]:
            return
        ids = [int(word) for word in str(found.get('ids', '')).split(',') if word]
        self.formed = (found['generation'], ids)
        self.reform_root = None
        for worker in ids:
            if worker in self.ready:
                discovered_at = self.ready.pop(worker)
                self.members.add(worker)
                self.joined[worker] = (discovered_at, float(found.get('time', 0)))
                console.info('mpi_kvstore run: worker %d on %s joined: world %d of %d '
                             'worker(s), %.2f s after its host was found', worker,
                             self.slot_of[worker][0], found['generation'], len(ids),
                             float(found.get('time', 0)) - discovered_at)

    # -- a worker lost while the world re-forms ----------------------------------------------
    def _stand_in(self):
        """A stand-in for a worker that died while the root waited for it (the root's
        accept has no deadline); the reason for a relaunch when the root itself died."""
        found = rendezvous.read_signed(rendezvous.current_port_path(self.workers.directory),
                                       self.secret)
        if not found or found.get('generation', -1) <= self.formed[0]:
            return None
        generation, admit, root = found['generation'], found['admit'], found['root']
        if self.reform_root is None:   # a re-forming for a host update: it too has a limit
            self.reform_root, self.reform_since = root, time.monotonic()
            self.reform_limit = REFORM_LIMIT
        if self.workers.statuses.get(root, 0) != 0:
            if not self.members:
                return None
            return 'worker %d, the root of the world being re-formed, was lost' % root
        if (generation, admit) in self.standins:
            return None
        if self.workers.statuses.get(admit, 0) != 0:
            console.info('mpi_kvstore run: worker %d died while the world re-formed and worker '
                         '%d waited for it: a stand-in connects in its place, and the world '
                         'forms without it (recovery in memory)', admit, root)
        elif rendezvous.read_signed(rendezvous.gave_up_path(self.workers.directory, generation,
                                                            admit), self.secret):
            # its connect ended, the root's accept did not: MPI's accept has no deadline
            console.info('mpi_kvstore run: worker %d gave up joining the world of generation '
                         '%d: a stand-in completes worker %d\'s accept, and the world forms '
                         'again', admit, generation, root)
        else:
            return None
        script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              'elastic', 'standin.py')
        env = dict(self.env, **{rendezvous.SECRET_ENV: self.secret})
        # its connect ends with the re-forming's limit, past which the driver relaunches
        self.standins[(generation, admit)] = processes.start_group(
            self.launcher + ['-n', '1', sys.executable, script, self.workers.directory,
                             str(generation), str(admit), '%g' % self.reform_limit],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        return None

    def _relaunch(self, why):
        """Every worker stopped and started again on the hosts now listed: they go on from
        the last commit on disk (--state-dir), or from the start without one."""
        if self.relaunches >= self.max_relaunches:
            console.info('mpi_kvstore run: %s; giving up after %d relaunch(es) '
                         '(--max-restarts %d)', why, self.relaunches, self.max_relaunches)
            return 1
        self.workers.stop()
        self.relaunches += 1
        self._discover()
        held = {self.slot_of[w] for w in self._alive()}
        wanted = self.hosts.wanted(held, self.max_np)
        where = ('from the last commit in %s' % self.state_dir if self.state_dir
                 else 'from the start (no --state-dir)')
        console.info('mpi_kvstore run: %s; recovery by relaunch from disk: every worker '
                     'starts again %s (relaunch %d)', why, where, self.relaunches)
        if len(wanted) < self.min_np:
            console.info('mpi_kvstore run: %d slot(s) left, fewer than --min-np %d: ending '
                         'the job', len(wanted), self.min_np)
            return 1
        self._launch(wanted)
        return None

    # -- the end ----------------------------------------------------------------------------
    def _check_min_np(self, now):
        alive = len(self.members) + len(self.ready)
        if alive >= self.min_np or self.finished:   # a worker that finished: the job ends
            if self.below_since is not None:
                console.info('mpi_kvstore run: %d worker(s) again: training resumes', alive)
            self.below_since = None
            return None
        if self.below_since is None:
            self.below_since = now
            console.info('mpi_kvstore run: %d worker(s) left, fewer than --min-np %d: waiting '
                         'up to %g s (--elastic-timeout) for the host discovery to bring '
                         'hosts back', alive, self.min_np, self.timeout)
        elif now - self.below_since > self.timeout:
            console.info('mpi_kvstore run: elastic job ended: %d worker(s), fewer than '
                         '--min-np %d, and the host discovery brought no host back in %g s '
                         '(--elastic-timeout)', alive, self.min_np, self.timeout)
            return 1
        return None

    def _end(self):
        for worker in sorted(set(self.pending) | set(self.ready)):
            console.info('mpi_kvstore run: worker %d stopped: the job ended before it joined',
                         worker)
        self.workers.stop()
        statuses = self.workers.statuses
        lost = sorted(w for w, status in statuses.items() if status)
        console.info('mpi_kvstore run: elastic job ended: %d worker(s) finished, %d left, %d '
                     'lost%s', self.finished, len(self.removed),
                     len(lost), ' (%s)' % ', '.join(map(str, lost)) if lost else '')
        return 0 if self.finished else 1


def _where(slots):
    hosts = {}
    for host, _ in slots:
        hosts[host] = hosts.get(host, 0) + 1
    return ', '.join('%s:%d' % item for item in hosts.items())
