"""The command line (``python -m mpi_kvstore``) and the packaging: each command's own help,
argparse's exit status 2 with one line of words for what is wrong, and metadata that says
what the code needs."""
import ast
import glob
import os
import re
import subprocess
import sys

import pytest

from mpi_kvstore import __main__ as cli_main
from mpi_kvstore import config
from mpi_kvstore.launch import supervisor
from mpi_kvstore.launch.console import console

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROG = 'python -m mpi_kvstore'


@pytest.fixture(autouse=True)
def _console_handlers():
    """main() gives the tools' logger a handler on this test's captured stdout: take it back
    after the test, so no later test writes to a closed capture."""
    before = list(console.handlers)
    yield
    console.handlers[:] = before


def _command(*argv, env=None):
    """``python -m mpi_kvstore ARGV`` in a process of its own, from the working tree."""
    return subprocess.run([sys.executable, '-m', 'mpi_kvstore', *argv], cwd=REPO,
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, **(env or {})))


def _exit(capsys, *argv):
    """main(argv) in this process -> (exit status, stdout, stderr)."""
    with pytest.raises(SystemExit) as ended:
        cli_main.main(list(argv))
    out, err = capsys.readouterr()
    return ended.value.code, out, err


def _tune_parser():
    from mpi_kvstore.cli import tune  # initialises MPI (a singleton here): only where needed
    return tune._parser()


# command: its own parser (None: it has no option but -h).
PARSERS = {
    'doctor': lambda: None,
    'tune': _tune_parser,
    'run': supervisor._parser,
    'options': lambda: None,
}


@pytest.mark.parametrize('command', sorted(PARSERS))
def test_each_command_has_its_own_help(capsys, command):
    """``COMMAND --help`` is that command's help (not the top level's, as it was for run and
    tune): it names each of its options with help text, and the default of each that has one,
    and exits 0."""
    status, out, _ = _exit(capsys, command, '--help')
    assert status == 0
    assert out.startswith('usage: %s %s [-h]' % (PROG, command)), out
    assert 'COMMAND' not in out, out          # the top level's usage names COMMAND
    parser = PARSERS[command]()
    options = [a for a in (parser._actions if parser else [])
               if a.option_strings and a.dest != 'help']
    assert (command in ('tune', 'run')) == bool(options)
    flat = ' '.join(out.split())
    for action in options:
        assert action.help, '%s %s has no help text' % (command, action.option_strings)
        assert all(s in out for s in action.option_strings), (action.option_strings, out)
        text = ' '.join(parser._get_formatter()._expand_help(action).split())
        assert text in flat, (text, out)
        if action.default not in (None, False):
            assert 'default' in text and ('%g' % action.default if isinstance(
                action.default, float) else str(action.default)) in text, (action.default, text)
    if command == 'tune':
        for default in ('(default: 4K,64K,256K,1M,4M,16M,64M)', '(default: 7)',
                        '(default: mpi_kvstore_tune.json)'):
            assert default in flat, out


def test_top_level_help_lists_every_command(capsys):
    status, out, _ = _exit(capsys, '--help')
    assert status == 0
    listed = re.findall(r'^    (\w+) ', out, re.M)
    assert listed == list(cli_main.COMMANDS) == ['doctor', 'tune', 'run', 'options'], out


def test_bare_call_prints_help_with_status_2(capsys):
    """No command is a usage error (argparse's status 2), with the whole help on stderr; it
    no longer prints the options table."""
    assert cli_main.main([]) == 2
    out, err = capsys.readouterr()
    assert out == '', out
    assert err.startswith('usage: %s [-h]' % PROG), err
    for name in cli_main.COMMANDS:
        assert '    %s ' % name in err, (name, err)


@pytest.mark.parametrize('argv, words', [
    (['tune', '--trials', 'x'], "tune: error: argument --trials: 'x'"),
    (['tune', '--trials', '0'], "tune: error: argument --trials: '0'"),
    (['tune', '--sizes', '4Q,1M'], "tune: error: argument --sizes: '4Q,1M'"),
    (['tune', '--sizes', '2'], "tune: error: argument --sizes: '2'"),
    (['run', '--bogus'], 'run: error: unrecognized arguments: --bogus'),
    (['doctor', '--bogus'], 'doctor: error: unrecognized arguments: --bogus'),
    (['options', 'extra'], 'options: error: unrecognized arguments: extra'),
    (['bogus'], "error: argument COMMAND: invalid choice: 'bogus'"),
])
def test_bad_option_exits_2_naming_it(capsys, argv, words):
    """argparse's way: the usage, then one line that names the option and the value."""
    status, out, err = _exit(capsys, *argv)
    assert status == 2 and out == '', (status, out)
    last = err.rstrip('\n').split('\n')[-1]
    assert last.startswith(PROG) and words in last, err
    assert err.startswith('usage: %s' % PROG) and 'Traceback' not in err, err


def test_config_error_is_one_line_with_status_2(capsys, monkeypatch):
    """A wrong MPI_KVSTORE_* value is the user's to fix: one line naming it, no traceback;
    in a process of its own (the real exit), then in this one for a second option."""
    proc = _command('doctor', env={'MPI_KVSTORE_DESIGN': 'ring'})
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert proc.stderr == ('%s doctor: error: invalid environment variable '
                           "MPI_KVSTORE_DESIGN='ring': unknown design 'ring'; choose one of "
                           'funneled, concurrent, chained, blocking, auto\n' % PROG), proc.stderr
    monkeypatch.setenv('MPI_KVSTORE_FUSION_THRESHOLD', '-1')
    status, _, err = _exit(capsys, 'doctor')
    assert status == 2 and err.count('\n') == 1 and err.endswith('\n'), err
    assert err.startswith("%s doctor: error: invalid environment variable "
                          "MPI_KVSTORE_FUSION_THRESHOLD='-1'" % PROG), err


def test_options_command_prints_the_table_and_the_old_flag_still_works():
    """docs/configuration.md's table comes from ``options``; ``--options-table`` gives the
    same table, with a deprecation line on stderr."""
    table = config.options_table() + '\n'
    proc = _command('options')
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, table, '')
    old = _command('--options-table')
    assert (old.returncode, old.stdout) == (0, table), old.stderr
    assert "--options-table is deprecated: use '%s options'" % PROG in old.stderr


def _pyproject():
    try:
        import tomllib
    except ImportError:       # Python 3.10: the test extra brings tomli
        import tomli as tomllib
    with open(os.path.join(REPO, 'pyproject.toml'), 'rb') as fh:
        return tomllib.load(fh)


def test_requires_python_is_what_the_code_needs():
    """vermin reads the package's code for the least Python it runs on (os.eventfd: 3.10);
    requires-python says exactly that, and the classifiers name no older Python."""
    import vermin
    needed = max(vermin.detect(open(path).read(), path=path)[1]
                 for path in glob.glob(os.path.join(REPO, 'mpi_kvstore', '**', '*.py'),
                                       recursive=True))
    project = _pyproject()['project']
    assert project['requires-python'] == '>=%d.%d' % needed, (project['requires-python'],
                                                              needed)
    listed = [tuple(int(n) for n in c.rsplit(' ', 1)[1].split('.'))
              for c in project['classifiers']
              if re.fullmatch(r'Programming Language :: Python :: 3\.\d+', c)]
    assert listed and min(listed) == needed, listed


def test_version_is_written_once():
    """The version lives in mpi_kvstore/__init__.py alone: pyproject.toml reads it from there
    and setup.py is a bare shim."""
    pyproject = _pyproject()
    assert 'version' not in pyproject['project']
    assert 'version' in pyproject['project']['dynamic']
    assert pyproject['tool']['setuptools']['dynamic']['version'] == {
        'attr': 'mpi_kvstore.__version__'}
    with open(os.path.join(REPO, 'setup.py')) as fh:
        calls = [node for node in ast.walk(ast.parse(fh.read()))
                 if isinstance(node, ast.Call) and getattr(node.func, 'id', '') == 'setup']
    assert len(calls) == 1 and not calls[0].args and not calls[0].keywords
    written = []
    for path in glob.glob(os.path.join(REPO, 'mpi_kvstore', '**', '*.py'), recursive=True):
        with open(path) as fh:
            written += [path for line in fh if line.startswith('__version__')]
    assert written == [os.path.join(REPO, 'mpi_kvstore', '__init__.py')], written


def test_run_starts_no_mpi_in_the_supervisor():
    """``python -m mpi_kvstore run`` launches a one-rank job to its end, and its own process
    never imported mpi4py.MPI (whose import starts MPI): only the job's ranks start MPI.
    The job itself does import it, so the check is not vacuous."""
    code = ('import runpy, sys\n'
            "sys.argv = ['mpi_kvstore', 'run', '-n', '1', '--max-restarts', '0', '--', "
            "sys.executable, '-c', 'from mpi4py import MPI; print(\"ranks\", "
            "MPI.COMM_WORLD.Get_size())']\n"
            'try:\n'
            "    runpy.run_module('mpi_kvstore', run_name='__main__', alter_sys=True)\n"
            'except SystemExit as ended:\n'
            "    print('status', ended.code)\n"
            "print('supervisor imported', sorted(m for m in sys.modules if m.startswith('mpi4py')))\n")
    proc = subprocess.run([sys.executable, '-c', code], cwd=REPO, capture_output=True,
                          text=True, timeout=180)
    assert 'ranks 1' in proc.stdout and 'status 0' in proc.stdout, (proc.stdout, proc.stderr)
    assert "supervisor imported []" in proc.stdout, proc.stdout


@pytest.mark.parametrize('check', [True, False])
def test_tune_writes_its_table_before_the_check_which_no_check_skips(tmp_path, monkeypatch,
                                                                     check, caplog):
    """At one rank, in this process: the check's paired timings (a 'table' entry beside one
    algorithm) run only without --no-check, and the table is on disk before they start, so
    a tune stopped during its check keeps what it measured. At one rank the check says that
    its ratios compare nothing (the table's call returns at once) instead of judging them."""
    import json
    import logging

    from mpi_kvstore.cli import tune  # initialises MPI (a singleton here): only where needed
    from mpi_kvstore.comm import tuning
    out = tmp_path / 'table.json'
    real, paired = tune._interleaved, []

    def interleaved(comm, fns, *args, **kwargs):
        if 'table' in fns:
            paired.append(sorted(fns))
            assert out.exists(), 'the check started before the table was written'
        return real(comm, fns, *args, **kwargs)
    monkeypatch.setattr(tune, '_interleaved', interleaved)
    argv = ['--sizes', '4K,64K', '--trials', '1', '--out', str(out)]
    with caplog.at_level(logging.INFO, logger='mpi_kvstore.launch.console'):
        assert tune.main(argv + ([] if check else ['--no-check'])) == 0
    said = caplog.text
    assert ('one rank: nothing to exchange' in said) == check, said
    assert 'slowest size against its best single algorithm' not in said, said
    table = tuning.Table.from_json(json.loads(out.read_text()))
    assert table.comm_size == 1 and table.choose(4096) in tuning.LOSSLESS
    assert bool(paired) == check, paired
    # the check pairs the table with each lossless algorithm, at both sizes
    assert all(len(p) == 2 and (set(p) - {'table'}) <= set(tuning.LOSSLESS) for p in paired)
    assert sum(p == ['mpi', 'table'] for p in paired) == (2 if check else 0), paired
