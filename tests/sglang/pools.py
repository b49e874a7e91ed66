"""SGLang's real KV pools on CPU and the KacheDB backend built the way SGLang's
controller builds it (``StorageBackendFactory.create_backend("dynamic", …)``
with ``kachedb.sglang.hicache_config()`` as the extra config, then
``register_mem_pool_host``). Used by the tests in this process and by
``pool_proc.py`` in others."""

from __future__ import annotations

import json
from typing import Any, List, Optional

import torch

#: Small geometry: 4 tokens per page, 2 layers, 2 heads of 8, bfloat16.
PAGE_SIZE = 4
LAYERS = 2
HEADS = 2
HEAD_DIM = 8
DEVICE_TOKENS = 256


def device_pool() -> Any:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(
        size=DEVICE_TOKENS,
        page_size=PAGE_SIZE,
        dtype=torch.bfloat16,
        head_num=HEADS,
        head_dim=HEAD_DIM,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
        start_layer=0,
        end_layer=LAYERS,
    )


def host_pool(kv: Any, layout: str) -> Any:
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    return MHATokenToKVPoolHost(
        kv.get_device_pool_infos()[0].buffer_info,
        host_to_device_ratio=2.0,
        host_size=0,
        page_size=PAGE_SIZE,
        layout=layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=kv.size,
        start_layer=kv.start_layer,
        end_layer=kv.end_layer,
    )


def mla_device_pool() -> Any:
    """An MLA (DeepSeek-style latent KV) device pool: one latent vector per token
    and layer (kv_lora_rank 32 + rope 16), bfloat16."""
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    return MLATokenToKVPool(size=DEVICE_TOKENS, page_size=PAGE_SIZE, dtype=torch.bfloat16, kv_lora_rank=32,
                            qk_rope_head_dim=16, layer_num=LAYERS, device="cpu", enable_memory_saver=False,
                            start_layer=0, end_layer=LAYERS)


def mla_host_pool(kv: Any, layout: str) -> Any:
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    return MLATokenToKVPoolHost(
        kv.get_device_pool_infos()[0].buffer_info,
        host_to_device_ratio=2.0,
        host_size=0,
        page_size=PAGE_SIZE,
        layout=layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=kv.size,
        start_layer=0,
        end_layer=LAYERS,
        target_layer_num=LAYERS,
    )


def storage_config(extra: dict, *, model: str = "test-org/tiny-model", tp_rank: int = 0, tp_size: int = 1,
                   layout: str = "page_first", mla: bool = False) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=False,
        is_page_first_layout=layout == "page_first",
        model_name=model,
        # as SGLang parses --hicache-storage-backend-extra-config
        extra_config=json.loads(json.dumps(extra)),
    )


def backend(socket: str, host: Any, *, retry_seconds: Optional[float] = None, namespace: Optional[str] = None,
            tenant: Optional[str] = None, interface_v1: bool = True, **cfg: Any) -> Any:
    """The backend as SGLang's cache controller creates and registers it."""
    import kachedb.sglang
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    extra = kachedb.sglang.hicache_config(socket, retry_seconds=retry_seconds, namespace=namespace, tenant=tenant)
    if not interface_v1:
        extra.pop("interface_v1")
    conf = storage_config(extra, layout=host.layout, **cfg)
    b = StorageBackendFactory.create_backend("dynamic", conf, host)
    b.register_mem_pool_host(host)
    return b


def page_hashes(tokens: List[int], prior: Optional[str] = None) -> List[str]:
    """SGLang's own page keys (64-hex SHA-256, each chained from the previous page)."""
    from sglang.srt.mem_cache.utils import get_hash_str

    out = get_hash_str(tokens, prior, page_size=PAGE_SIZE)
    return list(out) if isinstance(out, (list, tuple)) else [out]


def fill_random(host: Any, indices: torch.Tensor, seed: int) -> None:
    """Random bytes in the host pool's slots ``indices`` (every layer, K and V)."""
    g = torch.Generator().manual_seed(seed)
    for start in range(0, len(indices), PAGE_SIZE):
        page = host.get_data_page(int(indices[start]), flat=True)
        data = torch.randn(page.numel(), generator=g).to(page.dtype)
        host.set_from_flat_data_page(int(indices[start]), data)


def pages_bytes(host: Any, indices: torch.Tensor) -> List[torch.Tensor]:
    """Each page's bytes in the host pool (its flat data page, copied)."""
    return [
        host.get_data_page(int(indices[s]), flat=True).contiguous().view(torch.uint8).clone()
        for s in range(0, len(indices), PAGE_SIZE)
    ]
