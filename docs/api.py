"""Build the API reference (HTML) from the public modules' docstrings with pdoc.

    python -m docs.api                  # writes docs/api/index.html and one page per module
    python -m docs.api --output DIR     # somewhere else

pdoc comes with the ``test`` extra (``pip install -e '.[test]'``). Only the public modules are
documented: the internals (comm/, engine/, ...) are no API, so they are not walked into. The
output is built, not committed (docs/api/.gitignore).
"""
import argparse
import logging
import os
import sys
from pathlib import Path

# What users import; tests/test_api_docs.py checks that each public name here has a docstring.
PUBLIC_MODULES = (
    'mpi_kvstore',
    'mpi_kvstore.store',
    'mpi_kvstore.functional',
    'mpi_kvstore.gluon',
    'mpi_kvstore.elastic',
    'mpi_kvstore.horovod',
    'mpi_kvstore.config',
    'mpi_kvstore.errors',
)

DEFAULT_OUTPUT = Path(__file__).resolve().parent / 'api'
REPO_ROOT = Path(__file__).resolve().parent.parent

log = logging.getLogger(__name__)


def build(output=DEFAULT_OUTPUT, modules=PUBLIC_MODULES):
    """Write one HTML page per module, index.html and search.js under ``output``; returns the
    paths of the module pages, in the order of ``modules``."""
    import pdoc  # the test extra's; loaded here so that --help works without it
    import pdoc.doc
    import pdoc.render

    # The working tree's package, as the tests import it, even without `pip install -e .`.
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    # The docstrings are reStructuredText (``literal``, :class:`...`).
    pdoc.render.configure(docformat='restructuredtext', show_source=False,
                          footer_text='mpi_kvstore API')
    # pdoc.pdoc() would walk every submodule of a package; the reference lists these alone.
    documented = {name: pdoc.doc.Module.from_name(name) for name in modules}
    output = Path(output)
    pages = []
    for name, module in documented.items():
        page = output / (name.replace('.', '/') + '.html')
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(pdoc.render.html_module(module, documented), encoding='utf-8')
        pages.append(page)
    (output / 'index.html').write_text(pdoc.render.html_index(documented), encoding='utf-8')
    (output / 'search.js').write_text(pdoc.render.search_index(documented), encoding='utf-8')
    return pages


def main(argv=None):
    parser = argparse.ArgumentParser(prog='python -m docs.api', description=__doc__.split('\n')[0])
    parser.add_argument('--output', default=str(DEFAULT_OUTPUT),
                        help='folder for the HTML (default: %(default)s)')
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format='%(message)s')
    pages = build(args.output)
    log.info('API reference: %d module pages in %s (open index.html)',
             len(pages), os.path.abspath(args.output))
    return 0


if __name__ == '__main__':
    sys.exit(main())
