"""Run one store scenario once per design, in turn, inside one MPI job.

    python -m mpi4py each_design.py SCENARIO DESIGN[,DESIGN...] [ARGS...]

runs ``SCENARIO DESIGN ARGS`` as its own ``__main__`` for each design, closing every store
it left open before the next one starts, so that a design never inherits another's threads
or pending operations. Starting ranks costs about 2 s of CPU each (most of it importing
MXNet), and a scenario usually takes less: one job for all designs instead of one per design
takes minutes off the suite (tests/mpi_harness.py, run_designs).

Rank 0 marks where each design's part of the output begins and ends, after a barrier, so
that the harness can hand each test its own design's lines; a part without its end marker
failed, and the harness runs that design again in a job of its own to report it.
"""
import os
import runpy
import sys

from mpi4py import MPI

from mpi_kvstore.store import shutdown

BEGIN, END = '[each_design] begin %s', '[each_design] end %s'


def main():
    script, designs, rest = sys.argv[1], sys.argv[2].split(','), sys.argv[3:]
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), script)
    world = MPI.COMM_WORLD
    for design in designs:
        world.Barrier()
        if world.Get_rank() == 0:
            print(BEGIN % design, flush=True)
        sys.argv = [path, design] + rest
        runpy.run_path(path, run_name='__main__')
        for store in list(shutdown.LIVE):
            store.close()
        world.Barrier()
        if world.Get_rank() == 0:
            print(END % design, flush=True)


if __name__ == '__main__':
    main()
