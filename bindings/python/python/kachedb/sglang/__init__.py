"""KacheDB for SGLang: the L3 storage tier of SGLang's hierarchical cache
(HiCache), shared by every SGLang server on the node through the KacheDB
daemon (see docs/sglang.md).

* ``hicache_config(socket=None, **options)``: the dict to pass as
  ``--hicache-storage-backend-extra-config`` (JSON) with
  ``--hicache-storage-backend dynamic``; ``python -m kachedb sglang-config``
  prints it.
* ``kachedb.sglang.storage.KacheDBStorage``: the ``HiCacheStorage`` backend
  SGLang's storage factory loads from that config (zero-copy v1 interface).

Importing this package does not import SGLang or torch; SGLang imports
``kachedb.sglang.storage`` itself when it builds the backend.
"""

from __future__ import annotations

from .config import hicache_config
from .keys import LAYOUT_VERSION

__all__ = ["hicache_config", "LAYOUT_VERSION"]
