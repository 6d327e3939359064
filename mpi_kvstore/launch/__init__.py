"""Starting and supervising a job: ``python -m mpi_kvstore run``'s supervisor, what it shares
with the ranks (``supervision``: the files and variables by which they report), process
groups and the processes of a job that left its group (``processes``, which the test bed and
the test harness use too) and the console logger of the command line (``console``).

It imports neither MPI nor MXNet: the supervisor's process starts no MPI, its ranks do.
"""
