"""Helpers of the LMCache integration tests and benchmark: the daemon
(``engine_support.Daemon``; tests/ on ``sys.path``), a CPU implementation of
LMCache's GPU-connector interface, and an LMCache engine built around it.

LMCache's engine copies KV between the serving engine's cache and its
``MemoryObj`` chunks through a GPU connector; its ``MockGPUConnector`` copies
nothing. ``CPUKVConnector`` copies tensor slices of a CPU KV buffer laid out as
LMCache's chunks are (``[2, layers, tokens, heads * head_size]``), so a store
reads real bytes and a retrieve writes them back. Nothing here is part of the
product.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any, Dict, List, Optional

from engine_support import Daemon  # noqa: F401 (the tests' and the benchmark's S.Daemon)

#: The plugin name the tests register (``kachedb.lmcache.config()``'s default).
PLUGIN = "kachedb"
#: LMCache's name of the remote backend of that plugin.
REMOTE_BACKEND = f"RemoteBackend-{PLUGIN}"

# A small model's KV layout: (layers, 2, chunk tokens, kv heads, head size).
NUM_LAYERS = 4
NUM_HEADS = 2
HEAD_SIZE = 16
CHUNK_TOKENS = 16


# --- the engine side (imports LMCache and torch) ---------------------------


def prompt_tokens(n: int, seed: int) -> List[int]:
    """``n`` deterministic token ids."""
    out: List[int] = []
    i = 0
    while len(out) < n:
        d = hashlib.blake2b(f"tokens/{seed}/{i}".encode(), digest_size=64).digest()
        out.extend(int.from_bytes(d[j : j + 2], "little") % 32000 for j in range(0, 64, 2))
        i += 1
    return out[:n]


def prompt_kv(n: int, seed: int, layers: int = NUM_LAYERS, hidden: int = NUM_HEADS * HEAD_SIZE) -> Any:
    """The bfloat16 KV of ``n`` tokens, ``[2, layers, n, hidden]``: deterministic
    values (a stand-in for a model's prefill)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randn((2, layers, n, hidden), generator=g, dtype=torch.float32).to(torch.bfloat16)


def make_cpu_connector(layers: int = NUM_LAYERS, hidden: int = NUM_HEADS * HEAD_SIZE) -> Any:
    from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface

    class CPUKVConnector(GPUConnectorInterface):
        """Copies between a CPU KV buffer (``kv=`` keyword, ``[2, L, T, H*D]``) and
        LMCache's chunks (``MemoryFormat.KV_2LTD``, the same layout per chunk)."""

        def __init__(self) -> None:
            self.kvcaches = None

        def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
            memory_obj.tensor.copy_(kwargs["kv"][:, :, start:end, :])

        def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
            kwargs["kv"][:, :, start:end, :].copy_(memory_obj.tensor)

        def batched_from_gpu(self, memory_objs: Any, starts: List[int], ends: List[int], **kwargs: Any) -> None:
            for obj, s, e in zip(memory_objs, starts, ends):
                self.from_gpu(obj, s, e, **kwargs)

        def batched_to_gpu(self, memory_objs: Any = None, starts: Any = None, ends: Any = None, **kwargs: Any) -> None:
            for obj, s, e in zip(memory_objs, starts, ends):
                self.to_gpu(obj, s, e, **kwargs)

        def get_shape(self, num_tokens: int) -> Any:
            import torch

            return torch.Size([2, layers, num_tokens, hidden])

    return CPUKVConnector()


#: Head sizes of the two KV layer groups of the "grouped" model (layers 0-1, layers
#: 2-3): LMCache's ``KVLayerGroupsManager`` makes one group of each.
GROUP_HEAD_SIZES = (HEAD_SIZE, 2 * HEAD_SIZE)


def grouped_prompt_kv(n: int, seed: int) -> Any:
    """The grouped model's KV of ``n`` tokens: per group ``[2, 2 layers, n, heads * head size]``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randn((2, 2, n, NUM_HEADS * hs), generator=g).to(torch.bfloat16) for hs in GROUP_HEAD_SIZES]


def make_grouped_cpu_connector() -> Any:
    """``make_cpu_connector`` for a model of several KV layer groups: ``kv=`` is a
    list of per-group buffers, and a chunk holds one tensor per group."""
    from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface

    class GroupedCPUKVConnector(GPUConnectorInterface):
        def __init__(self) -> None:
            self.kvcaches = None

        def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
            for i, kv in enumerate(kwargs["kv"]):
                memory_obj.get_tensor(i).copy_(kv[:, :, start:end, :])

        def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
            for i, kv in enumerate(kwargs["kv"]):
                kv[:, :, start:end, :].copy_(memory_obj.get_tensor(i))

        def batched_from_gpu(self, memory_objs: Any, starts: List[int], ends: List[int], **kwargs: Any) -> None:
            for obj, s, e in zip(memory_objs, starts, ends):
                self.from_gpu(obj, s, e, **kwargs)

        def batched_to_gpu(self, memory_objs: Any = None, starts: Any = None, ends: Any = None, **kwargs: Any) -> None:
            for obj, s, e in zip(memory_objs, starts, ends):
                self.to_gpu(obj, s, e, **kwargs)

        def get_shape(self, num_tokens: int) -> Any:
            raise NotImplementedError("a grouped model's chunks have one shape per group")

    return GroupedCPUKVConnector()


def register_layer_groups(metadata: Any, num_blocks: int = 8) -> None:
    """What LMCache's vLLM GPU connector does on its first transfer
    (``VLLMPagedMemGPUConnectorV3._initialize_kv_cache_pointers``): discover the
    registered KV caches' layer groups and set ``metadata.kv_layer_groups_manager``.
    The caches are vLLM-shaped per-layer buffers ``[2, blocks, heads, block tokens,
    head size]`` of the grouped model (two head sizes)."""
    import torch
    from lmcache.v1.gpu_connector.utils import EngineType, normalize_and_discover_per_layer_formats
    from lmcache.v1.kv_layer_groups import KVLayerGroupsManager

    caches = [
        torch.zeros((2, num_blocks, NUM_HEADS, CHUNK_TOKENS, hs), dtype=torch.bfloat16)
        for hs in GROUP_HEAD_SIZES
        for _ in range(2)
    ]
    normalized, formats = normalize_and_discover_per_layer_formats(caches, [], EngineType.VLLM)
    metadata.kv_layer_groups_manager = KVLayerGroupsManager(
        list(normalized), engine_kv_formats=formats, lmcache_tokens_per_chunk=metadata.chunk_size
    )


def build_engine(
    instance_id: str,
    *,
    socket: Optional[str],
    model: str = "kachedb-test/tiny-llama",
    namespace: Optional[str] = None,
    tenant: Optional[str] = None,
    retry_seconds: Optional[float] = None,
    local_cpu_gib: float = 0.25,
    layers: int = NUM_LAYERS,
    heads: int = NUM_HEADS,
    head_size: int = HEAD_SIZE,
    chunk_tokens: int = CHUNK_TOKENS,
    gpu_connector: Any = None,
    max_pinned_bytes: Optional[int] = None,
) -> Any:
    """An LMCache engine (bfloat16 KV of ``layers`` x ``heads`` x ``head_size``,
    chunks of ``chunk_tokens``, a local CPU tier of ``local_cpu_gib``) with the
    KacheDB plugin at ``socket`` (``None``: the local CPU tier only; ``tenant``:
    its daemon tenant),
    post-initialised, as vLLM's LMCache connector does when the KV caches are
    registered. ``gpu_connector``: default ``make_cpu_connector``.
    ``max_pinned_bytes``: the plugin's option (default: the plugin's default)."""
    import torch
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata

    import kachedb.lmcache

    plugin: Dict[str, Any] = {}
    if socket is not None:
        pinned = {} if max_pinned_bytes is None else {"max_pinned_bytes": max_pinned_bytes}
        plugin = kachedb.lmcache.config(socket, namespace=namespace, tenant=tenant, retry_seconds=retry_seconds, **pinned)
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=chunk_tokens,
        local_cpu=True,
        max_local_cpu_size=local_cpu_gib,
        save_unfull_chunk=True,
        **plugin,
    )
    metadata = LMCacheMetadata(
        model_name=model,
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.bfloat16,
        kv_shape=(layers, 2, chunk_tokens, heads, head_size),
        chunk_size=chunk_tokens,
        role="worker",
    )
    engine = LMCacheEngineBuilder.get_or_create(
        instance_id,
        config,
        metadata,
        gpu_connector if gpu_connector is not None else make_cpu_connector(layers, heads * head_size),
        lambda t, r: None,
        lambda o, r: o,
    )
    engine.post_init()
    return engine


def kachedb_connector(engine: Any) -> Any:
    """The ``KacheDBConnector`` serving the engine's KacheDB backend (``None`` if
    LMCache built the backend without a connection)."""
    backend = engine.storage_manager.storage_backends.get(REMOTE_BACKEND)
    if backend is None or backend.connection is None:
        return None
    conn = backend.connection
    return conn.getWrappedConnector() if hasattr(conn, "getWrappedConnector") else conn


def chunk_keys(engine: Any, tokens: List[int]) -> List[Any]:
    """The ``CacheEngineKey``s of ``tokens``' chunks, in order."""
    return [key for _, _, key in engine.token_database.process_tokens(tokens=tokens)]


def clear_local(engine: Any, tokens: List[int], timeout_s: float = 30.0) -> None:
    """Empties the engine's local CPU tier until ``tokens`` are no longer in it
    (LMCache keeps a chunk whose remote put is still in flight referenced, and
    its ``clear`` skips referenced chunks)."""
    deadline = time.monotonic() + timeout_s
    while True:
        engine.clear(locations=["LocalCPUBackend"])
        if engine.lookup(tokens, search_range=["LocalCPUBackend"]) == 0:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"LMCache's local CPU tier still holds the prompt after {timeout_s} s")
        time.sleep(0.005)
