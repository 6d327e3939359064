"""Run one store scenario once per design, in turn, inside one MPI job.

    python -m mpi4py each_design.py SCENARIO DESIGN[,DESIGN...] [ARGS...]
    python -m mpi4py each_design.py --joint '[[SCENARIO, [ARGS...], [DESIGN...]], ...]'

runs ``SCENARIO DESIGN ARGS`` as its own ``__main__`` for each design, closing every store
it left open before the next one starts, so that a design never inherits another's threads
or pending operations. Starting ranks costs about 2 s of CPU each (most of it importing
MXNet), and a scenario usually takes less: one job for all designs instead of one per design
takes minutes off the suite (tests/mpi_harness.py, run_designs). With --joint, the job runs
several scenarios (with their arguments) in turn, each for its designs: the scenarios of one
test module at one size (run_joint), whose tests would otherwise start one job each.

Rank 0 marks where each run's part of the output begins and ends, after a barrier, so
that the harness can hand each test its own design's lines; a part without its end marker
failed, and the harness runs that design again in a job of its own to report it.
"""
import json
import os
import runpy
import sys

from mpi4py import MPI

from mpi_kvstore.store import shutdown

BEGIN, END = '[each_design] begin %s', '[each_design] end %s'


def runs(argv):
    """(label, script, design, args) of each run: one scenario's designs, labelled by design,
    or with --joint, JSON [[script, [args], [designs]], ...] (tests/mpi_harness.run_joint),
    labelled 'SCRIPT DESIGN ARGS'."""
    if argv[0] == '--joint':
        return [(' '.join([script, design] + list(args)), script, design, list(args))
                for script, args, designs in json.loads(argv[1]) for design in designs]
    script, designs, rest = argv[0], argv[1].split(','), argv[2:]
    return [(design, script, design, rest) for design in designs]


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    world = MPI.COMM_WORLD
    for label, script, design, rest in runs(sys.argv[1:]):
        path = os.path.join(here, script)
        world.Barrier()
        if world.Get_rank() == 0:
            print(BEGIN % label, flush=True)
        sys.argv = [path, design] + rest
        runpy.run_path(path, run_name='__main__')
        for store in list(shutdown.LIVE):
            store.close()
        world.Barrier()
        if world.Get_rank() == 0:
            print(END % label, flush=True)


if __name__ == '__main__':
    main()
