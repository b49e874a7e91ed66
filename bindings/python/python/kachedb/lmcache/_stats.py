"""Process-wide counters of the LMCache integration (``kachedb.lmcache.stats()``)."""

from __future__ import annotations

from typing import Dict, MutableMapping

from .. import _counters

COUNTERS: MutableMapping[str, float] = _counters.counters()


def snapshot() -> Dict[str, _counters.Number]:
    return _counters.snapshot(COUNTERS)
