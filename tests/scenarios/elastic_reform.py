"""elastic_world.py with a worker that dies while the world re-forms
(tests/test_elastic_reform.py).

usage: elastic_reform.py --die-id J --die-step STEP OUT [elastic_world.py's options]

Worker J SIGKILLs itself when it reaches STEP of a re-forming (World._reached: 'joined'
once it is in the forming world, 'admitted' once every member is, 'duplicated' once the new
communicator exists), in generation 1 or later: the survivors' re-forming loses a worker
itself, and must re-form again without it.
"""
import argparse
import os
import runpy
import signal
import sys

from mpi_kvstore.elastic.world import World

WORLD_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'elastic_world.py')

parser = argparse.ArgumentParser()
parser.add_argument('--die-id', type=int, required=True)
parser.add_argument('--die-step', required=True, choices=('joined', 'admitted', 'duplicated'))
args, rest = parser.parse_known_args()


def reached(world, step):
    if world.id == args.die_id and step == args.die_step and world.generation >= 1:
        print('worker %d: dies at %s of generation %d' % (world.id, step, world.generation),
              flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


World._reached = reached
sys.argv = [WORLD_SCRIPT] + rest
runpy.run_path(WORLD_SCRIPT, run_name='__main__')
