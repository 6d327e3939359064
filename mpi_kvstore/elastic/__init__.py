"""Committed state that survives a lost rank, and Horovod's elastic pattern on our own API.

    state = elastic.State(net.collect_params(), trainer, step=0)   # restores the last commit
    for step in range(state.step, steps):
        ...train one step, with data chosen by `step`...
        state.step = step + 1
        if state.step % 5 == 0:
            state.commit()

A commit copies the parameters, the optimizer states, the extra values and the random states
in memory (``restore()`` goes back to it, as in Horovod) and writes them to disk as one
renamed directory, ``commit-<n>``, when a directory is set (the supervisor's
``--state-dir``). Under ``python -m mpi_kvstore run`` a lost rank makes the supervisor
relaunch the job, which goes on from the last commit on disk. ``run_fn``, ``BaseState`` and
``ObjectState`` are Horovod's elastic pattern; mpi_kvstore.horovod.elastic builds
``hvd.elastic`` on them. ``world.World`` is a world of separately launched workers
(launch/workers.py) that survives a SIGKILLed member: its collectives end with
HorovodInternalError when the launcher announces the loss, and ``reform()`` re-forms it from
the survivors in memory.

The sub-package's modules, top to bottom (.importlinter's ``elastic`` contract): state (the
State) over base (Horovod's state and run loop), fit (Module.fit that commits), snapshot
(what a commit copies) and world (the re-formable world) over disk (commit directories)
and exceptions. It may import the layers below its own (the store, comm, launch's
supervision and rendezvous) and MXNet; never the horovod package, gluon, functional or the
CLI, which sit beside or above it.
"""
from .base import BaseState, ObjectState, notify_hosts_updated, run_fn
from .disk import latest_commit
from .exceptions import HorovodInternalError, HostsUpdatedInterrupt
from .state import DEFAULT_DIRECTORY, State

__all__ = ['State', 'BaseState', 'ObjectState', 'run_fn', 'notify_hosts_updated',
           'latest_commit', 'HorovodInternalError', 'HostsUpdatedInterrupt',
           'DEFAULT_DIRECTORY']
