"""Transports for device buffers, one file each, and how the ranks choose one.

Host buffers always go through the host communicator (comm.Comm: MPI, with its
algorithms and the tune table). A device (CuPy) buffer goes through the transport that
the option ``gpu_transport`` names, or under 'auto' the first of :data:`AUTO_ORDER`
that every rank can use. The choice is collective and agreed: it is made once, at the
first device collective, which every rank reaches at the same point of the sequence
(a collective's place is part of its agreed signature).

Nothing here imports MXNet, so the transports run on CuPy arrays alone.
"""
import numpy as np

from ...errors import ConfigError
from . import cuda_mpi, nccl, staged
from .base import REGISTRY, Transport, register

BUILT_IN = (nccl.NCCL, cuda_mpi.CudaMPI, staged.Staged)   # each registered itself

__all__ = ['REGISTRY', 'BUILT_IN', 'Transport', 'register', 'MODES', 'AUTO_ORDER', 'agreed',
           'choose', 'decide',
           'devices_shared']

# NCCL first: its kernels reduce on the device at device bandwidth. A CUDA-aware MPI next
# (no host copies). Staging through pinned host memory always works.
AUTO_ORDER = ('nccl', 'cuda_mpi', 'staged')
MODES = ('auto',) + tuple(REGISTRY)


def devices_shared(comm, device):
    """Collective: whether two ranks of one host use one GPU (NCCL refuses that)."""
    import socket  # optional dependency, loaded where used

    import cupy  # optional dependency, loaded where used
    uuid = _uuid(cupy, device)
    seen = comm.mpi.allgather((socket.gethostname(), uuid))
    return len(set(seen)) < len(seen)


def _uuid(cupy, device):
    props = cupy.cuda.runtime.getDeviceProperties(device)
    uuid = props.get('uuid')
    return bytes(uuid).hex() if uuid is not None else props.get('pciBusID', device)


def decide(mode, usable, shared, concurrent):
    """The transport, from the option ``mode``, what every rank can use (``usable``:
    name -> (ok on every rank, why not)), whether ranks share a GPU and whether the
    design runs communicators at once. Pure: every rank that passes the same gets the
    same. Raises ConfigError for a named transport that cannot run."""
    def why_not(name):
        ok, why = usable[name]
        if not ok:
            return why
        if name == 'nccl' and shared:
            return ('two ranks of one host use one GPU, which NCCL refuses ("Duplicate GPU '
                    'detected"; NCCL >= 2.30 may allow it with NCCL_MULTI_RANK_GPU_ENABLE=1)')
        if concurrent and not REGISTRY[name].concurrent_safe:
            return ('the concurrent design runs its lanes at once, and %s needs one launch '
                    'order for every communicator of a device' % name)
        return None
    if mode != 'auto':
        why = why_not(mode)
        if why is not None:
            raise ConfigError('gpu_transport=%s cannot run: %s' % (mode, why))
        return mode
    for name in AUTO_ORDER:
        if why_not(name) is None:
            return name
    raise ConfigError('no GPU transport can run here')   # staged always can


def agreed(comm, device):
    """Collective: (usable, shared), :func:`decide`'s agreed inputs. Each rank says which
    transports it can use, and MIN over the ranks keeps the ones all can (the reason is this
    rank's, or 'another rank cannot'); ``shared``: two ranks of a host use one GPU."""
    names = list(REGISTRY)
    mine = [REGISTRY[name].usable(comm) for name in names]
    flags = np.array([ok for ok, _ in mine], dtype=np.int32)
    if comm.size > 1:
        comm.check_min(flags)
    usable = {name: (bool(flags[i]), mine[i][1] or 'another rank cannot use it')
              for i, name in enumerate(names)}
    return usable, devices_shared(comm, device) if comm.size > 1 else False


def choose(comm, mode, device, concurrent=False):
    """Collective: the transport every rank uses for device buffers (see :func:`decide`)."""
    return decide(mode, *agreed(comm, device), concurrent)
