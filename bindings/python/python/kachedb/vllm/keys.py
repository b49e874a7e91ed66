"""Keys of vLLM KV blocks in KacheDB.

vLLM's block hashes identify a run of tokens (chained from the previous
block), not the model that computed its KV. A KacheDB key is therefore
``namespace || vLLM offload key``, where the namespace is a digest of
everything that makes the bytes of a block differ: model identity and its
config, dtype and KV-cache dtype, tokens per block and bytes per block, each
offloaded KV-cache group's spec (kind, block size, window, state shapes and
dtypes, Mamba type and cache mode, padded and unpadded page size: every field
vLLM's spec has, ``group_layout``), the tensor-parallel shard the block belongs
to and the world size, the KV layout and this module's layout version. Two
engines share blocks exactly when their namespaces are equal.

Tensor-parallel ranks whose KV is the same (``kv_tp_replicas`` consecutive
ranks: all of them for MLA, whose latent KV is replicated) share one namespace:
their blocks are stored once and read by each of them (``tp_shard``).

In the canonical layout (``canonical``: vLLM's canonical page format id, e.g.
``v1-hnd``) a block holds every KV head of its layers, as a TP=1 engine's page
does, whatever the engine's tensor-parallel degree: the namespace names that
format instead of the rank, the tensor-parallel degree or the world size, and
each group's layout with its heads and page sizes as one rank of TP=1 has them
(``canonical_group_layout``), so engines of any TP degree share its blocks.

Nothing here imports vLLM: the namespace is computed from plain values, which
the spec gathers from the engine's config.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import re
from typing import Any, Dict, Iterable, List, Mapping, Optional

from .._identity import canonical as _canonical
from .._identity import model_identity, weights_fingerprint

#: Version of the byte layout of a stored block (``(num_layers, page_bytes)``
#: raw bytes of the worker's KV pages, layers in vLLM's order). Bump when it
#: changes: old blocks then simply stop matching.
LAYOUT_VERSION = 1

#: Prefix mixed into every namespace, so that a KacheDB key of a vLLM block can
#: never equal a key some other user of the daemon chose.
_DOMAIN = b"kachedb.vllm.block/"


def namespace_fields(
    *,
    model: str,
    revision: Optional[str] = None,
    hf_config: Optional[Mapping[str, Any]] = None,
    config_file_sha256: Optional[str] = None,
    load_format: Optional[str] = None,
    seed: Optional[int] = None,
    quantization: Optional[str] = None,
    dtype: str,
    kv_cache_dtype: str,
    tokens_per_block: Iterable[int],
    bytes_per_block: int,
    page_bytes: Optional[Iterable[int]] = None,
    num_layers: Optional[int] = None,
    tp_rank: int,
    tp_size: int,
    kv_tp_replicas: int = 1,
    pp_size: int = 1,
    world_size: int = 1,
    kv_layout: Optional[str] = None,
    group_layouts: Optional[List[Mapping[str, Any]]] = None,
    hash_algo: Optional[str] = None,
    salt: Optional[str] = None,
    canonical: Optional[str] = None,
) -> Dict[str, Any]:
    """The fields a namespace digests, as a plain dict (also what
    ``kachedb.vllm.stats()`` reports, for debugging a miss). ``tp_rank`` is
    the worker's rank; with ``kv_tp_replicas`` > 1 the namespace names its
    shard (``tp_shard``: ranks ``shard * replicas ..`` hold the same KV) instead.
    With ``canonical`` (the canonical page format id) the fields name no rank,
    degree or world size: ``bytes_per_block`` and ``group_layouts`` are then the
    canonical (all-heads) ones."""
    replicas = max(1, int(kv_tp_replicas))
    config_digest = None
    if hf_config is not None:
        config_digest = hashlib.sha256(json.dumps(_canonical(hf_config), sort_keys=True).encode()).hexdigest()
    fields: Dict[str, Any] = {
        "layout_version": LAYOUT_VERSION,
        "model": model_identity(model, revision),
        "model_config_sha256": config_digest,
        # the file itself too: any rewrite of config.json is another model
        "config_file_sha256": config_file_sha256,
        "weights": weights_fingerprint(model),
        "load_format": load_format,
        # dummy weights depend on the seed; real weights do not
        "seed": seed if load_format == "dummy" else None,
        "quantization": quantization,
        "dtype": str(dtype).replace("torch.", ""),
        "kv_cache_dtype": str(kv_cache_dtype).replace("torch.", ""),
        "tokens_per_block": list(tokens_per_block),
        "bytes_per_block": int(bytes_per_block),
        "page_bytes": None if page_bytes is None else [int(p) for p in page_bytes],
        "num_layers": num_layers,
        # the ranks whose KV bytes these are: with replicas, every rank of a shard
        "tp_shard": int(tp_rank) // replicas,
        "kv_tp_replicas": replicas,
        "tp_size": int(tp_size),
        "pp_size": int(pp_size),
        "world_size": int(world_size),
        "kv_layout": kv_layout,
        "groups": None if group_layouts is None else [dict(g) for g in group_layouts],
        "hash_algo": hash_algo,
        "salt": salt,
    }
    if canonical is not None:
        # One layout for every parallel config: the block holds all heads.
        for k in ("tp_shard", "kv_tp_replicas", "tp_size", "pp_size", "world_size"):
            fields[k] = None
        fields["canonical_layout"] = str(canonical)
    return fields


#: A ``repr`` that names a memory address: the same value prints differently in
#: each process, so only its type may enter a namespace.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def plain(value: Any) -> Any:
    """``value`` as JSON values that are equal in every process exactly when
    the values are: dataclasses as their type name and fields, enums as their
    class and name, dtypes and other objects by ``str`` (an object whose text
    names an address by its type alone)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out: Dict[str, Any] = {"type": type(value).__name__}
        for f in dataclasses.fields(value):
            out[f.name] = plain(getattr(value, f.name))
        return out
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [plain(v) for v in value]
        return sorted(items, key=json.dumps) if isinstance(value, (set, frozenset)) else items
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    text = str(value)
    return type(value).__name__ if _ADDRESS.search(text) else text


def group_layout(group_id: int, layer_names: Iterable[str], kv_cache_spec: Any) -> Dict[str, Any]:
    """What the bytes of one offloaded KV-cache group depend on: its index, its
    layers, and its vLLM ``KVCacheSpec`` — every field (kind, block size,
    sliding window, head counts and sizes, dtype, state shapes and dtypes, Mamba
    type and cache mode, ...) and its padded and unpadded page sizes."""
    out: Dict[str, Any] = {"group_id": int(group_id), "layers": [str(n) for n in layer_names]}
    if kv_cache_spec is None:
        out["spec"] = None
        return out
    out["spec"] = plain(kv_cache_spec)
    for prop in ("page_size_bytes", "real_page_size_bytes"):
        try:
            out[prop] = int(getattr(kv_cache_spec, prop))
        except Exception:  # a spec without it, or one that cannot say
            out[prop] = None
    return out


def canonical_group_layout(layout: Mapping[str, Any], total_kv_heads: int, canonical_pages: Iterable[int]) -> Dict[str, Any]:
    """``layout`` (``group_layout``'s) as a TP=1 engine's rank has it: the
    spec's ``num_kv_heads`` is the model's total and the page sizes are the
    canonical pages' (the largest of its layers'), so every TP degree names the
    same layout."""
    out = dict(layout)
    pages = [int(p) for p in canonical_pages]
    spec = out.get("spec")
    if isinstance(spec, Mapping):
        spec = dict(spec)
        if "num_kv_heads" in spec:
            spec["num_kv_heads"] = int(total_kv_heads)
        for k in ("page_size_padded",):
            if spec.get(k) is not None:
                spec[k] = None
        out["spec"] = spec
    out["page_size_bytes"] = max(pages) if pages else None
    out["real_page_size_bytes"] = max(pages) if pages else None
    out["canonical_pages"] = pages
    return out


def namespace_digest(fields: Mapping[str, Any]) -> bytes:
    """16 bytes identifying ``fields`` (blake2b of their canonical JSON)."""
    blob = json.dumps(_canonical(fields), sort_keys=True, separators=(",", ":")).encode()
    return hashlib.blake2b(_DOMAIN + blob, digest_size=16).digest()


def block_key(namespace: bytes, offload_key: bytes) -> bytes:
    """The KacheDB key (``bytes``; the client hashes it to 128 bits) of the
    vLLM offload key (block hash + group index) in ``namespace``."""
    return namespace + bytes(offload_key)
