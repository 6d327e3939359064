"""``python -m mpi_kvstore``: print the configuration table (the README's copy is generated from it)."""
import argparse

from .config import options_table


def main():
    parser = argparse.ArgumentParser(prog='python -m mpi_kvstore', description=__doc__)
    parser.add_argument('--options-table', action='store_true',
                        help='print every knob as a Markdown table')
    parser.parse_args()
    print(options_table())


if __name__ == '__main__':
    main()
