"""KacheDB for vLLM: every vLLM engine on a node shares its prefix KV cache
through the KacheDB daemon (``pip install kachedb[vllm]``; see docs/vllm.md).

* ``kv_transfer_config(socket=None, **options)``: the ``KVTransferConfig`` keyword
  arguments that plug an engine in (``python -m kachedb vllm-config`` prints them
  as JSON for ``vllm serve --kv-transfer-config``).
* ``kachedb.vllm.connector.KacheDBConnector``: vLLM's ``OffloadingConnector`` with
  failed-load reporting and eager stores; ``kachedb.vllm.spec.KacheDBOffloadingSpec``:
  the out-of-tree offloading spec (manager in the scheduler, worker in each GPU/CPU worker).
* ``stats()``: this process's counters (lookups, hits, stored/loaded/failed blocks, …).

Importing this package does not import vLLM or torch.
"""

from __future__ import annotations

from typing import Any, Dict

from .config import kv_transfer_config, resolve_socket
from .keys import LAYOUT_VERSION

__all__ = ["kv_transfer_config", "stats", "LAYOUT_VERSION", "resolve_socket"]


def stats() -> Dict[str, Any]:
    """Counters of the KacheDB tier in this process (the engine process in
    vLLM's in-process mode; the engine-core process otherwise)."""
    from ._state import snapshot

    return snapshot()
