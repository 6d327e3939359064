"""``python -m mpi_kvstore``: the configuration table (docs/configuration.md's copy is
generated from it), ``doctor``: what this machine and this MPI give the store (doctor.py),
``tune`` (tune.py), or ``run``: launch a job and relaunch it when a rank is lost
(supervisor.py)."""
import argparse

from .cli import console, to_stdout
from .config import options_table


def main():
    parser = argparse.ArgumentParser(prog='python -m mpi_kvstore', description=__doc__)
    parser.add_argument('command', nargs='?', choices=['doctor', 'tune', 'run'],
                        help='doctor: print the MPI library, thread level, CUDA-awareness, '
                             'versions, local rank and the designs and transports chosen; '
                             'tune: measure allreduce algorithms per size on this job and '
                             'write a table for the tune_table option (tune --help); '
                             'run: launch a job under the supervisor, which relaunches it '
                             'when a rank is lost (run --help)')
    parser.add_argument('--options-table', action='store_true',
                        help='print every knob as a Markdown table (the default)')
    args, rest = parser.parse_known_args()
    to_stdout()
    if args.command == 'run':
        from .supervisor import main as run  # starts no MPI: the job does
        raise SystemExit(run(rest))
    if args.command == 'tune':
        from .tune import main as tune  # it initialises MPI; the options table must not
        raise SystemExit(tune(rest))
    if rest:
        parser.error('unrecognized arguments: %s' % ' '.join(rest))
    if args.command == 'doctor':
        from .doctor import main as doctor  # it initialises MPI; the options table must not
        doctor()
        return
    console.info(options_table())


if __name__ == '__main__':
    main()
