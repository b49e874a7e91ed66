"""What the scheduler-side manager and the worker read of the engine's
offloading spec (``spec.KacheDBOffloadingSpec`` builds it from vLLM's config):
the one interface between them, so that the spec depends on the manager and
the worker and neither depends on the spec."""

from __future__ import annotations

from typing import List, Optional, Protocol

#: How many blocks the KV events report as loadable from KacheDB at most at once
#: (``kv_events_max_blocks``; past it the oldest is reported removed): what the
#: scheduler keeps for them, and vLLM keeps each one's tokens.
DEFAULT_KV_EVENTS_MAX_BLOCKS = 65536


class EngineSpec(Protocol):
    """The engine's KacheDB settings and key namespace, as the manager and the
    worker use them (optional ones are read with ``getattr`` and a default)."""

    #: The daemon's control socket (``None``: the default path).
    socket: Optional[str]
    #: Seconds between reconnection attempts while the daemon is away.
    retry_s: float
    #: This worker's rank (0 on the scheduler side).
    rank: int
    #: ``"batched"`` (one RESERVE batch per store) or ``"reserve"`` (one per block).
    store_mode: str
    #: Where the stats file of ``kachedb.vllm.stats()`` goes (``None``: nowhere).
    stats_file: Optional[str]
    #: The first rank of each group of ranks holding the same KV.
    store_ranks: List[int]

    def daemon_key(self, offload_key: bytes, rank: Optional[int] = None) -> bytes:
        """The KacheDB key of vLLM's offload key in ``rank``'s namespace (default: this rank's)."""
        ...

