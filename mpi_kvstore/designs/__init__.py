"""The designs that schedule collectives, picked by name: the one list of them.

config.py validates ``design`` against :data:`REGISTRY`, and the tests take
their parameters from :data:`NAMES` and :data:`ENGINE_NAMES`.

It may import what lies below the store: ``compression``, ``faults``, ``engine``, ``comm``
and the root modules, and MXNet; never ``optim`` beside it or the store above.
"""
from ..comm.mpiabi import provided_thread_level, thread_level_name
from ..errors import ConfigError, ThreadLevelError
from .blocking import Blocking
from .chained import Chained
from .concurrent import Concurrent
from .funneled import Funneled
from .negotiated import Negotiated

__all__ = ['REGISTRY', 'NAMES', 'ENGINE_NAMES', 'NEGOTIATED_NAMES', 'get_design',
           'check_thread_level']

REGISTRY = {cls.name: cls for cls in (Funneled, Concurrent, Chained, Blocking)}
NAMES = tuple(REGISTRY)
"""The design names ``create(design=...)`` accepts (``mpi_kvstore.DESIGNS``)."""
# The designs whose collectives run inside MXNet's engine (blocking runs on the caller).
ENGINE_NAMES = tuple(name for name, cls in REGISTRY.items() if cls.in_engine)
# The designs with negotiation rounds: those that queue, cut and credit, and run autotune.
NEGOTIATED_NAMES = tuple(name for name, cls in REGISTRY.items() if issubclass(cls, Negotiated))


def get_design(name):
    try:
        return REGISTRY[name]
    except KeyError:
        raise ConfigError('unknown design %r; choose one of %s'
                          % (name, ', '.join(REGISTRY))) from None


def check_thread_level(cls):
    """Refuse a design whose MPI thread level this MPI was not initialised with."""
    provided = provided_thread_level()
    if provided < cls.thread_level:
        raise ThreadLevelError(
            'design %r needs %s but MPI provides %s; initialise MPI with a higher level '
            '(mpi4py.rc.thread_level = "multiple" before "from mpi4py import MPI"), '
            'or choose another design' % (cls.name, thread_level_name(cls.thread_level),
                                          thread_level_name(provided)))
