"""The package's shape: layers that point down (import-linter), lint (ruff), and the option
vocabularies that config.py spells as literals, against the registries that implement them."""
import glob
import os
import shutil
import subprocess
import sys

from mpi_kvstore import compression, designs
from mpi_kvstore import config as cfg
from mpi_kvstore.comm import mpiabi, transports

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tool(name):
    """A console script of the environment running the tests (CI's venv)."""
    found = shutil.which(name, path=os.path.dirname(sys.executable)) or shutil.which(name)
    assert found, '%s is missing: pip install -e ".[test]"' % name
    return found


def _run(argv):
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get('PYTHONPATH', ''))
    return subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_imports_follow_the_layers():
    """.importlinter states the layers; lint-imports fails on an upward import or a cycle."""
    out = _run([_tool('lint-imports'), '--config', os.path.join(REPO_ROOT, '.importlinter')])
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    with open(os.path.join(REPO_ROOT, '.importlinter')) as fh:
        stated = fh.read().count('[importlinter:contract:')
    assert 'Contracts: %d kept, 0 broken.' % stated in out.stdout, out.stdout[-2000:]


def _subpackages():
    root = os.path.join(REPO_ROOT, 'mpi_kvstore')
    return sorted(name for name in os.listdir(root)
                  if os.path.isfile(os.path.join(root, name, '__init__.py')))


def test_each_subpackage_says_what_lives_there_and_has_a_contract():
    """The package's concerns are found by folder name: each sub-package's docstring says
    what lives there and what it may import, and .importlinter states its own contract."""
    import ast
    with open(os.path.join(REPO_ROOT, '.importlinter')) as fh:
        contracts = fh.read()
    packages = _subpackages()
    assert {'cli', 'comm', 'compression', 'designs', 'engine', 'faults', 'horovod', 'launch',
            'optim', 'store'} <= set(packages), packages
    for name in packages:
        path = os.path.join(REPO_ROOT, 'mpi_kvstore', name, '__init__.py')
        with open(path) as fh:
            doc = ast.get_docstring(ast.parse(fh.read())) or ''
        assert len(doc.split()) >= 20, (name, doc)
        assert ('containers = mpi_kvstore.%s\n' % name in contracts
                or '    mpi_kvstore.%s.' % name in contracts), name



def test_every_module_of_a_subpackage_is_placed_by_its_contract():
    """A module that no contract names can import anything in its sub-package unnoticed:
    each module must be a layer of its sub-package's contract (or be named in full)."""
    import configparser
    parser = configparser.ConfigParser()
    parser.read(os.path.join(REPO_ROOT, '.importlinter'))
    placed = {}
    for section in parser.sections():
        contract = parser[section]
        container = contract.get('containers', '').strip()
        for line in (contract.get('layers', '') + '\n' + contract.get('modules', '')).split():
            if line == '|':
                continue
            full = line if line.startswith('mpi_kvstore.') else container + '.' + line
            placed.setdefault(full.rsplit('.', 1)[0], set()).add(full.rsplit('.', 1)[1])
    unplaced = []
    for package in _subpackages():
        folder = os.path.join(REPO_ROOT, 'mpi_kvstore', package)
        for dirpath, _, names in os.walk(folder):
            if '__init__.py' not in names:
                continue
            dotted = 'mpi_kvstore.' + os.path.relpath(dirpath, os.path.join(REPO_ROOT, 'mpi_kvstore')
                                                      ).replace(os.sep, '.')
            for name in names:
                module = name[:-3] if name.endswith('.py') else None
                if module and module != '__init__' and module not in placed.get(dotted, ()):
                    unplaced.append('%s.%s' % (dotted, module))
    assert not unplaced, 'modules under no contract: %s' % unplaced

def test_few_modules_at_the_top():
    """At most 12 modules directly under mpi_kvstore/: the rest live in sub-packages."""
    root = os.path.join(REPO_ROOT, 'mpi_kvstore')
    top = sorted(name for name in os.listdir(root) if name.endswith('.py'))
    assert len(top) <= 12, top


def test_benchmarks_stay_small():
    """benchmarks/*.py and benchmarks/*/*.py total at most 4,800 lines: the scripts share
    harness/peers/report rather than each growing its own copy, and the prose that explains
    the figures lives once, in docs/benchmarks.md, not again in docstrings and --help."""
    paths = glob.glob(os.path.join(REPO_ROOT, 'benchmarks', '*.py'))
    paths += glob.glob(os.path.join(REPO_ROOT, 'benchmarks', '*', '*.py'))
    total = 0
    for path in paths:
        with open(path) as handle:
            total += sum(1 for _ in handle)
    assert total <= 4800, f'benchmarks/ has {total} lines of Python (at most 4800)'


def test_ruff_finds_nothing():
    out = _run([_tool('ruff'), 'check', '--no-cache', REPO_ROOT])
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_public_api_type_hints_check():
    """mypy, as pyproject.toml's [tool.mypy] says, on the modules whose hints users see
    (py.typed ships them): create, MPIKVStore's methods, the functional API, horovod (9 files)
    and elastic (12 files)."""
    out = _run([sys.executable, '-m', 'mypy', '--no-incremental'])
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert 'Success: no issues found in 24 source files' in out.stdout, out.stdout
    assert os.path.exists(os.path.join(REPO_ROOT, 'mpi_kvstore', 'py.typed'))


def test_config_vocabularies_equal_the_registries():
    assert cfg.DESIGNS == tuple(designs.REGISTRY)
    assert set(cfg.GPU_TRANSPORTS) == {'auto'} | set(transports.REGISTRY)
    assert cfg.COMPRESSIONS == compression.WIRE_TYPES
    assert compression.wire_cast('none') is None
    for name in cfg.COMPRESSIONS[1:]:   # every named wire cast builds
        assert compression.wire_cast(name) is not None
    for mode in cfg.HIERARCHICAL_MODES:
        assert cfg.Config(environ={}, hierarchical=mode).hierarchical == mode
    for mode in cfg.CUDA_AWARE_MODES:
        assert cfg.Config(environ={}, cuda_aware=mode).cuda_aware == mode
        assert mpiabi.cuda_aware(mode) in (True, False)


def test_docs_speak_to_users():
    """The docs state results for users: no page speaks of issues, sessions or engineers, and
    docs/benchmarks.md stays a results page of bounded size."""
    import re
    pattern = re.compile(r'issue [0-9]|another engineer|was lent', re.IGNORECASE)
    pages = [os.path.join(REPO_ROOT, 'README.md')] + [
        os.path.join(REPO_ROOT, 'docs', name)
        for name in sorted(os.listdir(os.path.join(REPO_ROOT, 'docs'))) if name.endswith('.md')]
    found = []
    for page in pages:
        with open(page) as fh:
            found += ['%s:%d: %s' % (os.path.relpath(page, REPO_ROOT), number, line.strip())
                      for number, line in enumerate(fh, 1) if pattern.search(line)]
    assert found == [], found
    assert os.path.getsize(os.path.join(REPO_ROOT, 'docs', 'benchmarks.md')) <= 25_000


def test_readme_is_a_front_page_and_dated_figures_live_in_benchmarks_md():
    """README.md fits 8 KB and carries no date, commit hash or test count; a page of docs/
    fits 16 KB (benchmarks.md 25 KB), docs/ 170 KB; dates and `git show <hash>:` pointers to
    retired scripts appear only in benchmarks.md, whose tables give each run's date."""
    import re
    date = re.compile(r'20[0-9]{2}-[01][0-9]-[0-3][0-9]')
    diary = re.compile(r'\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b'   # a hash
                       r'|[0-9,]+ tests\b|[0-9]+ passed\b')
    with open(os.path.join(REPO_ROOT, 'README.md')) as fh:
        readme = fh.read()
    assert len(readme.encode()) <= 8192
    assert not date.search(readme), date.search(readme).group(0)
    assert not diary.search(readme), diary.search(readme).group(0)
    docs = os.path.join(REPO_ROOT, 'docs')
    sizes = {name: os.path.getsize(os.path.join(docs, name))
             for name in os.listdir(docs) if name.endswith('.md')}
    assert sizes.pop('benchmarks.md') <= 25_000
    assert {name: size for name, size in sizes.items() if size > 16_000} == {}
    assert sum(sizes.values()) + os.path.getsize(os.path.join(docs, 'benchmarks.md')) <= 170_000
    found = []
    for name in sorted(sizes):
        with open(os.path.join(docs, name)) as fh:
            found += ['%s:%d' % (name, number) for number, line in enumerate(fh, 1)
                      if 'git show' in line or date.search(line)]
    assert found == [], found
