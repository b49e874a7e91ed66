"""``KacheDBOffloadingSpec``: the out-of-tree ``OffloadingSpec`` that vLLM's
``OffloadingConnector`` loads (``spec_name`` / ``spec_module_path`` in
``kv_connector_extra_config``). It builds the scheduler-side manager and the
worker-side transfer worker, and the namespace of the keys (``keys.py``)."""

from __future__ import annotations

import json
import os
import threading
from typing import Any, Dict, List, Optional

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingKVEventsConfig,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from .. import _identity
from .._link import engine_tenant
from . import keys as _keys
from .config import parse_store_thread
from .engine_spec import DEFAULT_KV_EVENTS_MAX_BLOCKS
from ._state import NAMESPACES

#: The engine config being built, set by ``KacheDBConnector`` around vLLM's
#: connector constructor (the spec only receives vLLM's normalised config).
_building = threading.local()


def _current_vllm_config() -> Any:
    cfg = getattr(_building, "vllm_config", None)
    if cfg is not None:
        return cfg
    try:
        from vllm.config.vllm import get_current_vllm_config_or_none  # type: ignore

        return get_current_vllm_config_or_none()
    except Exception:
        return None


def _current_kv_cache_config() -> Any:
    return getattr(_building, "kv_cache_config", None)


def kv_tp_replicas(vllm_config: Any, kv_cache_config: Any, tp_size: int, pp_size: int, world_size: int) -> int:
    """How many consecutive tensor-parallel ranks hold the same KV bytes (vLLM's
    ``KVCacheConfig.kv_tp_replicas``: all ``tp_size`` for MLA, whose latent KV
    is not split by head; 1 for attention split by head). Only for a TP-only
    world (no pipeline or context parallelism): anything else is 1 (every rank
    stores its own blocks, which is always correct)."""
    if tp_size <= 1 or pp_size != 1 or world_size != tp_size:
        return 1
    pc = getattr(vllm_config, "parallel_config", None)
    for axis in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if int(getattr(pc, axis, 1) or 1) != 1:
            return 1
    replicas = getattr(kv_cache_config, "kv_tp_replicas", None)
    if replicas is None:  # a KV-cache config without it: MLA is replicated on every TP rank
        mc = getattr(vllm_config, "model_config", None)
        replicas = tp_size if bool(getattr(mc, "use_mla", False)) else 1
    replicas = int(replicas)
    if replicas < 1 or tp_size % replicas:
        return 1
    return replicas


def _layer_specs(kv_cache_config: Any, group: Any) -> List[Any]:
    """The ``KVCacheSpec`` of each layer of offloaded ``group``, in its order."""
    spec = kv_cache_config.kv_cache_groups[int(group.group_id)].kv_cache_spec
    per_layer = getattr(spec, "kv_cache_specs", None) or {}
    return [per_layer.get(name, spec) for name in group.layer_names]


def canonical_page_bytes(layer_spec: Any, total_kv_heads: int) -> int:
    """The bytes of one layer's canonical page (vLLM's canonical layout: every
    KV head, as one TP=1 rank holds them): an attention page times the head
    shards it is one of; MLA's latent page as it is (replicated, not split)."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    page = int(layer_spec.real_page_size_bytes)
    if isinstance(layer_spec, MLAAttentionSpec):
        return page
    local = int(getattr(layer_spec, "num_kv_heads", 0) or 0)
    if local < 1 or total_kv_heads % local:
        raise RuntimeError(
            f"KacheDB: a layer of {local} KV heads in a model of {total_kv_heads} has no canonical page"
        )
    return page * (total_kv_heads // local)


def _total_kv_heads(vllm_config: Any, model: str) -> int:
    """The model's KV heads over all ranks (vLLM's ``get_total_num_kv_heads``;
    without an engine config, the model's ``config.json``)."""
    if vllm_config is not None:
        return int(vllm_config.model_config.get_total_num_kv_heads())
    hf = _hf_config_dict(None, model) or {}
    heads = hf.get("num_key_value_heads") or hf.get("num_attention_heads")
    if not heads:
        raise RuntimeError(f"the model's config names no KV head count ({model})")
    return int(heads)


def canonical_format(config: Any, vllm_config: Any) -> Optional[str]:
    """vLLM's canonical page format id (``canonical_format_id``, e.g.
    ``v1-hnd``) when the engine runs in the canonical layout: asked for with
    ``canonical_layout: true`` in ``kv_connector_extra_config`` (vLLM's option)
    and certified by vLLM for this model and parallel config
    (``is_parallelism_agnostic``); otherwise ``None`` (blocks per rank)."""
    if not bool(getattr(config, "canonical_layout", False)):
        return None
    import logging

    log = logging.getLogger("kachedb.vllm")
    if not bool(getattr(config.parallel, "is_parallelism_agnostic", False)):
        log.warning(
            "KacheDB: canonical_layout asked for, but vLLM does not certify this model's KV layout as the same "
            "under every parallel config (a non-attention group, context parallelism, ...): blocks are stored "
            "per tensor-parallel rank and shared only with engines of this degree"
        )
        return None
    layout = getattr(config, "kv_cache_layout", None)
    if layout is None and vllm_config is not None:
        layout = getattr(getattr(vllm_config, "cache_config", None), "kv_cache_layout", None)
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import (  # type: ignore
            canonical_format_id,
        )

        return canonical_format_id(str(layout))
    except Exception as e:  # a vLLM without it, a layout it does not name
        log.warning("KacheDB: no canonical page format for KV layout %r (%s): blocks are stored per rank", layout, e)
        return None


def group_layouts(kv_cache_config: Any, groups: Any) -> List[Dict[str, Any]]:
    """Each offloaded group's layout (``keys.group_layout``), its spec taken
    from vLLM's ``KVCacheConfig`` (``kv_cache_groups[group_id]``). Without a
    KV-cache config (a vLLM that does not hand it to the connector) the engine
    cannot name its groups' layouts, and refuses to start rather than share
    blocks whose layout it cannot tell apart."""
    kv_groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if kv_groups is None:
        raise RuntimeError(
            "KacheDB: vLLM gave the connector no KV-cache config, so the keys cannot name each KV-cache "
            "group's layout (state dtypes, windows, page sizes); this vLLM is not supported"
        )
    out = []
    for g in groups:
        gid = int(g.group_id)
        if not 0 <= gid < len(kv_groups):
            raise RuntimeError(f"KacheDB: offloaded group {gid} is not in vLLM's KV-cache config ({len(kv_groups)} groups)")
        out.append(_keys.group_layout(gid, g.layer_names, kv_groups[gid].kv_cache_spec))
    return out


def _hf_config_dict(vllm_config: Any, model: str) -> Optional[Dict[str, Any]]:
    if vllm_config is not None:
        try:
            return vllm_config.model_config.hf_config.to_dict()
        except Exception:
            pass
    path = os.path.join(model, "config.json")
    if os.path.isfile(path):
        with open(path) as f:
            return json.load(f)
    return None


class KacheDBOffloadingSpec(OffloadingSpec):
    """Offloads vLLM's KV blocks to a KacheDB daemon shared by every engine on the node.

    ``kv_connector_extra_config`` options (all optional; ``kachedb.vllm.kv_transfer_config``
    writes them): ``socket`` (the daemon's control socket; default as ``kachedb.connect``),
    ``namespace`` (a salt mixed into every key: engines share blocks only with the same salt),
    ``store_mode`` (``"batched"``: one RESERVE and one COMMIT batch per step, the default;
    ``"reserve"``: one reservation per block, written in place), ``retry_seconds`` (how often a
    missing daemon is retried, default 5), ``stats_file`` (a JSON file the worker writes its
    counters to at shutdown), ``tenant`` (the daemon tenant the engine's clients connect as;
    default: the ``namespace`` label, else the daemon's ``default``), ``kv_events_max_blocks``
    (how many blocks the KV events report at most at once, default 65536),
    ``self_describing_kv_events`` (vLLM's option; default true here: the events carry each
    block's tokens and parent hash), ``store_thread`` (CPU: where stores run; ``"auto"``,
    the default: on the worker's store thread, off the step, where the engine keeps
    stepping until they are reported — vLLM's engine-core process — and inside the
    step in vLLM's in-process engine; ``true``: always on the thread; ``false``:
    always inside the step; see the worker), ``canonical_layout`` (vLLM's option:
    blocks hold every KV head, shared by engines of any tensor-parallel degree;
    ``canonical_format``).
    """

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        if self.blocks_per_chunk != 1:
            raise ValueError(
                "KacheDB stores one key per vLLM block: leave 'block_size' / 'blocks_per_chunk' out of "
                f"kv_connector_extra_config (got blocks_per_chunk={self.blocks_per_chunk})"
            )
        extra = self.extra_config
        self.socket: Optional[str] = extra.get("socket") or None
        self.store_mode: str = str(extra.get("store_mode", "batched"))
        if self.store_mode not in ("batched", "reserve"):
            raise ValueError(f"store_mode must be 'batched' or 'reserve', not {self.store_mode!r}")
        self.retry_s: float = float(extra.get("retry_seconds", 5.0))
        self.store_thread: Any = parse_store_thread(extra.get("store_thread", "auto"))
        self.stats_file: Optional[str] = extra.get("stats_file") or None
        self.tenant: Optional[str] = engine_tenant(extra.get("tenant"), extra.get("namespace"))
        self.kv_events_max_blocks: int = int(extra.get("kv_events_max_blocks", DEFAULT_KV_EVENTS_MAX_BLOCKS))
        if self.kv_events_max_blocks < 1:
            raise ValueError(f"kv_events_max_blocks must be >= 1, not {self.kv_events_max_blocks}")
        # KV events (--kv-events-config) carry each block's tokens and parent hash
        # unless the engine says otherwise: a router needs them to place a block.
        self.kv_events_config = OffloadingKVEventsConfig(
            enable_kv_cache_events=bool(config.enable_kv_cache_events),
            self_describing_kv_events=bool(extra.get("self_describing_kv_events", True)),
        )
        self.rank: int = config.parallel.rank
        self.world_size: int = max(1, config.parallel.world_size)

        vc = _current_vllm_config()
        kv_cfg = _current_kv_cache_config()
        #: vLLM's canonical page format id when blocks hold every KV head (any TP
        #: degree shares them: the scheduler reserves each block, every rank writes
        #: its heads in place, the scheduler commits; ``canonical_format``), else ``None``.
        self.canonical: Optional[str] = canonical_format(config, vc)
        #: Per offloaded group (in ``config.groups``' order), the canonical page
        #: bytes of each layer (canonical layout only).
        self.canonical_pages: List[List[int]] = []
        #: The position in ``config.groups`` of each offloaded group id.
        self.group_positions: Dict[int, int] = {int(g.group_id): i for i, g in enumerate(config.groups)}
        total_kv_heads = 0
        if self.canonical is not None:
            try:
                total_kv_heads = _total_kv_heads(vc, config.model.name)
                self.canonical_pages = [
                    [canonical_page_bytes(ls, total_kv_heads) for ls in _layer_specs(kv_cfg, g)] for g in config.groups
                ]
            except Exception as e:
                raise RuntimeError(f"KacheDB: the canonical layout's page sizes cannot be told ({e})") from e
        model = config.model.name
        revision = quantization = load_format = seed = hash_algo = None
        model_dtype = config.model.dtype
        if vc is not None:
            mc = vc.model_config
            revision = getattr(mc, "revision", None)
            quantization = getattr(mc, "quantization", None)
            model_dtype = str(getattr(mc, "dtype", model_dtype))
            seed = getattr(mc, "seed", None)
            load_format = str(getattr(vc.load_config, "load_format", None))
            hash_algo = str(getattr(vc.cache_config, "prefix_caching_hash_algo", None))
        num_layers = sum(len(g.layer_names) for g in config.groups)
        #: Consecutive ranks holding the same KV: one namespace, stored once (by
        #: the first rank of each such group), read by every one of them.
        self.kv_tp_replicas: int = kv_tp_replicas(
            vc, kv_cfg, config.parallel.tp_size, config.parallel.pp_size, self.world_size
        )
        #: The first rank of each group of ranks holding the same KV: the ranks
        #: whose keys a lookup or a store decision looks at.
        self.store_ranks = list(range(0, self.world_size, self.kv_tp_replicas))
        #: Whether this worker writes its blocks (the other ranks of its group read them).
        self.is_store_writer: bool = self.rank % self.kv_tp_replicas == 0
        layouts = group_layouts(kv_cfg, config.groups)
        bytes_per_block = config.worker_kv_bytes_per_block
        if self.canonical is not None:
            # One block per vLLM block for all ranks: one namespace, every rank a writer of its heads.
            self.store_ranks = [0]
            self.is_store_writer = True
            layouts = [
                _keys.canonical_group_layout(lay, total_kv_heads, pages)
                for lay, pages in zip(layouts, self.canonical_pages)
            ]
            bytes_per_block = sum(sum(p) for p in self.canonical_pages)
        self._fields = {
            rank: _keys.namespace_fields(
                model=model,
                revision=revision,
                hf_config=_hf_config_dict(vc, model),
                config_file_sha256=_identity.config_file_digest(model),
                load_format=load_format,
                seed=seed,
                quantization=quantization,
                dtype=model_dtype,
                kv_cache_dtype=config.model.dtype,
                tokens_per_block=self.tokens_per_block,
                bytes_per_block=bytes_per_block,
                num_layers=num_layers,
                tp_rank=rank,
                tp_size=config.parallel.tp_size,
                kv_tp_replicas=self.kv_tp_replicas,
                pp_size=config.parallel.pp_size,
                world_size=self.world_size,
                kv_layout=f"{config.kv_cache_layout or 'default'}/groups={len(config.groups)}",
                group_layouts=layouts,
                hash_algo=hash_algo,
                salt=extra.get("namespace"),
                canonical=self.canonical,
            )
            for rank in range(self.world_size)
        }
        self.namespaces = {rank: _keys.namespace_digest(f) for rank, f in self._fields.items()}
        if hash_algo and hash_algo.startswith("xxhash") and os.environ.get("PYTHONHASHSEED") is None:
            import logging

            logging.getLogger("kachedb.vllm").warning(
                "prefix_caching_hash_algo=%s without PYTHONHASHSEED: vLLM seeds its block hashes at random in "
                "each process, so this engine shares no KacheDB blocks with any other; set the same "
                "PYTHONHASHSEED in every engine, or use sha256 / sha256_cbor",
                hash_algo,
            )
        NAMESPACES[f"rank{self.rank}"] = dict(
            self._fields[self.rank], digest=self.namespaces[self.rank].hex(), store_writer=self.is_store_writer
        )
        self._manager: Optional[OffloadingManager] = None
        self._worker: Optional[OffloadingWorker] = None

    def daemon_key(self, offload_key: bytes, rank: Optional[int] = None) -> bytes:
        return _keys.block_key(self.namespaces[self.rank if rank is None else rank], offload_key)

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            from .manager import KacheDBOffloadingManager

            self._manager = KacheDBOffloadingManager(self)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            from .worker import KacheDBOffloadingWorker

            self._worker = KacheDBOffloadingWorker(self, kv_caches)
        return self._worker
