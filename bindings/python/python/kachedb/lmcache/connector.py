"""LMCache's remote storage interface over the KacheDB daemon.

``KacheDBConnectorAdapter`` is what LMCache's plugin loader instantiates
(``remote_storage_plugin.<name>.module_path`` / ``.class_name``); for the URL
``plugin://kachedb`` (or ``plugin://kachedb.<instance>``) it creates a
``KacheDBConnector``, LMCache's ``RemoteConnector``, which LMCache wraps in its
``RemoteBackend``. ``KacheDBConnector`` itself is also accepted as the class
name (LMCache then builds it through its own dynamic adapter).

A stored chunk is one 1-D uint8 KacheDB block holding the ``MemoryObj``'s bytes
(``keys.LAYOUT_VERSION``); its length says how many tokens it holds, so a
partial last chunk needs no side metadata. Keys: ``keys.chunk_key``.

The operations map onto the store as follows: ``exists``/``exists_sync`` and the
leading-prefix counts (``batched_contains``, ``batched_async_contains``) are one
LOOKUP; ``put``/``batched_put`` commit the chunks whose ``MemoryObj`` is a
reservation in the daemon's region (``region.RegionAllocator``, LMCache's chunk
allocator while this connector runs) under their keys in one batch, with no
copy, and store the others with one ``put_many`` (one RESERVE batch, the copies,
one COMMIT batch; chunks already present at the head of the batch are skipped);
``get``/``batched_get``/``batched_get_non_blocking`` are one
``get_prefix`` (lookup-and-pin of the leading present chunks), each chunk
returned as a ``MemoryObj`` that is its view of shared memory (``views.ViewPins``:
no copy; the block stays pinned while LMCache holds the object, within
``max_pinned_bytes``), or, past that budget and on engines whose KV cache is not
on the CPU, copied into a ``MemoryObj`` allocated from LMCache's local CPU
backend (its view dropped at once, and its pin with it).

Reference counts follow LMCache's contract: a ``MemoryObj`` given to ``put`` /
``batched_put`` is LMCache's, which drops its reference when the call returns
(this module never does); a ``MemoryObj`` returned by a get is the caller's.

Failures never reach the engine as wrong KV: a chunk whose size is not a whole
number of tokens is a miss; a full store skips the store; a daemon that is gone
turns every operation into a miss or a skipped store until it answers again
(tried at most every ``retry_seconds``). The calls are short (shared-memory
copies and one ring round trip); gets and stores in place run on the engine's
thread (``direct.py``), the rest on LMCache's event-loop thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any, List, Optional, Sequence

import torch

import kachedb
from lmcache import torch_device_type
from lmcache.utils import CacheEngineKey, get_size_bytes
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.connector import ConnectorAdapter, ConnectorContext, extract_plugin_type
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

from .._link import DaemonLink, engine_tenant
from .._meta import MAX_META_TOKENS
from ._stats import COUNTERS
from . import direct, records
from .records import chain_parents
from .config import PLUGIN_TYPE, option_key, resolve_socket
from .keys import chunk_key, namespace_digest, namespace_fields
from .region import RegionAllocator
from .views import ViewPins

logger = logging.getLogger("kachedb.lmcache")

#: ``_layout_source`` before the first ``_refresh_layout``.
_UNSET = object()

_PLUGIN_SCHEME = "plugin://"

def _log_once(tag: str, msg: str, *args: Any) -> None:
    if COUNTERS[f"logged_{tag}"] == 0:
        logger.warning(msg, *args)
    COUNTERS[f"logged_{tag}"] += 1


def _bytes_of(memory_obj: MemoryObj) -> Any:
    """The ``MemoryObj``'s logical bytes: a 1-D uint8 tensor view (no copy) of a
    tensor-backed object, else its byte buffer."""
    raw = getattr(memory_obj, "raw_data", None)
    n = memory_obj.get_size()
    if isinstance(raw, torch.Tensor) and raw.device.type == "cpu" and raw.is_contiguous():
        flat = raw.view(-1) if raw.dtype == torch.uint8 else raw.reshape(-1).view(torch.uint8)
        return flat[:n]
    return memoryview(memory_obj.byte_array)[:n]


def _links(items: Sequence[Any]) -> List[Optional[Any]]:
    """What chains each stored item ``(key, obj, CacheEngineKey, meta)``: its
    record, or else what ``records`` remembers of its hash (a chunk keyed by a
    hash LMCache was handed: its parent, no tokens), or ``None``."""
    return [x[3] if x[3] is not None else records.link(getattr(x[2], "chunk_hash", None)) for x in items]


def _nbytes(value: Any) -> int:
    """The byte count of a chunk's bytes (``_bytes_of``)."""
    return int(value.numel()) if isinstance(value, torch.Tensor) else len(value)


class KacheDBConnector(RemoteConnector):
    """LMCache's ``RemoteConnector`` over the KacheDB daemon (see the module doc)."""

    #: ``direct.py`` routes a backend's blocking calls to this connector's
    #: ``load_now`` / ``store_now`` (a subclass that does not serve them sets False).
    SERVES_DIRECT_CALLS = True

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        local_cpu_backend: LocalCPUBackend,
        config: Optional[LMCacheEngineConfig],
        metadata: Optional[LMCacheMetadata] = None,
        plugin_name: Optional[str] = None,
    ) -> None:
        if config is None:
            config = local_cpu_backend.config
        if metadata is None:
            metadata = local_cpu_backend.metadata
        if config.use_layerwise:
            raise ValueError("the KacheDB LMCache plugin stores whole chunks: use_layerwise=True is not supported")
        if (config.remote_serde or "naive") != "naive":
            raise ValueError(
                f"the KacheDB LMCache plugin stores the raw KV bytes: remote_serde must be 'naive', not {config.remote_serde!r}"
            )
        super().__init__(config, metadata)
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.metadata = metadata
        self.plugin_name = plugin_name or PLUGIN_TYPE
        extra = config.extra_config or {}

        def opt(name: str, default: Any = None) -> Any:
            return extra.get(option_key(self.plugin_name, name), default)

        self.socket = resolve_socket(opt("socket"))
        self.salt = opt("namespace")
        #: The daemon tenant this plugin's client connects as.
        self.tenant = engine_tenant(opt("tenant"), self.salt, option_key(self.plugin_name, "tenant"))
        # Chunks got are views of shared memory (no copy) when the engine's KV
        # cache is host memory: a device transfer needs LMCache's pinned host
        # buffers as its source, so there a got chunk is copied into one.
        default_pinned = int(float(config.max_local_cpu_size or 0) * (1 << 30))
        max_pinned = int(opt("max_pinned_bytes", default_pinned))
        if max_pinned < 0:
            raise ValueError(f"remote_storage_plugin.{self.plugin_name}.max_pinned_bytes must be >= 0, not {max_pinned}")
        self.views: Optional[ViewPins] = (
            ViewPins(max_pinned, local_cpu_backend) if max_pinned > 0 and str(torch_device_type) == "cpu" else None
        )
        self._layout_source: Any = _UNSET
        self._refresh_layout()
        self._link = DaemonLink(
            self.socket, logger=logger, label="LMCache", role=f"plugin {self.plugin_name}",
            retry_s=float(opt("retry_seconds", 5.0)), counters=COUNTERS, tenant=self.tenant,
        )
        # A daemon that does not answer now fails the build: LMCache logs it and
        # serves from its other tiers (and retries the connection later).
        self._link.connect()
        # LMCache's remote backend calls this connector's gets and in-place
        # stores on the engine's thread, not through its event loop (direct.py).
        direct.install()
        #: LMCache's token hashing is watched: stored chunks carry their tokens
        #: and parents to the daemon's KV events (records.py).
        self.records = records.watch()
        # Chunks LMCache stores are allocated in the daemon's region, so a
        # store commits them in place (region.py); on the same terms as views.
        self.region: Optional[RegionAllocator] = None
        if self.views is not None and local_cpu_backend is not None:
            current = local_cpu_backend.memory_allocator
            original = current.original if isinstance(current, RegionAllocator) else current
            self.region = RegionAllocator(
                original, self._link.current, self._fits_alloc, self.views, lambda: self.full_chunk_size_bytes
            )
            local_cpu_backend.memory_allocator = self.region
        logger.info(
            "KacheDB tier %s on %s (namespace %s, %d bytes per full chunk)",
            self.plugin_name,
            self.socket,
            self.namespace.hex(),
            self.full_chunk_size_bytes,
        )

    # -- layout ----------------------------------------------------------
    def _refresh_layout(self) -> None:
        """The chunk layout (format, shapes and dtypes of a full chunk) and the
        namespace, from LMCache's metadata as it is now. LMCache builds this
        connector when the engine is post-initialised, before the serving engine's
        GPU connector has registered the KV caches' layer groups
        (``metadata.kv_layer_groups_manager``, set on its first transfer); until
        then ``get_shapes()`` describes the model config's single-group guess.
        Every operation calls this first, so once the groups are registered the
        namespace and sizes are the final ones: chunks are never stored or looked
        up under a layout they are not in."""
        source = getattr(self.metadata, "kv_layer_groups_manager", None)
        if source is self._layout_source:
            return
        first = self._layout_source is _UNSET
        self._layout_source = source
        self.meta_shapes = self.metadata.get_shapes()
        self.meta_dtypes = self.metadata.get_dtypes()
        self.meta_fmt = MemoryFormat.KV_MLA_FMT if self.metadata.use_mla else MemoryFormat.KV_2LTD
        self.full_chunk_size_bytes = get_size_bytes(self.meta_shapes, self.meta_dtypes)
        self.single_token_size = self.full_chunk_size_bytes // self.metadata.chunk_size
        self.namespace_fields = namespace_fields(
            fmt=self.meta_fmt.name,
            shapes=self.meta_shapes,
            dtypes=self.meta_dtypes,
            chunk_size=self.metadata.chunk_size,
            use_mla=self.metadata.use_mla,
            salt=self.salt,
        )
        self.namespace = namespace_digest(self.namespace_fields)
        if not first:
            COUNTERS["layout_changes"] += 1
            logger.info(
                "KacheDB tier %s: LMCache registered the KV caches' layer groups; chunk layout now %s %s "
                "(namespace %s, %d bytes per full chunk)",
                self.plugin_name,
                [tuple(x) for x in self.meta_shapes],
                self.namespace_fields["dtypes"],
                self.namespace.hex(),
                self.full_chunk_size_bytes,
            )

    def _fits_layout(self, obj: MemoryObj) -> bool:
        """Whether ``obj`` is laid out as this engine's chunks are now (format,
        dtypes, shapes but for the token count)."""
        try:
            shapes, dtypes = list(obj.get_shapes()), list(obj.get_dtypes())
        except (AssertionError, AttributeError):
            return (
                obj.get_memory_format() == self.meta_fmt
                and obj.get_size() % self.single_token_size == 0
                and obj.get_size() <= self.full_chunk_size_bytes
            )
        return self._fits_alloc(shapes, dtypes, obj.get_memory_format())

    def _fits_alloc(self, shapes: Sequence[Any], dtypes: Sequence[Any], fmt: MemoryFormat) -> bool:
        """Whether a chunk of ``shapes``, ``dtypes`` and ``fmt`` is laid out as
        this engine's chunks are now (the token count, dimension 2, is the
        chunk's own; the rest is the layout)."""
        self._refresh_layout()
        if fmt != self.meta_fmt or list(dtypes) != list(self.meta_dtypes) or len(shapes) != len(self.meta_shapes):
            return False
        for got, want in zip(shapes, self.meta_shapes):
            if len(got) != len(want) or any(g != w for i, (g, w) in enumerate(zip(got, want)) if i != 2):
                return False
        return True

    # -- helpers ---------------------------------------------------------
    def daemon_key(self, key: CacheEngineKey) -> bytes:
        """The KacheDB key of ``key`` (bytes, hashed by the client)."""
        self._refresh_layout()
        return chunk_key(self.namespace, key.to_string())

    def _client(self) -> Any:
        return self._link.client()

    def _lookup(self, keys: Sequence[CacheEngineKey]) -> int:
        kc = self._client()
        if kc is None or not keys:
            return 0
        try:
            n = int(kc.lookup([self.daemon_key(k) for k in keys]))
        except kachedb.Disconnected as e:
            self._link.failed(e)
            return 0
        except kachedb.KacheDBError as e:
            COUNTERS["lookup_errors"] += 1
            _log_once("lookup_error", "KacheDB lookup failed (%s): treated as a miss", e)
            return 0
        COUNTERS["lookups"] += 1
        COUNTERS["lookup_hit_chunks"] += n
        return n

    def _load_prefix(self, keys: Sequence[CacheEngineKey]) -> List[MemoryObj]:
        """``MemoryObj``s holding the leading present chunks of ``keys``."""
        kc = self._client()
        if kc is None or not keys:
            return []
        try:
            # pin_each: LMCache keeps some chunks' views (within the pin budget)
            # and copies and drops others, whose pins must go with them.
            views = kc.get_prefix([self.daemon_key(k) for k in keys], pin_each=True)
        except kachedb.Disconnected as e:
            self._link.failed(e)
            return []
        except kachedb.KacheDBError as e:
            COUNTERS["get_errors"] += 1
            _log_once("get_error", "KacheDB get failed (%s): treated as a miss", e)
            return []
        out: List[MemoryObj] = []
        try:
            for i in range(len(views)):
                obj = self._chunk_obj(keys[i], views[i])
                views[i] = None  # its pin goes with it
                if obj is None:
                    break
                out.append(obj)
        except BaseException:
            for obj in out:
                obj.ref_count_down()
            raise
        finally:
            views.clear()  # the pins of the views past a miss
        COUNTERS["get_batches"] += 1
        COUNTERS["loaded_chunks"] += len(out)
        COUNTERS["missed_chunks"] += len(keys) - len(out)
        return out

    def _chunk_obj(self, key: CacheEngineKey, view: Any) -> Optional[MemoryObj]:
        """A ``MemoryObj`` holding ``view``'s chunk: the view itself (pinned while
        LMCache holds it) within the pin budget, else a copy in memory allocated
        from the local CPU backend; ``None`` if the chunk is malformed or no
        memory is free."""
        self._refresh_layout()
        nbytes = int(view.numel()) * int(view.element_size())
        if view.dtype != torch.uint8 or view.dim() != 1 or nbytes == 0 or nbytes % self.single_token_size or nbytes > self.full_chunk_size_bytes:
            COUNTERS["malformed_chunks"] += 1
            _log_once(
                "malformed",
                "KacheDB chunk of %s %s (%d bytes) does not fit this engine's layout (%d bytes a token, %d a chunk): a miss",
                view.dtype,
                tuple(view.shape),
                nbytes,
                self.single_token_size,
                self.full_chunk_size_bytes,
            )
            return None
        num_tokens = nbytes // self.single_token_size
        shapes = self.metadata.get_shapes(num_tokens)
        if self.views is not None:
            obj = self.views.wrap(key, view, shapes, self.meta_dtypes, self.meta_fmt)
            if obj is not None:
                COUNTERS["loaded_bytes"] += nbytes
                COUNTERS["loaded_views"] += 1
                return obj
            COUNTERS["loaded_copies_over_budget"] += 1
        # No busy wait: this may run on LMCache's event loop, which frees memory too.
        # (LMCache's own memory: the chunk is in the daemon already.)
        if self.region is not None:
            with self.region.bypass():
                obj = self.local_cpu_backend.allocate(
                    shapes, self.meta_dtypes, self.meta_fmt, eviction=True, busy_loop=False
                )
        else:
            obj = self.local_cpu_backend.allocate(shapes, self.meta_dtypes, self.meta_fmt, eviction=True, busy_loop=False)
        if obj is None:
            COUNTERS["alloc_failed"] += 1
            _log_once("alloc", "LMCache's local CPU backend has no room for a KacheDB chunk: a miss")
            return None
        try:
            dst = _bytes_of(obj)
            if len(dst) != nbytes:
                raise ValueError(f"allocated {len(dst)} bytes for a chunk of {nbytes}")
            if isinstance(dst, torch.Tensor):
                dst.copy_(view)
            else:
                dst[:] = memoryview(view.numpy()).cast("B")
        except BaseException:
            obj.ref_count_down()
            raise
        COUNTERS["loaded_bytes"] += nbytes
        return obj

    def _store(self, keys: Sequence[CacheEngineKey], memory_objs: Sequence[MemoryObj]) -> None:
        kc = self._client()
        if kc is None:
            COUNTERS["store_skipped_off"] += len(keys)
            return
        self._refresh_layout()
        items = []
        for k, obj in zip(keys, memory_objs):
            if not self._fits_layout(obj):
                COUNTERS["store_skipped_format"] += 1
                _log_once(
                    "format",
                    "KacheDB stores %s chunks of %s %s, not %s of %s: skipped",
                    self.meta_fmt,
                    [tuple(x) for x in self.meta_shapes],
                    self.meta_dtypes,
                    obj.get_memory_format(),
                    getattr(obj.metadata, "shapes", None) or obj.get_shape(),
                )
                continue
            items.append((self.daemon_key(k), obj, k, self._meta(k, obj)))
        if not items:
            return
        region = self.region
        in_place = [x for x in items if region is not None and region.owns_open(x[1])]
        copied = [x for x in items if region is None or not region.owns_open(x[1])]
        try:
            if in_place:
                self._commit_in_place(kc, in_place)
            if copied:
                self._put_copies(kc, copied)
        except (kachedb.OutOfMemory, kachedb.TooLarge) as e:
            COUNTERS["store_skipped_full"] += len(items)
            _log_once("full", "KacheDB store full (%s): skipping stores until there is room", e)
        except kachedb.Disconnected as e:
            self._link.failed(e)
        except kachedb.KacheDBError as e:
            COUNTERS["store_errors"] += 1
            _log_once("store_error", "KacheDB store failed (%s): skipped", e)

    def _commit_in_place(self, kc: Any, items: Sequence[Any]) -> None:
        """Stores chunks whose ``MemoryObj``s are reservations in the region
        (``RegionAllocator``): one batch of COMMIT_PINs naming their keys, no
        copy. A chunk already in the daemon is committed all the same (the
        newer block replaces the older one of its key, which its readers keep
        while they hold it): that costs no copy, where looking it up first
        would cost a round trip."""
        assert self.region is not None
        keys, metas = [x[0] for x in items], [x[3] for x in items]
        links = _links(items)
        parents = chain_parents(keys, links, first_parent=self._parent_key(items[0][2], links[0]))
        ok = self.region.commit_objects(kc, [x[1] for x in items], keys, [x[2] for x in items], metas, parents)
        n = sum(ok)
        if n < len(ok):
            COUNTERS["store_skipped_full"] += len(ok) - n
            _log_once("commit", "KacheDB refused %d in-place commits: those chunks are not stored", len(ok) - n)
        if n:
            COUNTERS["store_batches"] += 1
            COUNTERS["stored_chunks"] += n
            COUNTERS["stored_in_place"] += n
            COUNTERS["stored_bytes"] += sum(x[1].get_size() for x, good in zip(items, ok) if good)
            COUNTERS["stored_with_records"] += sum(1 for x, good in zip(items, ok) if good and x[3] is not None)
        # The next store's chunks, reserved ahead on this thread while the
        # daemon is awake from the commit (one more warm round trip). Handing
        # this to LMCache's event loop made the store slower, not faster: the
        # wake of the loop's thread and its GIL traffic cost more than the
        # reservations (docs/lmcache.md, "On which thread").
        try:
            self.region.refill(kc)  # a full daemon reserves nothing: not an error
        except kachedb.Disconnected:
            raise
        except kachedb.KacheDBError as e:
            COUNTERS["store_errors"] += 1
            _log_once("refill_error", "KacheDB reserve ahead failed (%s): the next store reserves on demand", e)

    def _put_copies(self, kc: Any, items: Sequence[Any]) -> None:
        """Stores chunks in LMCache's own memory: one ``put_many`` (a copy
        each); chunks with records (``_meta``) are reserved, copied, given their
        records and committed chained instead (``_put_with_records``)."""
        # Chunks chain over the prompt: the head of the batch present in the
        # daemon (stored by this or another engine) is not copied again.
        present = int(kc.lookup([x[0] for x in items]))
        before = items[present - 1] if present else None
        if present:
            COUNTERS["store_skipped_present"] += present
            items = items[present:]
        if not items:
            return
        keys = [x[0] for x in items]
        values = [_bytes_of(x[1]) for x in items]
        metas = [x[3] for x in items]
        links = _links(items)
        if any(m is not None for m in links):
            first = None
            if before is not None:
                before = (before[0], None, None, _links([before])[0])
            else:
                first = self._parent_key(items[0][2], links[0])
            ok = self._put_with_records(kc, keys, values, metas, chain_parents(keys, links, before, first))
        else:
            kc.put_many(keys, values)
            ok = [True] * len(values)
        n = sum(ok)
        if n < len(ok):
            COUNTERS["store_skipped_full"] += len(ok) - n
        COUNTERS["store_batches"] += 1
        COUNTERS["stored_chunks"] += n
        COUNTERS["stored_bytes"] += sum(_nbytes(v) for v, good in zip(values, ok) if good)
        COUNTERS["stored_with_records"] += sum(1 for m, good in zip(metas, ok) if good and m is not None)

    def _put_with_records(
        self, kc: Any, keys: List[bytes], values: List[Any], metas: List[Any], parents: List[Optional[bytes]]
    ) -> List[bool]:
        """The chunks reserved, copied, given their records and committed, one
        batch per run of chunks of one size (a prompt's last chunk may be
        short), in order; whether each was committed. Each names its parent in
        ``parents`` (``chain_parents``), so the daemon's chain-aware eviction
        takes a prompt's chunks from its end. A run that does not fit is not
        stored, nor are the runs after it (their parents would be missing)."""
        sources = [v if isinstance(v, torch.Tensor) else torch.frombuffer(v, dtype=torch.uint8) for v in values]
        ok = [False] * len(keys)
        start = 0
        while start < len(keys):
            end = start + 1
            while end < len(keys) and sources[end].numel() == sources[start].numel():
                end += 1
            try:
                res = kc.reserve_many(
                    keys[start:end], (sources[start].numel(),), torch.uint8, parents=parents[start:end]
                )
            except (kachedb.OutOfMemory, kachedb.TooLarge):
                if start == 0:
                    raise
                return ok
            try:
                for out, src in zip(res.out, sources[start:end]):
                    out.copy_(src)
                res.attach_meta(metas[start:end])
            except BaseException:
                res.abort()
                raise
            res.commit()
            res = None
            ok[start:end] = [True] * (end - start)
            start = end
        return ok

    def _parent_key(self, key: CacheEngineKey, meta: Optional[Any]) -> Optional[bytes]:
        """The daemon key of the chunk before ``key`` in its prompt, as
        LMCache keys it (``key`` with its parent's chunk hash), if ``meta``
        (its record or ``records.Link``) says it has one: the first chunk of a batch names the
        chunk an earlier store put there (vLLM's adapter masks a prompt's
        prefix already saved, so a longer prompt's store starts mid-prompt)."""
        if meta is None or meta.parent_hash is None:
            return None
        parent = records.parent_of(getattr(key, "chunk_hash", None))
        if parent is None:
            return None
        try:
            return self.daemon_key(dataclasses.replace(key, chunk_hash=parent))
        except (TypeError, ValueError):  # not a dataclass here, or one that refuses it
            return None

    def _meta(self, key: CacheEngineKey, obj: MemoryObj) -> Optional[Any]:
        """The chunk's ``kachedb.BlockMeta`` (its hash, its parent's, its
        tokens, the chunk size) if this process hashed its tokens
        (``records``); ``None`` otherwise: the chunk is published by key."""
        if not self.records:
            return None
        got = records.record(getattr(key, "chunk_hash", None))
        if got is None:
            return None
        tokens, parent = got
        if len(tokens) * self.single_token_size != obj.get_size():
            return None  # not this chunk's tokens (another layout's chunk of the same hash)
        if len(tokens) > MAX_META_TOKENS:
            return None  # more than a record carries
        return kachedb.BlockMeta(
            block_hash=records.event_hash(key.chunk_hash),
            parent_hash=parent,
            token_ids=tokens,
            block_size=int(self.metadata.chunk_size),
        )

    # -- called on the engine's thread (direct.py) ----------------------------
    def load_now(self, keys: Sequence[CacheEngineKey]) -> List[MemoryObj]:
        """The leading present chunks of ``keys`` (``batched_get`` without
        ``None``s), on the calling thread."""
        return self._load_prefix(keys)

    def store_now(self, keys: Sequence[CacheEngineKey], memory_objs: Sequence[MemoryObj]) -> None:
        """``batched_put`` on the calling thread (the next store's reservations
        too, right after its commit)."""
        self._store(keys, memory_objs)

    # -- RemoteConnector -------------------------------------------------
    async def exists(self, key: CacheEngineKey) -> bool:
        return self._lookup([key]) == 1

    def exists_sync(self, key: CacheEngineKey) -> bool:
        return self._lookup([key]) == 1

    async def get(self, key: CacheEngineKey) -> Optional[MemoryObj]:
        got = self._load_prefix([key])
        return got[0] if got else None

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        # LMCache's wrapper drops the reference when this returns.
        self._store([key], [memory_obj])

    async def list(self) -> List[str]:
        raise NotImplementedError("KacheDB keys are 128-bit hashes: the daemon cannot list LMCache keys")

    async def close(self) -> None:
        if self.region is not None:
            self.region.drain()
        self._link.close()

    def support_ping(self) -> bool:
        return True

    async def ping(self) -> int:
        kc = self._client()
        if kc is None:
            return 1
        try:
            kc.ping()
        except kachedb.Disconnected as e:
            self._link.failed(e)
            return 1
        except kachedb.KacheDBError:
            return 1
        return 0

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: List[CacheEngineKey]) -> List[Optional[MemoryObj]]:
        got: List[Optional[MemoryObj]] = list(self._load_prefix(keys))
        return got + [None] * (len(keys) - len(got))

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: List[CacheEngineKey], memory_objs: List[MemoryObj]) -> None:
        # LMCache's wrapper drops the references when this returns.
        self._store(keys, memory_objs)

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(self, lookup_id: str, keys: List[CacheEngineKey], pin: bool = False) -> int:
        # (``pin`` is not needed: the get that follows pins while it copies, and
        # a chunk evicted in between is a shorter prefix, which LMCache handles.)
        return self._lookup(keys)

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(self, lookup_id: str, keys: List[CacheEngineKey]) -> List[MemoryObj]:
        return self._load_prefix(keys)

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: List[CacheEngineKey]) -> int:
        return self._lookup(keys)

    def remove_sync(self, key: CacheEngineKey) -> bool:
        kc = self._client()
        if kc is None:
            return False
        try:
            return bool(kc.delete(self.daemon_key(key)))
        except kachedb.Disconnected as e:
            self._link.failed(e)
            return False
        except kachedb.Denied:
            # Another bound tenant's block (docs/tenants.md): not this engine's to remove.
            return False
        except kachedb.NotDurable as e:
            # Gone from RAM and never served again from disk, but not yet
            # durably removed there (docs/disk.md): say it was not removed.
            logger.warning("KacheDB: removing %s is not durable yet: %s", key, e)
            return False

    def __repr__(self) -> str:
        return f"<KacheDBConnector {self.plugin_name} socket={self.socket!r}>"


class KacheDBConnectorAdapter(ConnectorAdapter):
    """Creates a ``KacheDBConnector`` for ``plugin://kachedb`` and
    ``plugin://kachedb.<instance>``, with LMCache's metadata and the plugin name
    (which selects the ``extra_config`` options)."""

    def __init__(self) -> None:
        super().__init__(_PLUGIN_SCHEME + PLUGIN_TYPE)

    def can_parse(self, url: str) -> bool:
        return url.startswith(_PLUGIN_SCHEME) and extract_plugin_type(url[len(_PLUGIN_SCHEME) :]) == PLUGIN_TYPE

    def create_connector(self, context: ConnectorContext) -> RemoteConnector:
        name = context.plugin_name or context.url[len(_PLUGIN_SCHEME) :]
        return KacheDBConnector(
            loop=context.loop,
            local_cpu_backend=context.local_cpu_backend,
            config=context.config,
            metadata=context.metadata,
            plugin_name=name,
        )
