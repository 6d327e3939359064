"""A scenario of elastic_world.py or elastic_store.py with a worker that dies while the world
re-forms (tests/test_elastic_reform.py).

usage: elastic_reform.py --die-id J --die-step STEP [--script S] OUT [S's options]

Worker J SIGKILLs itself when it reaches STEP of a re-forming (World._reached: 'joined'
once it is in the forming world, 'admitted' once every member is, 'duplicated' once the new
communicator exists, 'formed' once the world re-formed, before the stores' reset; 'hosts'
inside the store's reset, once its host count's first request completed: the survivors wait
in its second), in generation 1 or later: the survivors' re-forming loses a worker itself,
and must re-form again without it. ``--script``: the scenario run so (default
elastic_world.py).
"""
import argparse
import os
import runpy
import signal
import sys

from mpi_kvstore.elastic.world import World

HERE = os.path.dirname(os.path.abspath(__file__))

parser = argparse.ArgumentParser()
parser.add_argument('--die-id', type=int, required=True)
parser.add_argument('--die-step', required=True,
                    choices=('joined', 'admitted', 'duplicated', 'formed', 'hosts'))
parser.add_argument('--script', default='elastic_world.py')
args, rest = parser.parse_known_args()


def dies(world, step):
    print('worker %d: dies at %s of generation %d' % (world.id, step, world.generation),
          flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def reached(world, step):
    if world.id == args.die_id and step == args.die_step and world.generation >= 1:
        dies(world, step)


def waiter(world, what, deadline=None):
    """The store's build's wait: the agreement's allreduce is its 1st request, the host
    count's allgather of lengths its 2nd, of the hosts and cores its 3rd."""
    wait = real_waiter(world, what, deadline)
    if world.id != args.die_id or args.die_step != 'hosts' or world.generation < 1:
        return wait
    done = []

    def dying(request, keep=()):
        wait(request, keep)
        done.append(request)
        if len(done) == 2:
            dies(world, 'hosts')
    return dying


real_waiter = World.waiter
World._reached = reached
World.waiter = waiter
script = os.path.join(HERE, args.script)
sys.argv = [script] + rest
runpy.run_path(script, run_name='__main__')
