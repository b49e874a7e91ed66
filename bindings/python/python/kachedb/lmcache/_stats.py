"""Process-wide counters of the LMCache integration (``kachedb.lmcache.stats()``)."""

from __future__ import annotations

import collections
from typing import Dict

COUNTERS: Dict[str, float] = collections.defaultdict(float)


def snapshot() -> Dict[str, float]:
    return {k: (int(v) if float(v).is_integer() else v) for k, v in sorted(COUNTERS.items())}
