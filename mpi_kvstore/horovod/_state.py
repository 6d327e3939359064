"""init's state, which basics.py (init, shutdown, the ranks) and process_sets.py (the sets'
numbers and stores) share: one dict, empty while hvd is not initialized, and its lock."""
from __future__ import annotations

import threading
from typing import Any

_NOT_INITIALIZED = 'Horovod has not been initialized; use hvd.init().'
_lock = threading.RLock()
_state: dict[str, Any] = {}


def _require_init() -> None:
    if _state.get('store') is None:
        raise ValueError(_NOT_INITIALIZED)
