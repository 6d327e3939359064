"""How long the negotiation thread's wait for a round's agreement spins (MPI_Test in a row,
progress.wait_polling's spin_us) before its polls sleep."""
import os

from ..config import launcher_local_rank

__all__ = ['AGREEMENT_SPIN_US', 'CORES_PER_RANK', 'SPIN_FLOOR_US', 'SPIN_LOAD_S', 'SPIN_PRESSURE',
           'Spin', 'spin_of']

# How long a round's agreement waits for the other ranks by MPI_Test in a row before its polls
# sleep, at most, where the store busy-polls anyway (progress_sleep_us 0: one host, no more
# ranks than cores, whose data allreduces block in MPI). A sleeping poll ends late by its sleep
# and a wake-up, and each of a collective's steps waits for one on some rank: a lone 4 KB call
# spent most of its time there. Bounded, so that a rank whose peers come late (compute, a
# step's first gradient) soon leaves its core; idle, the thread blocks on the waker, as ever.
AGREEMENT_SPIN_US = 200.0
# The spin adapts (Spin): a wait that outlasted it halves it, to 0 below SPIN_FLOOR_US, and a
# wait that ended within it (or within SPIN_FLOOR_US) doubles it back; at 0, it tries
# SPIN_FLOOR_US again every SPIN_LOAD_S. And it stops while the machine has no core to spare,
# looked at every SPIN_LOAD_S: Linux's CPU pressure (some task waited for a core more than
# SPIN_PRESSURE percent of the last 10 s; 99 while other jobs shared the test VM's cores),
# or where that is not kept, the 1-minute load average at or above the cores this process
# may use plus one (the job's own ranks). There a spinning rank takes the CPU that its peer
# needs in order to arrive (the kernel shares the cores between jobs first), and a lone 4 KB
# call took 2-10x longer with the spin than without.
# And only where each of the host's ranks has a core besides the one its compute runs on:
# the wait runs while that rank's backward still computes the step's other gradients, so a
# spin on a host with fewer than two cores a rank takes the core that compute needs
# (2 ranks on 2 cores: the negotiation threads took up to 1 ms more CPU a Trainer step of
# 200 small parameters with the spin than without).
CORES_PER_RANK = 2
SPIN_FLOOR_US = 25.0
SPIN_LOAD_S = 1.0
SPIN_PRESSURE = 50.0
_PRESSURE = '/proc/pressure/cpu'


def spin_of(config, size, cores=None, local=None):
    """The agreement's spin in microseconds for ``config`` over ``size`` ranks (above):
    ``cores``, the cores this process may run on (its affinity), ``local``, the job's ranks
    on this host (the launcher's count, else ``size``: data that busy-polls is one host's)."""
    sleep = config.progress_sleep_us
    if size < 2 or not isinstance(sleep, (int, float)) or sleep:
        return 0.0
    if cores is None:
        cores = _cores()
    if local is None:
        announced = launcher_local_rank()
        local = size if announced is None else min(size, announced[1])
    if cores < CORES_PER_RANK * local:
        return 0.0
    return AGREEMENT_SPIN_US


def _cores():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:   # no affinity on this platform: every core of the machine
        return os.cpu_count() or 1


def _spare_cores(pressure=_PRESSURE):
    """Whether the machine has a core to spare (SPIN_FLOOR_US's comment)."""
    try:
        with open(pressure) as fh:
            some = fh.readline().split()     # some avg10=0.00 avg60=0.00 ...
        return float(some[1].partition('=')[2]) < SPIN_PRESSURE
    except (OSError, IndexError, ValueError):
        pass
    try:
        return os.getloadavg()[0] < len(os.sched_getaffinity(0)) + 1
    except (OSError, AttributeError):
        return True


class Spin:
    """The adaptive spin of one thread's waits (above): ``now`` microseconds, at most ``top``;
    ``spare()``: whether the machine has a core to spare."""

    __slots__ = ('top', 'now', '_spare', '_looked', '_idle')

    def __init__(self, top, spare=_spare_cores):
        self.top = self.now = float(top)
        self._spare, self._looked, self._idle = spare, -SPIN_LOAD_S, True

    def set_top(self, top):
        self.top = self.now = float(top)

    def us(self, now):
        """The spin of a wait that starts at ``now`` (time.monotonic())."""
        if now - self._looked >= SPIN_LOAD_S:
            self._looked, self._idle = now, self._spare()
            if self._idle and self.top and not self.now:
                self.now = SPIN_FLOOR_US    # try again: the peers may come sooner now
        return self.now if self._idle else 0.0

    def waited(self, seconds):
        """A wait that spun ``now`` took ``seconds``: the next one spins more or less."""
        if not self.top or not self._idle:
            return
        took = seconds * 1e6
        if took <= max(self.now, SPIN_FLOOR_US):
            self.now = min(self.top, max(2 * self.now, SPIN_FLOOR_US))
        else:
            self.now = self.now / 2 if self.now >= 2 * SPIN_FLOOR_US else 0.0
