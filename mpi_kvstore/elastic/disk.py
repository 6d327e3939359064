"""Commits on disk: one directory ``commit-<n>`` a commit, written under a temporary name and
renamed into place, so that a reader finds a whole commit or none.

A commit holds ``params.pkl`` (the parameters' values, in order, with names and shapes),
``trainer.states`` (the optimizer states in MXNet's format, when there are any) and
``meta.pkl`` (the extra values, the job's size, every rank's random states). A write that
fails (a full disk, a directory gone) removes its temporary directory before it raises, so
nothing partial is left behind and the previous commit stays whole.
"""
from __future__ import annotations

import os
import pickle
import re
import shutil
import tempfile
from typing import Any

__all__ = ['latest_commit', 'read_commit', 'write_commit', 'TEMPORARY_PREFIX']

_COMMIT = re.compile(r'^commit-(\d+)$')
TEMPORARY_PREFIX = '.tmp-commit-'


def commits(directory: str) -> list[tuple[int, str]]:
    """[(number, path)] of the whole commits in ``directory`` (none if it cannot be read)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return [(int(m.group(1)), os.path.join(directory, name)) for name in names
            for m in [_COMMIT.match(name)] if m]


def latest_commit(directory: str) -> tuple[int, str | None]:
    """(number, path) of the newest whole commit in ``directory``, or (0, None)."""
    found = commits(directory)
    if not found:
        return 0, None
    return max(found)


def write_commit(directory: str, number: int, files: dict[str, bytes | None],
                 keep: int) -> str:
    """Write ``files`` (name: bytes; None is skipped) as commit ``number``, keep the newest
    ``keep`` commits, and return the commit's path. On any failure the temporary directory
    is removed before the exception goes on."""
    tmp = tempfile.mkdtemp(prefix='%s%d-' % (TEMPORARY_PREFIX, number), dir=directory)
    final = os.path.join(directory, 'commit-%08d' % number)
    try:
        for name, data in files.items():
            if data is None:
                continue
            with open(os.path.join(tmp, name), 'wb') as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
        os.rename(tmp, final)      # the commit exists whole, or not at all
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(directory)
    for _, path in sorted(commits(directory))[:-max(1, keep)]:
        shutil.rmtree(path, ignore_errors=True)
    for name in os.listdir(directory):   # temporaries of writers killed half-way
        if name.startswith(TEMPORARY_PREFIX):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
    return final


def read_commit(path: str) -> dict[str, Any]:
    """{'params', 'meta', 'states'} of the commit at ``path``."""
    with open(os.path.join(path, 'params.pkl'), 'rb') as fh:
        params = pickle.load(fh)
    with open(os.path.join(path, 'meta.pkl'), 'rb') as fh:
        meta = pickle.load(fh)
    states = None
    if os.path.exists(os.path.join(path, 'trainer.states')):
        with open(os.path.join(path, 'trainer.states'), 'rb') as fh:
            states = fh.read()
    return {'params': params, 'meta': meta, 'states': states}


def _fsync_dir(path):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
