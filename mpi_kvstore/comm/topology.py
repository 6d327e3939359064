"""Defaults that depend on where the job runs, decided when a store is created.

``partition_bytes``, ``credit_bytes`` and ``progress_sleep_us`` default to 'auto'. Every rank
resolves them from facts all ranks share, so they are the same everywhere: the number of
hosts the communicator spans (one Split_type and one allreduce; on an elastic world one
bounded allgather of the hosts' names and cores, :func:`host_spread`), and the tune table,
whose content the ranks have agreed on (:func:`agree`). A value the user gave is kept.

- One host: the exchange runs over shared memory, where a negotiation round costs about as
  much as a piece; nothing is cut, everything agreed starts at once, MPI calls block,
  unless the host runs more ranks than its ranks have cores: there a rank that spins in a
  blocking call holds a core its peer needs to make progress, so waits sleep between
  polls (progress_sleep_us 200), as across hosts.
- Several hosts: the network is the bottleneck, and the order of the exchange decides how
  much of it hides behind compute. Pieces of 4 MB, 8 MB started between two rounds, and
  allreduces that sleep between polls, so the exchange leaves the cores to compute.
  docs/scheduling.md has the measurements behind these values.
- A tune table's ``schedule`` entry (python -m mpi_kvstore tune) wins over both.

``autotune`` defaults to 'auto' too: on across hosts, where the schedule decides the step
and no one setting won everywhere (docs/tuning.md), unless the tune table holds a schedule,
which a search (this job's, or ``tune``) already chose for this topology; off on one host,
where nothing is cut.
"""
import functools
import importlib.metadata
import logging
import os
import pickle

import numpy as np

from ..config import AGREED, Config, format_bytes
from ..errors import ConfigError
from . import tuning
from .consensus import Setting, check
from .mpiabi import MPI
from .progress import AGREEMENT_POLL_US, wait_polling

__all__ = ['ACROSS_HOSTS', 'ONE_HOST', 'OVERSUBSCRIBED', 'count_hosts', 'oversubscribed',
           'host_spread', 'host_facts', 'places', 'places_of', 'spread_of', 'auto_design',
           'resolve', 'design_warning', 'settings', 'agree', 'agreed_config']

log = logging.getLogger(__name__)

# The host an elastic worker runs on, as its launcher names it (launch.rendezvous.HOST_ENV,
# which launch/workers.py sets): node_comm splits an elastic world by it.
HOST_ENV = 'MPI_KVSTORE_ELASTIC_HOST'
ACROSS_HOSTS = {'partition_bytes': 4 << 20, 'credit_bytes': 8 << 20, 'progress_sleep_us': 200.0,
                'autotune': True}
ONE_HOST = {'partition_bytes': 0, 'credit_bytes': 0, 'progress_sleep_us': 0.0,
            'autotune': False}
# One host with more ranks than cores. Spinning there made a 4-rank test on 2 cores take
# 53-70 s, once over 400 s, against 19-21 s with sleeps; docs/scheduling.md has the figures.
OVERSUBSCRIBED = dict(ONE_HOST, progress_sleep_us=200.0)


def _wait_polled(request, keep=()):
    """The wait of a polled agreement: ended only by progress's abort check."""
    wait_polling(request, AGREEMENT_POLL_US)


class _Polled:
    """``comm`` whose Allreduce, Barrier and object allgather are nonblocking calls waited by
    ``wait(request, keep)``: by default polled (progress.wait_polling), so that an elastic
    world's abort check ends their waits when a peer is lost while the world re-forms and
    its stores reset; a store's build on an elastic world passes the world's own bounded wait
    (World.waiter). What consensus.check and the host count call; the rest is the
    communicator's own."""

    def __init__(self, comm, wait=None):
        self.comm = comm
        self._wait = wait or _wait_polled

    def __getattr__(self, name):
        return getattr(self.comm, name)

    def Allreduce(self, send, recv, op):
        self._wait(self.comm.Iallreduce(send, recv, op=op), (send, recv))

    def Barrier(self):
        self._wait(self.comm.Ibarrier())

    def allgather(self, obj):
        """Every rank's picklable ``obj`` in rank order (lengths, then the pickles)."""
        data = np.frombuffer(pickle.dumps(obj), np.uint8)
        mine = np.array([data.size], np.int64)
        lengths = np.empty(self.comm.Get_size(), np.int64)
        self._wait(self.comm.Iallgather(mine, lengths), (mine, lengths))
        starts = [0] + np.cumsum(lengths)[:-1].tolist()
        out = np.empty(int(lengths.sum()), np.uint8)
        self._wait(self.comm.Iallgatherv(data, (out, (lengths.tolist(), starts))), (data, out))
        return [pickle.loads(out[lo:lo + n].tobytes()) for lo, n in zip(starts, lengths)]


def node_comm(comm):
    """The ranks of ``comm`` on this host (Split_type, which MPI has in blocking form
    only: a polled barrier first, so that a peer lost before it ends the wait there).
    An elastic worker's host is the one its launcher named (:data:`HOST_ENV`): the world's
    ranks are separate launches joined by Connect/Accept, and MPICH's Split_type then puts
    ranks of different hosts in one node, which made a 2-host elastic job schedule as on
    one host (no pieces, no credit) and step 1.2x slower than the same job under mpiexec."""
    _Polled(comm).Barrier()
    host = os.environ.get(HOST_ENV)
    if host is None:
        return comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    names = sorted(set(_Polled(comm).allgather(host)))
    return comm.Split(names.index(host), key=comm.Get_rank())


def count_hosts(comm):
    """Collective: how many hosts (shared-memory domains) the ranks of ``comm`` span."""
    if comm.Get_size() == 1:
        return 1
    node = node_comm(comm)
    try:
        leader = np.array([1 if node.Get_rank() == 0 else 0], dtype=np.int32)
    finally:
        node.Free()
    _Polled(comm).Allreduce(MPI.IN_PLACE, leader, op=MPI.SUM)
    return int(leader[0])


def oversubscribed(comm):
    """Collective: whether some host runs more ranks of ``comm`` than the cores those ranks
    may run on (the union of their CPU affinities), the same answer on every rank."""
    if comm.Get_size() == 1:
        return False
    node = node_comm(comm)
    try:
        # the host's ranks, right after node_comm's polled barrier (a stand-in node in tests)
        cores = set().union(*node.allgather(sorted(_cores())))
        flag = np.array([1 if node.Get_size() > len(cores) else 0], dtype=np.int32)
    finally:
        node.Free()
    _Polled(comm).Allreduce(MPI.IN_PLACE, flag, op=MPI.MAX)
    return bool(flag[0])


def host_spread(comm, wait=None):
    """Collective, with no blocking MPI call: (how many hosts the ranks of ``comm`` span,
    whether one of them runs more of its ranks than those ranks' cores), what
    :func:`count_hosts` and :func:`oversubscribed` answer, from ONE object allgather of each
    rank's host and cores whose requests ``wait(request, keep)`` waits for. A store's build
    on an elastic world calls it with the world's wait, which ends when a worker is lost or
    the world's deadline passes: Split_type, which MPI has in blocking form only, would wait
    for a peer lost during the reset forever. A rank's host is the one its launcher named
    (:data:`HOST_ENV`), else MPI's processor name (the host's name: Split_type's
    shared-memory domain on a cluster's hosts)."""
    if comm.Get_size() == 1:
        return 1, False
    return spread_of(host_facts(comm, wait))


def host_facts(comm, wait=None):
    """Collective, with no blocking MPI call: every rank's (host, sorted cores), in rank
    order, from one object allgather whose requests ``wait(request, keep)`` waits for (what
    :func:`host_spread` and :func:`places` read). A ``wait`` that carries a ``memo`` (an
    elastic world's, World.waiter: ``get(comm)``, ``put(comm, facts)``) gathers them once a
    communicator: an init or a reset builds its stores and places hvd's ranks from one
    allgather. Every rank of ``comm`` asks alike, so all of them gather or none does."""
    memo = getattr(wait, 'memo', None)
    known = None if memo is None else memo.get(comm)
    if known is not None:
        return known
    host = os.environ.get(HOST_ENV) or MPI.Get_processor_name()
    facts = _Polled(comm, wait).allgather((host, sorted(_cores())))
    if memo is not None:
        memo.put(comm, facts)
    return facts


def places(comm, wait=None):
    """Collective, with no blocking MPI call: (local rank, local size, cross rank, cross
    size) of this rank of ``comm``, what :func:`node_comm` and a Split by the local rank
    give, from :func:`host_facts`' one allgather (hvd.init and its reset on an elastic
    world, where a Split would wait for a lost peer forever)."""
    if comm.Get_size() == 1:
        return 0, 1, 0, 1
    return places_of([host for host, _ in host_facts(comm, wait)], comm.Get_rank())


def places_of(hosts, me):
    """(local rank, local size, cross rank, cross size) of rank ``me`` given every rank's
    host: the local rank is the index among the ranks of its host, in rank order (node_comm's
    key), the cross rank the index among the ranks of the same local rank (Split's key)."""
    seen, local = {}, []
    for host in hosts:
        local.append(seen.get(host, 0))
        seen[host] = local[-1] + 1
    cross = [rank for rank, mine in enumerate(local) if mine == local[me]]
    return local[me], seen[hosts[me]], cross.index(me), len(cross)


def spread_of(facts):
    """(hosts, oversubscribed) of every rank's (host, cores): ranks on a host outnumber the
    union of their cores (as :func:`oversubscribed`)."""
    cores, ranks = {}, {}
    for host, mine in facts:
        cores.setdefault(host, set()).update(mine)
        ranks[host] = ranks.get(host, 0) + 1
    return len(cores), any(ranks[host] > len(found) for host, found in cores.items())


def _cores():
    try:
        return os.sched_getaffinity(0)
    except AttributeError:   # no affinity on this platform: every core of the machine
        return set(range(os.cpu_count() or 1))


def design_warning(design, hosts):
    """What to tell a user whose ``design`` runs across ``hosts``, or None.

    chained runs each call's collectives in push order, in one compiled op per call: no
    negotiation round, so nothing lets a high-priority piece overtake (docs/designs.md,
    chained). Where the network is the bottleneck, that order costs."""
    if design != 'chained' or hosts < 2:
        return None
    return ('mpi_kvstore: design=chained across %d hosts runs collectives in push order, '
            'without priority pieces; design=funneled (what auto picks) schedules them by '
            'priority, which pays where the network is the bottleneck (docs/designs.md)'
            % hosts)


def auto_design(hosts, config, elastic=False):
    """The design ``design='auto'`` runs. On one host, chained: its compiled op calls MPI
    from the engine worker, with no negotiation thread to wake, so a lone call and a burst
    take half of funneled's time, and per-key training on one machine stepped fastest with
    it (docs/benchmarks.md). funneled where chained cannot do the job: across hosts (its
    priority pieces, docs/scheduling.md), on an elastic world (every wait polled) and with
    autotune on (a search between negotiation rounds)."""
    if hosts > 1 or elastic or config.autotune is True:
        return 'funneled'
    return 'chained'


def resolve(config, comm, table=None, warn=True, elastic=False, wait=None):
    """Collective: ``config`` with every 'auto' of :data:`ACROSS_HOSTS` and the design
    decided (:func:`auto_design`; ``elastic``: the store is on an elastic world), and a line
    that says what was chosen and why (None when nothing was 'auto'). Ranks that were given
    the same options (:func:`agree`) decide the same values: every fact used is agreed.
    Rank 0 logs :func:`design_warning` where it applies (unless ``warn`` is false: doctor
    shows it in its report). ``wait``: given (a store's build on an elastic world), the
    hosts come from :func:`host_spread` waited so, with no blocking MPI call; otherwise from
    :func:`count_hosts` and, on one host only, :func:`oversubscribed`, as before."""
    if wait is None:
        hosts = count_hosts(comm)
        crowded = functools.partial(oversubscribed, comm)   # asked on one host only
    else:
        hosts, over = host_spread(comm, wait)
        crowded = functools.partial(bool, over)
    warning = design_warning(config.design, hosts) if warn else None
    if warning and comm.Get_rank() == 0:
        log.warning(warning)
    source = '%d host%s' % (hosts, '' if hosts == 1 else 's')
    if hosts > 1:
        chosen = dict(ACROSS_HOSTS)
    elif crowded():
        chosen = dict(OVERSUBSCRIBED)
        source += ', more ranks than cores'
    else:
        chosen = dict(ONE_HOST)
    tuned = getattr(table, 'schedule', None) or {}
    if tuned:
        chosen.update(tuned, autotune=False)   # already searched for this topology
        source += ', tune table'
    auto = {name: value for name, value in chosen.items() if getattr(config, name) == 'auto'}
    if config.design == 'auto':
        auto['design'] = auto_design(hosts, config.replace(**auto), elastic)
        if elastic:
            source += ', elastic'
    if not auto:
        return config, None
    resolved = config.replace(origin='auto: %s' % source, **auto)
    why = 'mpi_kvstore: %s: %s' % (source, ', '.join(
        '%s=%s' % (name, _show(value)) for name, value in sorted(auto.items())))
    return resolved, why


# Options that only one design reads: ranks of another design may be given anything.
_DESIGN_ONLY = {'lanes': ('concurrent',), 'inline_max_bytes': ('chained',)}


def settings(config, version='', problem=None):
    """What every rank of a store must be given alike (consensus.check): the package's
    ``version``, then, when this rank's options are valid (``problem`` is None, else the
    ConfigError they raised), every option of config.AGREED as given, before 'auto' is
    decided (so 'auto' and an explicit value are different). Of the tune table, whether one is
    given: tuning.load, a collective only then, compares the content."""
    out = [Setting('version', version, version or 'unknown', 'installed package')]
    if problem is not None:
        return out + [Setting('options', 'invalid', 'invalid (%s)' % problem, '')]
    out.append(Setting('options', 'valid', 'valid', ''))
    for name in AGREED:
        if name == 'tune_table':   # whether one is given; its content: tuning.load
            given = config.tune_table
            out.append(Setting(name, 'given' if given else 'none', repr(given) if given else
                               'none', config.origin(name)))
            continue
        value = getattr(config, name)
        unused = name in _DESIGN_ONLY and config.design not in _DESIGN_ONLY[name]
        key = 'unused by this design' if unused else repr(value)
        out.append(Setting(name, key, _shown_option(name, value), config.origin(name)))
    return out


def agree(comm, config, version='', problem=None, what='a store'):
    """Collective: raise ConfigError on every rank alike unless every rank of ``comm`` was
    given the same agreed options and version (see :func:`settings`)."""
    check(comm, settings(config, version, problem), what, gates=('version', 'options'))


def _shown_option(name, value):
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, bool) or name not in _BYTES:
        return '%s' % (value,)
    return format_bytes(value)


_BYTES = ('fusion_threshold', 'device_fusion_threshold', 'partition_bytes', 'credit_bytes',
          'inline_max_bytes', 'progress_min_bytes')


def _show(value):
    if isinstance(value, bool):
        return 'on' if value else 'off'
    if isinstance(value, str):
        return value
    return '%g' % value if isinstance(value, float) else format_bytes(value)


def agreed_config(comm, options, wait=None):
    """Collective: (Config of ``options``, tune table) once every rank of ``comm`` was given
    the same design, schedule, compression, tune table... (:func:`agree`); else
    ConfigError on every rank alike, naming each option that differs with every rank's value
    and where it came from. An invalid option on one rank is compared too, so that the
    others raise with it instead of waiting for it in the store's first collective.
    ``wait(request, keep)``: how the agreement's requests are waited for (default: polled,
    progress's abort check ends them); an elastic world's bounds them. Its stores have no
    tune table (kvstore.elastic_options), whose load would be a blocking bcast."""
    try:
        config, problem = Config(**options), None
    except ConfigError as err:
        config, problem = None, err
    agree(_Polled(comm, wait), config, _version(), problem)
    if problem is not None:
        # Raised here, not deep in config.py, so the traceback ends at the user's call.
        raise problem.with_traceback(None)
    return config, tuning.load(config.tune_table, comm, config.origin('tune_table'))


def _version():
    try:
        return importlib.metadata.version('mpi_kvstore')
    except importlib.metadata.PackageNotFoundError:   # a source tree on sys.path
        return 'source tree'
