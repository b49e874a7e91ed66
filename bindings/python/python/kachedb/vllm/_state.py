"""Process-wide counters of the vLLM integration (``kachedb.vllm.stats()``)."""

from __future__ import annotations

import collections
import json
import os
from typing import Any, Deque, Dict, MutableMapping

from .. import _counters

COUNTERS: MutableMapping[str, float] = _counters.counters()
#: The last KacheDB keys this process stored (hex), newest last: for tests and debugging.
STORED_KEYS: Deque[str] = collections.deque(maxlen=4096)
#: The last KacheDB keys this process loaded (hex), newest last.
LOADED_KEYS: Deque[str] = collections.deque(maxlen=4096)
#: Namespace fields of the specs built in this process, by role.
NAMESPACES: Dict[str, Any] = {}


def snapshot() -> Dict[str, Any]:
    out: Dict[str, Any] = dict(_counters.snapshot(COUNTERS))
    out["stored_keys"] = list(STORED_KEYS)
    out["loaded_keys"] = list(LOADED_KEYS)
    out["namespaces"] = dict(NAMESPACES)
    return out


def stats_path(path: str, rank: int, world_size: int) -> str:
    """Where a worker writes its counters: ``path`` itself with one worker,
    ``path.rank<R>`` with several (each its own file)."""
    return path if world_size <= 1 else f"{path}.rank{rank}"


def dump(path: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(snapshot(), f)
    os.replace(tmp, path)
