"""Shared pytest setup: import paths and the MPI availability check."""
import os
import sys

import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS_DIR)

# The repo root so tests import the working tree's mpi_kvstore even without
# `pip install -e .`; tests/ so they can import mpi_harness.
for _path in (TESTS_DIR, REPO_ROOT):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import mpi_harness  # noqa: E402  (needs the path above)


@pytest.fixture(scope='session')
def mpi_available():
    """Path of mpiexec. Fails, never skips, where it is missing: CI installs it."""
    return mpi_harness.require_mpiexec()
