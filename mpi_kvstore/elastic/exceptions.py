"""The two exceptions of Horovod's elastic mode, under Horovod's names.

``HorovodInternalError``: a collective could not finish because the world changed under it
(a peer was lost). ``elastic.run`` answers it by restoring the last commit, re-forming the
world and calling the training function again. ``HostsUpdatedInterrupt``: hosts were added
or removed; ``elastic.run`` re-forms the world without a restore. ``LostWorldRead``: what
MXNet's read of an array raises where a lost world left it unfinished (both a
HorovodInternalError and MXNet's own error type).
"""
from __future__ import annotations

from mxnet.base import MXNetError

__all__ = ['HorovodInternalError', 'HostsUpdatedInterrupt', 'LostWorldRead']


class HorovodInternalError(RuntimeError):
    """A collective failed because a peer was lost: in ``elastic.run``, a reset that
    restores the last commit."""


class LostWorldRead(HorovodInternalError, MXNetError):
    """A read (``asnumpy``, ``wait_to_read``) of an array that a lost world's collective,
    or the step after it, left unfinished: a HorovodInternalError, and the MXNetError that
    MXNet's reads raise."""


class HostsUpdatedInterrupt(RuntimeError):
    """The job's hosts changed: in ``elastic.run``, a reset without a restore.
    ``skip_sync``: whether the state may skip its broadcast after the reset (hosts were only
    removed, so every survivor already holds the same state)."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__('the job\'s hosts changed' + (' (removed only)' if skip_sync else ''))
        self.skip_sync = skip_sync
