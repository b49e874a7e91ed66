"""SGLang's real KV pools on CPU and the KacheDB backend built the way SGLang's
controller builds it (``StorageBackendFactory.create_backend("dynamic", …)``
with ``kachedb.sglang.hicache_config()`` as the extra config, then
``register_mem_pool_host``), in a process where SGLang's ``ServerArgs`` are
published the way its scheduler process publishes them
(``runtime_context.publish(server_args, role="scheduler")``): the backend
reads the server's settings from there, and shares nothing without them. Used
by the tests in this process and by ``pool_proc.py`` / ``identity_proc.py`` in
others."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

#: Small geometry: 4 tokens per page, 2 layers, 2 heads of 8, bfloat16.
PAGE_SIZE = 4
LAYERS = 2
HEADS = 2
HEAD_DIM = 8
DEVICE_TOKENS = 256

#: The model name of the storage config (and of the model directory the
#: published server arguments point at) unless a test names another.
MODEL = "test-org/tiny-model"


def model_dir(name: str = MODEL) -> str:
    """A config-only Llama directory standing for model ``name`` (SGLang's
    ``ServerArgs`` read its config.json; no weights), of the pools' geometry.
    Its path depends on ``name`` alone, so that every process of a test gets
    the same one (the backend's namespace holds the model directory's real path
    and config digest)."""
    root = Path(tempfile.gettempdir()) / f"kachedb-sglang-models-{os.getuid()}"
    path = root / name.replace("/", "--")
    if (path / "config.json").exists():
        return str(path)
    from transformers import LlamaConfig

    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".new-"))
    LlamaConfig(vocab_size=512, hidden_size=HEADS * 2 * HEAD_DIM, intermediate_size=64, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS * 2, num_key_value_heads=HEADS, architectures=["LlamaForCausalLM"],
                torch_dtype="bfloat16").save_pretrained(tmp)
    try:
        tmp.rename(path)
    except OSError:  # another process made it first
        shutil.rmtree(tmp, ignore_errors=True)
    return str(path)


def publish_server_args(model: str = MODEL, **args: Any) -> Any:
    """Publishes SGLang's ``ServerArgs`` for ``model`` (``model_dir(model)``,
    device cpu, and ``args``: e.g. ``dtype``, ``quantization``) in this process,
    as SGLang's scheduler process does before it builds its cache controller
    (``run_scheduler_process``: ``publish(server_args, role="scheduler")``; a
    later publish replaces it). Returns the ``ServerArgs``."""
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(model_path=model_dir(model), device="cpu", **args)
    publish(server_args, role="scheduler")
    return server_args


def unpublish_server_args() -> None:
    """Leaves this process without published server arguments (SGLang's
    ``runtime_context.reset_context``), as any process that is not an SGLang
    scheduler."""
    from sglang.srt.runtime_context import reset_context

    reset_context()


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


def storage_config(extra: dict, *, model: str = MODEL, tp_rank: int = 0, tp_size: int = 1,
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
            tenant: Optional[str] = None, interface_v1: bool = True, model: str = MODEL,
            server_args: Optional[Dict[str, Any]] = None, publish: bool = True,
            extra: Optional[Dict[str, Any]] = None, **cfg: Any) -> Any:
    """The backend as SGLang's cache controller creates and registers it, in a
    scheduler process: ``publish`` (default) first publishes the server
    arguments of ``model`` with ``server_args`` (``publish_server_args``);
    ``publish=False`` leaves the process's published arguments as they are
    (none, in a process that never published). ``extra``: more entries of the
    extra config (e.g. ``no_server_args``)."""
    import kachedb.sglang
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    if publish:
        publish_server_args(model, **(server_args or {}))
    extra_config = kachedb.sglang.hicache_config(socket, retry_seconds=retry_seconds, namespace=namespace,
                                                 tenant=tenant, **(extra or {}))
    if not interface_v1:
        extra_config.pop("interface_v1")
    conf = storage_config(extra_config, model=model, layout=host.layout, **cfg)
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
