"""``python -m mpi_kvstore``: the configuration table (the README's copy is generated from it),
or ``doctor``: what this machine and this MPI give the store (doctor.py)."""
import argparse


def main():
    parser = argparse.ArgumentParser(prog='python -m mpi_kvstore', description=__doc__)
    parser.add_argument('command', nargs='?', choices=['doctor'],
                        help='doctor: print the MPI library, thread level, CUDA-awareness, '
                             'versions, local rank and the designs and transports chosen')
    parser.add_argument('--options-table', action='store_true',
                        help='print every knob as a Markdown table (the default)')
    args = parser.parse_args()
    if args.command == 'doctor':
        from .doctor import main as doctor  # noqa: WPS433 (initialises MPI)
        doctor()
        return
    from .config import options_table  # noqa: WPS433
    print(options_table())


if __name__ == '__main__':
    main()
