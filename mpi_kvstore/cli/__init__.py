"""The command line's subcommands that start MPI: ``doctor`` (what this machine and job will
use) and ``tune`` (measure and write the tune table). ``python -m mpi_kvstore`` dispatches to
them (and to ``launch``'s supervisor for ``run``).

It may import everything below the store.
"""
