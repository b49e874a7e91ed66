"""Keys of SGLang HiCache pages in KacheDB.

SGLang names a page by a 64-hex SHA-256 of its tokens chained from the
previous page: it says which tokens, not whose KV. A KacheDB key is therefore
``namespace || page key`` (the UTF-8 of SGLang's key string), where the
namespace is a 16-byte digest of everything that makes a page's bytes differ:
the server's settings that change KV values (``SERVER_FIELDS``: model path and
revision, load format, config overrides, dtype, quantization, KV-cache dtype,
...), the model (its identity, config and weight files), the host pool's geometry
(class, layout, dtype, tokens per page, layers, heads, head sizes), the
tensor-, pipeline- and context-parallel ranks that own the page's shard, the
interface that wrote it (zero-copy v1 pages and the generic interface's flat
pages are laid out differently), this module's layout version and an optional
salt. Two SGLang servers share pages exactly when their namespaces are equal.

Nothing here imports SGLang: the fields are gathered from plain values.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Dict, Mapping, Optional

from .._identity import canonical as _canonical
from .._identity import config_file_digest, model_identity, weights_fingerprint

#: Version of the byte layout of a stored page (v1: the byte ranges
#: ``get_page_buffer_meta`` returns for the page, concatenated in its order;
#: generic: the host pool's flat data page). Bump when it changes: old pages
#: then simply stop matching.
LAYOUT_VERSION = 1

#: Prefix mixed into every namespace, so that a KacheDB key of an SGLang page
#: can never equal a key some other user of the daemon chose.
_DOMAIN = b"kachedb.sglang.page/"

#: Host-pool attributes that fix the bytes of a page (absent ones are recorded as None).
POOL_FIELDS = (
    "layout",
    "dtype",
    "page_size",
    "layer_num",
    "start_layer",
    "end_layer",
    "head_num",
    "head_dim",
    "v_head_dim",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "storage_format_tag",
)


#: SGLang server arguments (``ServerArgs``, as resolved in the scheduler process)
#: that change the KV values a server computes for the same tokens while the
#: host pool's geometry and dtype can stay equal. docs/sglang.md says why each
#: is here.
SERVER_FIELDS = (
    "model_path",
    "revision",
    "load_format",
    "model_loader_extra_config",
    "json_model_override_args",
    "model_impl",
    "dtype",
    "quantization",
    "quantization_param_path",
    "modelopt_quant",
    "modelopt_checkpoint_restore_path",
    "quantize_and_serve",
    "kv_cache_dtype",
    "enable_tf32_matmul",
    "rl_on_policy_target",
    "enable_lora",
    "lora_paths",
)


def server_fields(server_args: Optional[Mapping[str, Any]]) -> Optional[Dict[str, Any]]:
    """``SERVER_FIELDS`` of SGLang's resolved server arguments (a mapping of
    field name to value), plus ``random_seed`` for dummy weights (their values
    come from it); ``None`` when the process has no server arguments."""
    if server_args is None:
        return None
    out = {name: _canonical(server_args.get(name)) for name in SERVER_FIELDS}
    out["random_seed"] = server_args.get("random_seed") if str(server_args.get("load_format")) == "dummy" else None
    return out


def pool_fields(host_pool: Any) -> Dict[str, Any]:
    """The page geometry of an SGLang host pool (``HostKVCache``)."""
    out: Dict[str, Any] = {"class": type(host_pool).__name__}
    for name in POOL_FIELDS:
        v = getattr(host_pool, name, None)
        out[name] = v if v is None or isinstance(v, (bool, int, float, str)) else str(v).replace("torch.", "")
    return out


def namespace_fields(
    storage_config: Any,
    host_pool: Any,
    *,
    interface: str,
    salt: Optional[str] = None,
    server_args: Optional[Mapping[str, Any]] = None,
) -> Dict[str, Any]:
    """The fields a namespace digests (also what ``KacheDBStorage.kachedb_stats()``
    reports, for debugging a miss). ``storage_config`` is SGLang's
    ``HiCacheStorageConfig``; ``host_pool`` the registered host pool (or None);
    ``server_args`` the server's resolved arguments as a mapping (``None``
    outside a server: the namespace then says so, and matches only others
    without them)."""
    c = storage_config
    server = server_fields(server_args)
    # The model's files: the server's model path when there is one (the storage
    # config's model name can carry a page-format tag).
    model = (server or {}).get("model_path") or getattr(c, "model_name", None) or ""
    revision = (server or {}).get("revision")
    replicated = bool(getattr(c, "is_mla_model", False))  # MLA KV is the same on every TP rank
    return {
        "layout_version": LAYOUT_VERSION,
        "interface": interface,
        "server": server,
        "model_name": getattr(c, "model_name", None) or "",
        "model": model_identity(model, revision) if model else None,
        "config_file_sha256": config_file_digest(model) if model else None,
        "weights": weights_fingerprint(model) if model else [],
        "rank_replicated": replicated,
        "tp_rank": None if replicated else int(c.tp_rank),
        "tp_size": int(c.tp_size),
        "pp_rank": int(c.pp_rank),
        "pp_size": int(c.pp_size),
        "attn_cp_rank": int(getattr(c, "attn_cp_rank", 0)),
        "attn_cp_size": int(getattr(c, "attn_cp_size", 1)),
        "dcp_rank": int(getattr(c, "dcp_rank", 0)),
        "dcp_size": int(getattr(c, "dcp_size", 1)),
        "should_split_heads": bool(getattr(c, "should_split_heads", False)),
        "tp_lcm_size": getattr(c, "tp_lcm_size", None),
        "pool": None if host_pool is None else pool_fields(host_pool),
        "salt": salt,
    }


def namespace_digest(fields: Mapping[str, Any]) -> bytes:
    """16 bytes identifying ``fields`` (blake2b of their canonical JSON)."""
    blob = json.dumps(_canonical(fields), sort_keys=True, separators=(",", ":")).encode()
    return hashlib.blake2b(_DOMAIN + blob, digest_size=16).digest()


def page_key(namespace: bytes, key: str) -> bytes:
    """The KacheDB key (``bytes``; the client hashes it to 128 bits) of SGLang's
    page key ``key`` in ``namespace``."""
    return namespace + key.encode("utf-8")
