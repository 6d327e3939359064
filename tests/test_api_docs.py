"""The API reference: every public name has a docstring, and ``python -m docs.api`` builds it.

Public names: ``mpi_kvstore.__all__`` (and ``create``) and the members of its classes,
``MPIKVStore``'s methods and properties, the functional API, ``__all__`` of config, errors,
gluon and ``mpi_kvstore.horovod``, ``elastic.State`` and its methods. A callable's docstring
must be its own (an inherited one describes another class); a data name's is the string after
its assignment (PEP 257's attribute docstring, what pdoc renders), in the module that exports
it or the package module that assigns it.
"""
import html
import importlib
import inspect
import os
import re
import subprocess
import sys

import pdoc.doc_ast
import pytest

import mpi_kvstore
from docs import api  # docs/ is a namespace package at the repo root (conftest's path)
from mpi_kvstore import elastic, functional, horovod
from mpi_kvstore.store import MPIKVStore

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_MISSING = object()
# Interned or shared by value: a binding of the same object under another name proves nothing.
_SHARED_VALUES = (int, float, complex, str, bytes, bool, type(None))


def own_docstring(owner, name):
    """The docstring NAME of OWNER (a module or a class) carries itself, '' if none."""
    member = (inspect.getattr_static(owner, name) if inspect.isclass(owner)
              else getattr(owner, name))
    if isinstance(member, (staticmethod, classmethod)):
        member = member.__func__
    if isinstance(member, property):
        return member.__doc__ or ''
    if inspect.isclass(member):
        return vars(member).get('__doc__') or ''
    if callable(member):
        return getattr(member, '__doc__', None) or ''
    return _data_docstring(owner, name, member)


def _data_docstring(owner, name, value):
    """The attribute docstring of a data name: in OWNER, or in a loaded module of OWNER's
    package that assigns the same object (under the same name, for shared values)."""
    scopes = [owner]
    if inspect.ismodule(owner):
        package = owner.__name__
        scopes += [module for modname, module in sorted(sys.modules.items())
                   if module is not None and modname.startswith(package + '.')]
    for scope in scopes:
        try:
            docstrings = pdoc.doc_ast.walk_tree(scope).var_docstrings
        except (OSError, TypeError):    # no source to read (a built-in or compiled module)
            continue
        for bound, doc in docstrings.items():
            if bound != name and isinstance(value, _SHARED_VALUES):
                continue
            if getattr(scope, bound, _MISSING) is value and doc.strip():
                return doc
    return ''


def public_members(cls):
    """The public names CLS defines itself (methods, properties, class data)."""
    return sorted(name for name in vars(cls) if not name.startswith('_'))


def undocumented(owner, names):
    """The NAMES of OWNER without a docstring of their own."""
    return [name for name in names if not own_docstring(owner, name).strip()]


def assert_documented(owner, names):
    missing = undocumented(owner, names)
    assert not missing, 'no docstring: %s' % ', '.join(
        '%s.%s' % (getattr(owner, '__qualname__', owner.__name__), name) for name in missing)


def test_package_names_have_docstrings():
    names = ['create'] + list(mpi_kvstore.__all__)
    assert_documented(mpi_kvstore, names)


def test_public_classes_members_have_docstrings():
    """The methods, properties and class data of every class in ``mpi_kvstore.__all__``."""
    classes = [getattr(mpi_kvstore, name) for name in mpi_kvstore.__all__
               if inspect.isclass(getattr(mpi_kvstore, name))]
    assert mpi_kvstore.Config in classes
    for cls in classes:
        assert_documented(cls, public_members(cls))


@pytest.mark.parametrize('module', ['mpi_kvstore.config', 'mpi_kvstore.errors',
                                    'mpi_kvstore.gluon'])
def test_module_all_has_docstrings(module):
    module = importlib.import_module(module)
    assert_documented(module, module.__all__)


def test_store_methods_and_properties_have_docstrings():
    names = public_members(MPIKVStore)
    # The contract's methods are among them (a broken vars() walk would check nothing).
    assert {'pushpull', 'push', 'pull', 'broadcast', 'rank', 'num_workers'} <= set(names)
    assert_documented(MPIKVStore, names)


def test_functional_api_has_docstrings():
    defined_here = [name for name, obj in vars(functional).items()
                    if inspect.isfunction(obj) and obj.__module__ == functional.__name__
                    and not name.startswith('_')]
    names = sorted(set(functional.__all__) | set(defined_here))
    assert 'allreduce' in names
    assert_documented(functional, names)


def test_horovod_names_have_docstrings():
    assert_documented(horovod, horovod.__all__)
    for cls in (horovod.ProcessSet, horovod.DistributedTrainer, horovod.DistributedOptimizer):
        assert_documented(cls, public_members(cls))


def test_elastic_state_has_docstrings():
    assert own_docstring(elastic, 'State').strip()
    names = public_members(elastic.State)
    assert {'commit', 'fit'} <= set(names)
    assert_documented(elastic.State, names)


def test_the_check_finds_a_missing_docstring():
    """The helpers above fail an undocumented function, property and data name."""
    class Bare:
        value = 3

        def method(self):
            pass

        @property
        def prop(self):
            return 1

    assert undocumented(Bare, ['value', 'method', 'prop']) == ['value', 'method', 'prop']


def _text(page):
    """The words of an HTML page, without its markup, scripts and styles."""
    page = re.sub(r'<(script|style)\b.*?</\1>', ' ', page, flags=re.S)
    return ' '.join(html.unescape(re.sub(r'<[^>]+>', ' ', page)).split())


def test_docs_command_builds_the_reference(tmp_path):
    # The command's own main, in this process: a `python -m docs.api` child would spend most
    # of its time importing MXNet again. The child below checks that the entry point resolves.
    assert api.main(['--output', str(tmp_path)]) == 0
    out = subprocess.run([sys.executable, '-m', 'docs.api', '--help'], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and '--output' in out.stdout, out.stdout + out.stderr[-3000:]
    for module in api.PUBLIC_MODULES:
        assert (tmp_path / (module.replace('.', '/') + '.html')).is_file(), module
    assert (tmp_path / 'index.html').is_file()
    store_page = (tmp_path / 'mpi_kvstore' / 'store.html').read_text(encoding='utf-8')
    assert 'pushpull' in store_page
    # pushpull's own words are rendered, not only its name.
    first_line = inspect.getdoc(MPIKVStore.pushpull).split('\n')[0]
    words = re.sub(r'[`*:]', ' ', first_line).split()[:6]
    assert ' '.join(words) in re.sub(r'[`*:]', ' ', _text(store_page)), words
    # Only the public modules: the internals are no API.
    assert not (tmp_path / 'mpi_kvstore' / 'engine').exists()


@pytest.mark.parametrize('module', api.PUBLIC_MODULES)
def test_public_modules_have_docstrings(module):
    __import__(module)
    assert (sys.modules[module].__doc__ or '').strip(), module
