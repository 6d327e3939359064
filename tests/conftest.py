"""Shared pytest setup: import paths, the MPI availability check, and each test's kind.

Every test gets exactly one kind marker, assigned here at collection so that a new test
file needs no edit to get one (``pytest -m unit`` is the contributors' fast loop):

- ``gpu``: in test_gpu.py or test_gpu_*.py (test_gpu_like.py excepted: it checks the
  CPU benchmark benchmarks/gpu_like.py, so it is ``bench``);
- ``testbed``: in test_testbed.py or test_multihost.py, or a test that uses the test bed
  (it, a fixture it requests or a helper of its module names ``testbed``/``Hosts``, or
  runs ``python -m testbed...``): network-namespace test hosts, which need root;
- ``bench``: in test_benchmarks.py or test_bench_*.py: benchmark smoke tests;
- ``mpi``: requests the ``mpi_available`` fixture, directly or through another fixture,
  or reaches mpi_harness's launchers (``run_mpi``, ``mpi_command``) from its own code or a
  helper of its module: multi-process scenarios;
- ``unit``: the rest, one process. A ``unit`` test that launches an MPI job or builds
  test hosts anyway fails, saying so (``_unit_tests_launch_nothing``), so the
  classification cannot rot into a slow fast loop.
"""
import collections
import fnmatch
import itertools
import os
import subprocess
import sys
import types

import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS_DIR)

# The repo root so tests import the working tree's mpi_kvstore even without
# `pip install -e .`; tests/ so they can import mpi_harness.
for _path in (TESTS_DIR, REPO_ROOT):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import testbed  # noqa: E402  (needs the path above)

import mpi_harness  # noqa: E402  (needs the path above)

KINDS = {
    'unit': 'one process, no mpiexec, no test hosts (the fast loop: pytest -m unit)',
    'mpi': 'multi-process scenarios launched through tests/mpi_harness.py',
    'testbed': 'runs across network-namespace test hosts (testbed/; needs root and ip)',
    'gpu': 'needs a GPU (skips without one)',
    'bench': 'benchmark smoke tests (python -m benchmarks.NAME)',
}

# File name -> kind, first match wins (the exception before its rule).
FILE_KINDS = (
    ('test_gpu_like.py', 'bench'),
    ('test_gpu.py', 'gpu'),
    ('test_gpu_*.py', 'gpu'),
    ('test_testbed.py', 'testbed'),
    ('test_multihost.py', 'testbed'),
    ('test_benchmarks.py', 'bench'),
    ('test_bench_*.py', 'bench'),
)

MPI_NAMES = frozenset({'run_mpi', 'run_designs', 'run_joint', 'mpi_command', 'require_mpiexec'})
TESTBED_NAMES = frozenset({'testbed', 'Hosts'})


# What the ranks would otherwise compile at their first store: numba caches it on disk beside
# the sources, but a fresh clone (or an edit to the engine) has no cache, and every rank of the
# first job then compiles at once, over 30 s on a loaded 2-core machine, inside that job's
# timeout. Compiled once here, before any MPI job, the ranks load it in a fraction of a second.
_WARM_COMPILED_CODE = """
from mpi_kvstore.comm import progress
from mpi_kvstore.engine import records
progress.prepare()
records.mark_ready_address()
records.run_chained_address()
"""


@pytest.fixture(scope='session')
def mpi_available():
    """Path of mpiexec, with the compiled code the ranks load already on disk. Fails, never
    skips, where mpiexec is missing: CI installs it."""
    mpiexec = mpi_harness.require_mpiexec()
    subprocess.run([sys.executable, '-c', _WARM_COMPILED_CODE], cwd=REPO_ROOT, check=True,
                   timeout=900, env=dict(os.environ, OMP_NUM_THREADS='1'))
    return mpiexec


_BATCH_KEY = pytest.StashKey()


def _params(item):
    """A collected test's parameters ({} when it is not parametrized)."""
    return getattr(getattr(item, 'callspec', None), 'params', {})


def _batch_of(item):
    """(module, function, the parameters other than design) of a design-parametrized test."""
    params = dict(_params(item))
    params.pop('design', None)
    return (str(item.path), item.originalname, tuple(sorted(
        (name, repr(value)) for name, value in params.items())))


def pytest_collection_finish(session):
    # After -k and -m have deselected: a batch holds only the designs that will run.
    batches = collections.defaultdict(list)
    for item in session.items:
        params = _params(item)
        if 'design' in params:
            batches[_batch_of(item)].append(params['design'])
    session.config.stash[_BATCH_KEY] = batches
    # run_joint's jobs run only these designs, so that -k chained still runs only chained
    mpi_harness.SELECTED_DESIGNS = {
        design for batch in batches.values() for design in batch} or None
    # ...and only for a module of which several tests (batches of designs) were selected: a
    # test picked alone with -k runs its own scenario, not every scenario of its size
    tests = collections.defaultdict(set)
    for item in session.items:
        joint = getattr(getattr(item, 'module', None), 'JOINT', None)
        if joint is not None:
            tests[id(joint)].add(_batch_of(item))
    mpi_harness.SELECTED_JOINT = {joint: len(found) for joint, found in tests.items()}


@pytest.fixture
def hvd_chained():
    """mpi_kvstore.horovod initialised in this process (one rank) on the chained design, the
    autotuner off: its global set's store; shut down after the test."""
    import mpi_kvstore.horovod as hvd  # here, not at the top: it loads MXNet and MPI
    hvd.init(design='chained', autotune='0')
    try:
        yield hvd.global_process_set._store
    finally:
        hvd.shutdown()


@pytest.fixture
def designs(request):
    """The designs of the tests selected beside this one that differ from it only in
    ``design``: mpi_harness.run_designs runs them in one job."""
    alone = (_params(request.node)['design'],)
    if os.environ.get('PYTEST_XDIST_WORKER'):
        # Under pytest-xdist another worker may run the batch's other tests: each worker
        # would run the whole batch. One job per test there, as before batches.
        return alone
    batches = request.config.stash.get(_BATCH_KEY, {})
    return tuple(batches.get(_batch_of(request.node), ())) or alone


@pytest.fixture(scope='module')
def batch_dir(tmp_path_factory):
    """A folder for the scenarios of one test module that take one (run_designs batches only
    tests whose arguments are equal, so a test's own tmp_path would keep it alone). The
    designs of a batch run one after another, each writing and reading its own files."""
    return str(tmp_path_factory.mktemp('batch'))


def pytest_configure(config):
    for kind, meaning in KINDS.items():
        config.addinivalue_line('markers', '%s: %s' % (kind, meaning))
    # pytest-xdist's marker, registered here too so that a run without xdist knows it.
    config.addinivalue_line('markers', 'xdist_group(name): tests that one xdist worker runs')


def pytest_collection_modifyitems(config, items):
    for item in items:
        kind = kind_of(item)
        item.add_marker(getattr(pytest.mark, kind))
        if kind == 'testbed':
            # Under pytest-xdist (-n 2 --dist loadgroup) one worker runs every test-bed test,
            # one after another: two test beds at once would share the machine's two cores
            # between their shaped links and the timing their tests assert.
            item.add_marker(pytest.mark.xdist_group('testbed'))


def kind_of(item):
    """The one kind of a collected test (see the module docstring)."""
    name = os.path.basename(str(item.path))
    for pattern, kind in FILE_KINDS:
        if fnmatch.fnmatch(name, pattern):
            return kind
    names = _names_reached(item)
    if names & TESTBED_NAMES:
        return 'testbed'
    if 'mpi_available' in item.fixturenames or names & MPI_NAMES:
        return 'mpi'
    return 'unit'


def _names_reached(item):
    """Global names and launch words the test's code reaches.

    Its function, the fixtures it requests (directly or not), and the functions of tests/
    those call by name, followed transitively; mpi_harness is not followed, as its entry
    points are what is looked for. Words of ``python -m testbed...`` count as ``testbed``.
    """
    funcs = [getattr(item, 'function', None)]
    fixtureinfo = getattr(item, '_fixtureinfo', None)     # absent on non-function items
    for defs in (fixtureinfo.name2fixturedefs.values() if fixtureinfo else ()):
        funcs.extend(fixturedef.func for fixturedef in defs)
    names, seen = set(), set()
    while funcs:
        func = _plain_function(funcs.pop())
        if func is None or func.__code__ in seen or not _in_tests(func):
            continue
        seen.add(func.__code__)
        for code in _code_objects(func.__code__):
            names.update(code.co_names)
            names.update('testbed' for const in code.co_consts if _testbed_word(const))
        funcs.extend(func.__globals__.get(name) for name in names)
    return names


def _plain_function(func):
    func = getattr(func, '__func__', func)
    func = getattr(func, '__wrapped__', func)
    return func if isinstance(func, types.FunctionType) else None


def _in_tests(func):
    path = os.path.abspath(func.__code__.co_filename)
    return (os.path.dirname(path) == TESTS_DIR
            and os.path.basename(path) not in ('mpi_harness.py', 'conftest.py'))


def _code_objects(code):
    """CODE and the code of its nested functions, lambdas and comprehensions."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def _testbed_word(const):
    return isinstance(const, str) and (
        const == 'testbed' or (const.startswith('testbed_') and ' ' not in const))


class UnitTestLaunched(Exception):
    """A test classified ``unit`` launched an MPI job or built test hosts."""


_LAUNCH_ATTEMPTS = pytest.StashKey()
LAUNCHERS = frozenset({'mpiexec', 'mpirun', 'orterun', 'mpiexec.hydra'})


def _launches_mpi(args):
    """Whether a Popen argv starts an MPI job (mpiexec or ``python -m mpi4py``)."""
    words = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
    words = [os.fsdecode(word) if isinstance(word, (bytes, os.PathLike)) else str(word)
             for word in words]
    if len(words) == 1:     # a shell string
        words = words[0].split()
    return (any(os.path.basename(word) in LAUNCHERS for word in words)
            or any(pair == ('-m', 'mpi4py') for pair in itertools.pairwise(words)))


@pytest.fixture(autouse=True)
def _unit_tests_launch_nothing(request, monkeypatch):
    """For ``unit`` tests, launching an MPI job or building test hosts fails the test.

    The launch raises; the attempt is also recorded, and a test that caught the exception
    and passed is reported failed (pytest_runtest_makereport).
    """
    if request.node.get_closest_marker('unit') is None:
        yield
        return
    attempts = request.node.stash.setdefault(_LAUNCH_ATTEMPTS, [])

    def refuse(what):
        message = ('%s is classified unit by tests/conftest.py but %s; request the '
                   'mpi_available fixture, or launch through mpi_harness.run_mpi, so that '
                   'it is an mpi test' % (request.node.nodeid, what))
        attempts.append(message)
        raise UnitTestLaunched(message)

    def no_mpi_command(*args, **kwargs):
        refuse('launches an MPI job')

    def no_hosts(*args, **kwargs):
        refuse('builds test hosts')

    class GuardedPopen(subprocess.Popen):
        def __init__(self, args, *rest, **kwargs):
            if _launches_mpi(args):
                refuse('runs %r' % (args,))
            super().__init__(args, *rest, **kwargs)

    monkeypatch.setattr(mpi_harness, 'mpi_command', no_mpi_command)
    monkeypatch.setattr(testbed, 'Hosts', no_hosts)
    monkeypatch.setattr(subprocess, 'Popen', GuardedPopen)
    yield


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    attempts = item.stash.get(_LAUNCH_ATTEMPTS, None)
    if report.when == 'call' and report.passed and attempts:
        report.outcome = 'failed'
        report.longrepr = attempts[0]
    return report
