"""Process-wide counters of an engine integration (``kachedb.vllm.stats()``,
``kachedb.lmcache.stats()``): one mapping per integration, counted by its
daemon link (``_link.DaemonLink``) and its own code, read as a snapshot."""

from __future__ import annotations

import collections
from typing import Dict, MutableMapping, Union

Number = Union[int, float]


def counters() -> MutableMapping[str, float]:
    """A new set of counters: every name starts at 0."""
    return collections.defaultdict(float)


def snapshot(c: MutableMapping[str, float]) -> Dict[str, Number]:
    """The counters, sorted by name; whole numbers as ints."""
    return {k: (int(v) if float(v).is_integer() else v) for k, v in sorted(c.items())}
