"""KacheDB for LMCache: every LMCache engine on a node shares its KV chunks
through the KacheDB daemon, a remote storage tier behind LMCache's own
per-process CPU tier (``pip install "kachedb-shm[lmcache]"``; see docs/lmcache.md).

* ``config(socket=None, **options)``: the LMCache config entries
  (``remote_storage_plugins`` and ``extra_config``) that add the tier in one step
  (``python -m kachedb lmcache-config`` prints them as JSON).
* ``kachedb.lmcache.connector.KacheDBConnectorAdapter``: the adapter LMCache's
  plugin loader instantiates; it creates a ``KacheDBConnector`` (LMCache's
  ``RemoteConnector``) per remote backend.
* ``stats()``: this process's counters (lookups, hits, stored/loaded chunks, …).

Importing this package does not import LMCache or torch.
"""

from __future__ import annotations

from typing import Any, Dict

from .config import PLUGIN_TYPE, config
from .keys import LAYOUT_VERSION

__all__ = ["config", "stats", "PLUGIN_TYPE", "LAYOUT_VERSION"]


def stats() -> Dict[str, Any]:
    """Counters of the KacheDB tier in this process."""
    from ._stats import snapshot

    return snapshot()
