"""``KacheDBStorage``: SGLang HiCache's L3 storage in the KacheDB daemon.

SGLang's storage factory builds it from ``--hicache-storage-backend dynamic``
and the extra config ``kachedb.sglang.hicache_config()`` writes
(``module_path`` / ``class_name`` / ``interface_v1``), then registers the
host KV pool (``register_mem_pool_host``).

A stored page is one KacheDB block: with the zero-copy v1 interface
(``interface_v1``: ``batch_set_v1`` / ``batch_get_v1``, what SGLang's
controller uses when the config says so) a 1-D uint8 block of the byte ranges
that the host pool's ``get_page_buffer_meta`` names for the page, concatenated
in its order (for an MHA pool: K and V of all layers for ``page_first``; K and V
of each layer for ``layer_first``); with the generic interface (``set`` /
``get`` / ``batch_*``) the tensor SGLang passes (the pool's flat data page).
Keys are ``keys.page_key`` of SGLang's 64-hex page hashes in a namespace of
model, ranks, pool geometry and interface (``keys.py``).

Per call there is one batch each way: a store is one LOOKUP (pages already
stored are skipped: a page hash names its tokens and everything before them),
one RESERVE batch, one copy per byte range straight from the host pool into
shared memory, one COMMIT batch; a load is one ``get_prefix`` (lookup and pin of
the leading present pages, one round trip), one copy per byte range into the
host pool, then the views (and their pins) are dropped. ``batch_exists`` is
one LOOKUP: the count of leading present pages.

Rank-replicated KV (MLA: every TP rank holds the same pages) is stored once:
the namespace has no TP rank for it, and only SGLang's storage writer (one rank
per DCP shard) stores; every rank reads.

Failures never reach SGLang's controller as exceptions: a missing daemon (at
start or later) turns the tier off with one warning (misses, skipped stores;
retried every ``retry_seconds``), a full store or any other error makes that
call a miss / ``False`` and is logged once.

A process without SGLang's server arguments (SGLang publishes them in its
scheduler process, where its cache controller builds this backend) shares
nothing: its namespace could not tell servers apart that differ only in
quantization, dtype or KV-cache dtype. The backend then stores nothing and
finds nothing (every lookup and load a miss, every store skipped and
``False``, all counted) after one warning naming the cause and the fix, unless
the extra config says ``no_server_args: true`` (the process has none on
purpose: it shares only with other such processes).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

import kachedb

from .._link import DaemonLink, engine_tenant, resolve_socket
from . import keys as _keys

#: The backup SGLang's cache controller is running on this thread (its
#: ``StorageOperation``: the pages' hashes and their tokens), while it runs.
_BACKUP = threading.local()


def _watch_backups() -> bool:
    """Wraps SGLang's ``HiCacheController._page_backup`` (once per process) so
    that the operation it backs up is known to ``batch_set_v1`` on its thread:
    the storage interface passes a page's hash and host slots, not its tokens,
    which a router needs (docs/events.md, "Block metadata"). Whether it is
    wrapped (a SGLang without that function: pages are published by key)."""
    try:
        from sglang.srt.managers.cache_controller import HiCacheController
    except Exception:  # no controller in this SGLang: nothing to watch
        return False
    backup = getattr(HiCacheController, "_page_backup", None)
    if backup is None:
        return False
    if getattr(backup, "_kachedb_watched", False):
        return True

    def _page_backup(self: Any, operation: Any, *args: Any, **kwargs: Any) -> Any:
        outer = getattr(_BACKUP, "op", None)
        _BACKUP.op = operation
        try:
            return backup(self, operation, *args, **kwargs)
        finally:
            _BACKUP.op = outer

    _page_backup._kachedb_watched = True  # type: ignore[attr-defined]
    _page_backup.__doc__ = backup.__doc__
    HiCacheController._page_backup = _page_backup
    return True


def _page_hash(key: str) -> int:
    """A page's hash as the KV events carry it: the first 64 bits of its
    SGLang page hash (64 hex digits)."""
    return int(key[:16], 16)

logger = logging.getLogger("kachedb.sglang")

_DEFAULT_RETRY_S = 5.0


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a 1-D uint8 view."""
    return t.reshape(-1).view(torch.uint8)


def _is_storage_writer(c: Any) -> bool:
    w = getattr(c, "is_storage_writer", None)
    if isinstance(w, bool):
        return w
    return not bool(getattr(c, "is_mla_model", False)) or int(getattr(c, "tp_rank", 0)) == int(getattr(c, "dcp_rank", 0))


def _flag(v: Any) -> bool:
    """An extra-config switch: JSON ``true`` / 1, or the strings "true", "1", "yes", "on"."""
    if isinstance(v, str):
        return v.strip().lower() in ("1", "true", "yes", "on")
    return bool(v)


def _server_args() -> Optional[Dict[str, Any]]:
    """The server's arguments as resolved in this (scheduler) process, as a dict:
    SGLang's runtime context holds them once the scheduler has published them;
    ``None`` elsewhere."""
    try:
        from sglang.srt import runtime_context as rc
    except ImportError:
        return None
    try:
        return dict(rc.get_context().resolved_server_args_dict())
    except Exception:  # not published in this process (or an SGLang without resolution)
        pass
    try:
        import msgspec

        return msgspec.structs.asdict(rc.get_server_args())
    except Exception:
        return None


class _PoolBytes:
    """The host pool's pages as raw byte ranges ``(address, bytes)`` for
    ``Client.put_ranges`` / ``Client.get_prefix_into``: the ranges of
    ``get_page_buffer_meta``, in its order, adjacent ones merged, each checked
    to lie inside the pool's buffers (a range outside them is an error, never
    a stray copy). For an MHA pool a page is K then V of all layers
    (``page_first``: one range once merged) or K and V of each layer
    (``layer_first``: two ranges per layer).

    A page's ranges are kept, named by the page's first token index, for as
    long as the pool's buffers stay where they are: SGLang's host pools (MHA,
    MLA; both layouts) derive a page's ranges from its first token index and
    the buffers' addresses alone. A batch with a page not seen yet asks
    ``get_page_buffer_meta`` for all its pages."""

    #: Pages whose ranges are kept (a pool holds at most ``size / page_size``
    #: of them): past it the cache starts over.
    MAX_CACHED_PAGES = 1 << 16

    def __init__(self, host_pool: Any) -> None:
        self.pool = host_pool
        self._bases: List[Tuple[int, int]] = []
        self._key: Tuple[int, ...] = ()
        # first token index of a page -> (addresses, lengths); valid for the
        # buffers named by ``_key`` (emptied when they change)
        self._pages: Dict[int, Tuple[List[int], List[int]]] = {}

    def _buffers(self) -> List[torch.Tensor]:
        kv = getattr(self.pool, "kv_buffer", None)
        if isinstance(kv, torch.Tensor):
            return [kv]
        get = getattr(self.pool, "get_hybrid_pool_buffer", None)
        bufs = [b for b in (get() if get is not None else []) if isinstance(b, torch.Tensor)]
        if not bufs:
            raise kachedb.InvalidArgument(f"the SGLang host pool {type(self.pool).__name__} exposes no KV buffer")
        return bufs

    def _refresh(self) -> None:
        bufs = self._buffers()
        key = tuple(b.data_ptr() for b in bufs)
        if key == self._key:
            return
        bases = []
        for b in bufs:
            if b.device.type != "cpu" or not b.is_contiguous():
                raise kachedb.InvalidArgument(
                    f"the SGLang host pool's buffer must be contiguous host memory (device {b.device}, "
                    f"contiguous {b.is_contiguous()})"
                )
            bases.append((b.data_ptr(), b.numel() * b.element_size()))
        self._bases, self._key = bases, key
        self._pages = {}

    def _check(self, addr: int, nbytes: int) -> None:
        """Refuses a range that is not inside one of the pool's buffers."""
        for base, size in self._bases:
            if 0 <= addr - base and addr - base + nbytes <= size:
                return
        raise kachedb.InvalidArgument(f"get_page_buffer_meta named {nbytes} bytes at {addr:#x}, outside the host pool")

    def ranges(self, host_indices: Any, n_pages: int) -> Tuple[List[int], List[int], int]:
        """``(addresses, lengths, page_bytes)``: the pages' ranges page after
        page, the same number of ranges for every page, and the bytes of one page."""
        self._refresh()
        numel = int(host_indices.numel())
        if n_pages <= 0 or numel % n_pages:
            raise kachedb.InvalidArgument(f"{numel} host indices for {n_pages} pages")
        firsts = host_indices[:: numel // n_pages].tolist()
        got = [self._pages.get(f) for f in firsts]
        if None in got:
            got = self._from_meta(host_indices, n_pages)
            if len(self._pages) + len(firsts) > self.MAX_CACHED_PAGES:
                self._pages = {}
            self._pages.update(zip(firsts, got))
        per = len(got[0][0])  # type: ignore[index]
        if any(len(a) != per for a, _ in got):  # type: ignore[misc]
            # pages merged differently: the ranges as named, equal in number
            got = self._from_meta(host_indices, n_pages, merge=False)
        addrs: List[int] = []
        lens: List[int] = []
        for a, n in got:  # type: ignore[misc]
            addrs += a
            lens += n
        return addrs, lens, sum(got[0][1])  # type: ignore[index]

    def _from_meta(self, host_indices: Any, n_pages: int, merge: bool = True) -> List[Tuple[List[int], List[int]]]:
        """Per page ``(addresses, lengths)`` from ``get_page_buffer_meta``
        (adjacent ranges merged unless ``merge`` is false), every range checked."""
        ptrs, sizes = self.pool.get_page_buffer_meta(host_indices)
        if not len(ptrs) or len(ptrs) != len(sizes) or len(ptrs) % n_pages:
            raise kachedb.InvalidArgument(
                f"get_page_buffer_meta returned {len(ptrs)} ranges ({len(sizes)} sizes) for {n_pages} pages"
            )
        per = len(ptrs) // n_pages
        ptrs, sizes = [int(p) for p in ptrs], [int(n) for n in sizes]
        if min(sizes) <= 0:
            raise kachedb.InvalidArgument("get_page_buffer_meta named an empty byte range")
        for a, n in zip(ptrs, sizes):
            self._check(a, n)
        out = []
        for i in range(0, len(ptrs), per):
            addrs, lens = [ptrs[i]], [sizes[i]]
            for a, n in zip(ptrs[i + 1 : i + per], sizes[i + 1 : i + per]):
                if merge and a == addrs[-1] + lens[-1]:
                    lens[-1] += n
                else:
                    addrs.append(a)
                    lens.append(n)
            out.append((addrs, lens))
        page_bytes = sum(out[0][1])
        for addrs, lens in out:
            if sum(lens) != page_bytes:
                raise kachedb.InvalidArgument("the pages of one batch have differently sized byte ranges")
        return out


class KacheDBStorage(HiCacheStorage):
    """SGLang HiCache L3 storage in the node's KacheDB daemon (see the module docstring).

    ``storage_config.extra_config`` (``kachedb.sglang.hicache_config()`` writes it):
    ``socket`` (the daemon's control socket; default as ``kachedb.connect``),
    ``namespace`` (a salt mixed into every key), ``tenant`` (the daemon tenant
    it connects as; default: ``namespace`` made a tenant name, else the daemon's
    ``default``), ``retry_seconds`` (how often a
    missing daemon is retried, default 5), ``interface_v1`` (SGLang's switch to
    the zero-copy page interface; ``batch_exists`` / ``exists`` look in the
    namespace of the interface it selects), ``no_server_args`` (``true``: a
    process without SGLang's server arguments shares, with other such
    processes only; without it such a process stores and finds nothing).
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[Dict[str, Any]] = None) -> None:
        extra = dict(storage_config.extra_config or {})
        self.storage_config = storage_config
        # The one rule for the default (kachedb.default_socket_path: $KACHEDB_SOCKET, else the default path).
        self.socket = resolve_socket(extra.get("socket"))
        self.salt = extra.get("namespace")
        #: The daemon tenant this backend's client connects as.
        self.tenant = engine_tenant(extra.get("tenant"), self.salt)
        self.retry_s = float(extra.get("retry_seconds", _DEFAULT_RETRY_S))
        self.interface_v1 = bool(extra.get("interface_v1", 0))
        #: The extra config says this process has no server arguments on purpose.
        self.no_server_args = _flag(extra.get("no_server_args", False))
        #: Why this backend shares nothing (no server arguments), else None.
        self.refused: Optional[str] = None
        self.metrics = bool(getattr(storage_config, "enable_storage_metrics", False))
        #: Whether this rank stores pages: every rank, except for rank-replicated
        #: KV (MLA), where one rank per DCP shard does (SGLang's own rule).
        self.is_writer = _is_storage_writer(storage_config)
        self.mem_pool_host: Any = None
        self._pool_bytes: Optional[_PoolBytes] = None
        self.counters: Dict[str, int] = {
            k: 0
            for k in (
                "exists_calls",
                "exists_pages_hit",
                "get_pages",
                "get_pages_hit",
                "set_pages",
                "set_pages_stored",
                "set_pages_present",
                "set_pages_failed",
                "set_pages_replica_skipped",
                "exists_pages_refused",
                "get_pages_refused",
                "set_pages_refused",
                "store_full",
                "errors",
            )
        }
        self._logged: set = set()
        self._counters_lock = threading.Lock()
        self._metrics_lock = threading.Lock()
        self._prefetch_pgs: List[int] = []
        self._backup_pgs: List[int] = []
        self._prefetch_gbps: List[float] = []
        self._backup_gbps: List[float] = []
        self._set_namespaces()
        self._link = DaemonLink(
            self.socket, logger=logger, label="SGLang", role="HiCache", retry_s=self.retry_s, tenant=self.tenant
        )
        #: SGLang's backups are watched: stored pages carry their tokens.
        self.records = _watch_backups()
        if self.refused is None:
            self._link.client()  # connect now (or warn now); every call retries if it failed

    # -- setup -----------------------------------------------------------
    def _set_namespaces(self) -> None:
        pool = self.mem_pool_host
        server = _server_args()
        if server is not None:
            self.refused = None
        elif self.no_server_args:
            self.refused = None
            self._log_once(
                "no_server_args_ok",
                "KacheDB HiCache: no SGLang server arguments in this process and no_server_args is set: "
                "pages are shared only with other processes without server arguments (their namespace cannot "
                "tell quantization, dtype or KV-cache dtype apart)",
            )
        else:
            self.refused = "no SGLang server arguments in this process"
            self._log_once(
                "no_server_args",
                "KacheDB HiCache is OFF in this process: it stores nothing and finds nothing (every lookup and "
                "load a miss, every store skipped; counted in kachedb_stats()). Cause: this process has no SGLang "
                "server arguments (sglang.srt.runtime_context has none published), so the page namespace could "
                "not tell servers apart that differ only in --quantization, --dtype or --kv-cache-dtype, and "
                "sharing could load another server's KV. SGLang publishes them in its scheduler process, where its "
                "cache controller builds this backend. Fix: build the backend there (or publish the ServerArgs "
                "first: sglang.srt.runtime_context.publish(server_args, role='scheduler')); to share among processes "
                "that have no server arguments on purpose, add \"no_server_args\": true to "
                "--hicache-storage-backend-extra-config",
            )
        self.fields_v1 = _keys.namespace_fields(
            self.storage_config, pool, interface="v1", salt=self.salt, server_args=server
        )
        self.fields_generic = _keys.namespace_fields(
            self.storage_config, pool, interface="generic", salt=self.salt, server_args=server
        )
        self.ns_v1 = _keys.namespace_digest(self.fields_v1)
        self.ns_generic = _keys.namespace_digest(self.fields_generic)

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self._pool_bytes = _PoolBytes(mem_pool_host)
        self._set_namespaces()

    # -- helpers ---------------------------------------------------------
    def _log_once(self, tag: str, msg: str, *args: Any) -> None:
        if tag not in self._logged:
            self._logged.add(tag)
            logger.warning(msg, *args)

    def _failed(self, what: str, e: BaseException) -> None:
        """One place that turns an exception into a miss / skipped store."""
        if isinstance(e, kachedb.Disconnected):
            self._link.failed(e)
        elif isinstance(e, (kachedb.OutOfMemory, kachedb.TooLarge)):
            self._add(store_full=1)
            self._log_once("full", "KacheDB store full (%s): that %s is skipped (later ones are tried)", e, what)
        else:
            self._add(errors=1)
            self._log_once(f"error:{what}:{type(e).__name__}", "KacheDB HiCache %s failed (%r): treated as a miss", what, e)

    def _add(self, **deltas: int) -> None:
        # (SGLang calls from its prefetch and backup threads at once)
        with self._counters_lock:
            for k, d in deltas.items():
                self.counters[k] += d

    def _dkeys(self, ns: bytes, keys: Sequence[str]) -> List[bytes]:
        return [_keys.page_key(ns, str(k)) for k in keys]

    def _record(self, pgs: List[int], gbps: List[float], n: int, nbytes: int, t0: float) -> None:
        if not self.metrics or n <= 0:
            return
        dt = time.perf_counter() - t0
        with self._metrics_lock:
            pgs.append(n)
            if dt > 0:
                gbps.append(nbytes / dt / (1 << 30))

    def _v1_ranges(self, keys: Sequence[str], host_indices: Any) -> Tuple[List[int], List[int], int]:
        if self._pool_bytes is None:
            raise kachedb.InvalidArgument("no host pool registered (register_mem_pool_host)")
        page_size = int(self.mem_pool_host.page_size)
        if int(host_indices.numel()) != len(keys) * page_size:
            raise kachedb.InvalidArgument(
                f"{host_indices.numel()} host indices for {len(keys)} pages of {page_size} tokens"
            )
        return self._pool_bytes.ranges(host_indices, len(keys))

    # -- zero-copy v1 interface -------------------------------------------
    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """How many leading pages of ``keys`` are stored (one LOOKUP)."""
        self._add(exists_calls=1)
        if not keys:
            return 0
        if self.refused is not None:
            self._add(exists_pages_refused=len(keys))
            return 0
        kc = self._link.client()
        if kc is None:
            return 0
        try:
            n = int(kc.lookup(self._dkeys(self.ns_v1 if self.interface_v1 else self.ns_generic, keys)))
        except Exception as e:
            self._failed("lookup", e)
            return 0
        self._add(exists_pages_hit=n)
        return n

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_set_v1(
        self, keys: List[str], host_indices: torch.Tensor, extra_info: Optional[HiCacheStorageExtraInfo] = None
    ) -> List[bool]:
        """Stores the pages at ``host_indices`` (``len(keys) * page_size`` token
        slots of the host pool) under ``keys``; one bool per page."""
        n = len(keys)
        self._add(set_pages=n)
        if n == 0:
            return []
        if self.refused is not None:
            self._add(set_pages_refused=n)
            return [False] * n
        if not self.is_writer:
            # Another rank holds the same KV (MLA) and stores it, once, under the
            # namespace this rank reads too (SGLang's controller skips these backups).
            self._add(set_pages_replica_skipped=n)
            return [True] * n
        kc = self._link.client()
        if kc is None:
            self._add(set_pages_failed=n)
            return [False] * n
        t0 = time.perf_counter()
        try:
            addrs, lens, page_bytes = self._v1_ranges(keys, host_indices)
            dkeys = self._dkeys(self.ns_v1, keys)
            present = int(kc.lookup(dkeys))  # a page hash names its whole prefix: stored once
            if present < n:
                per = len(addrs) // n
                metas = self._metas(keys, extra_info)
                # The pages chain on from the one before them (stored already, or
                # the last of the prefix the controller names): the daemon's
                # chain-aware eviction then takes a prompt's pages from its end.
                before = dkeys[present - 1] if present else self._prefix_tail(extra_info)
                if metas is None:
                    # one RESERVE batch, one copy per range (host pool to shared memory), one COMMIT batch
                    kc.put_ranges(
                        dkeys[present:], addrs[present * per :], lens[present * per :], parent=before, chain=True
                    )
                else:
                    # the same, each page's record attached before the COMMITs
                    res = kc.reserve_many(dkeys[present:], (page_bytes,), torch.uint8, parent=before, chain=True)
                    try:
                        res.write_ranges(addrs[present * per :], lens[present * per :])
                        res.attach_meta(metas[present:])
                    except BaseException:
                        res.abort()
                        raise
                    res.commit()
        except Exception as e:
            self._add(set_pages_failed=n)
            self._failed("store", e)
            return [False] * n
        self._add(set_pages_present=present, set_pages_stored=n - present)
        self._record(self._backup_pgs, self._backup_gbps, n - present, (n - present) * page_bytes, t0)
        return [True] * n

    def _prefix_tail(self, extra_info: Optional[HiCacheStorageExtraInfo]) -> Optional[bytes]:
        """The daemon key of the page before a batch, if the controller names
        its prefix (``prefix_keys``)."""
        prefix = list(getattr(extra_info, "prefix_keys", None) or [])
        return self._dkeys(self.ns_v1, prefix[-1:])[0] if prefix else None

    def _metas(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo]) -> Optional[List[Any]]:
        """Each page's ``kachedb.BlockMeta`` (its hash, its parent's, its tokens,
        the page size), from the backup SGLang's controller runs on this thread;
        ``None`` when that is not known (another caller, another SGLang, pages
        not found in the operation): the pages are published by key."""
        op = getattr(_BACKUP, "op", None) if self.records else None
        if op is None:
            return None
        hashes = list(getattr(op, "hash_value", None) or [])
        tokens = list(getattr(op, "token_ids", None) or [])
        ps = int(getattr(self.mem_pool_host, "page_size", 0) or 0)
        try:
            at = hashes.index(keys[0])
        except ValueError:
            return None
        if ps <= 0 or hashes[at : at + len(keys)] != list(keys) or len(tokens) < (at + len(keys)) * ps:
            return None
        before = list(getattr(extra_info, "prefix_keys", None) or []) if at == 0 else [hashes[at - 1]]
        out = []
        for i, key in enumerate(keys):
            parent = keys[i - 1] if i else (before[-1] if before else None)
            out.append(
                kachedb.BlockMeta(
                    block_hash=_page_hash(key),
                    parent_hash=_page_hash(parent) if parent else None,
                    token_ids=tuple(tokens[(at + i) * ps : (at + i + 1) * ps]),
                    block_size=ps,
                )
            )
        return out

    def batch_get_v1(
        self, keys: List[str], host_indices: torch.Tensor, extra_info: Optional[HiCacheStorageExtraInfo] = None
    ) -> List[bool]:
        """Loads the leading stored pages of ``keys`` into the host pool at
        ``host_indices``; one bool per page (``True`` for the loaded prefix)."""
        n = len(keys)
        self._add(get_pages=n)
        if n == 0:
            return []
        if self.refused is not None:
            self._add(get_pages_refused=n)
            return [False] * n
        kc = self._link.client()
        if kc is None:
            return [False] * n
        t0 = time.perf_counter()
        try:
            addrs, lens, page_bytes = self._v1_ranges(keys, host_indices)
            # one get_prefix (lookup and pin), one copy per range into the host
            # pool, the pins released; a page of another size ends the prefix
            dkeys = self._dkeys(self.ns_v1, keys)
            n_ok = int(kc.get_prefix_into(dkeys, addrs, lens))
            if n_ok < n:
                self._note_other_size(kc, keys[n_ok], dkeys[n_ok], page_bytes)
        except Exception as e:
            self._failed("load", e)
            return [False] * n
        self._add(get_pages_hit=n_ok)
        self._record(self._prefetch_pgs, self._prefetch_gbps, n_ok, n_ok * page_bytes, t0)
        return [True] * n_ok + [False] * (n - n_ok)

    def _note_other_size(self, kc: Any, key: str, dkey: bytes, page_bytes: int) -> None:
        """Logs once when a load stopped at a page that is stored, but not as a
        uint8 page of ``page_bytes`` bytes (another pool layout under the same
        namespace): a miss, never a wrong copy. A page simply missing is not logged."""
        if "vsize" in self._logged:
            return
        views = kc.get_prefix([dkey])
        if views and (views[0].dtype != torch.uint8 or views[0].numel() != page_bytes):
            v = views[0]
            self._log_once("vsize", "KacheDB page %r is stored as %s of %d bytes where the pool's pages are uint8 "
                           "of %d: a miss", key, v.dtype, v.numel() * v.element_size(), page_bytes)
            del v
        del views

    # -- v2 (hybrid models' per-pool transfers): not stored here -----------
    def _no_v2(self) -> None:
        self._log_once(
            "v2",
            "KacheDB HiCache: the per-pool v2 interface (hybrid models: Mamba/SWA/sidecar pools) is not "
            "supported; those pages are misses and are not stored",
        )

    def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[List[Any]] = None,
                        extra_info: Optional[HiCacheStorageExtraInfo] = None) -> Any:
        from sglang.srt.mem_cache.hicache_storage import PoolTransferResult

        self._no_v2()
        return PoolTransferResult.empty()

    def batch_get_v2(self, transfers: List[Any], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> Dict[str, List[bool]]:
        self._no_v2()
        return {t.name: [False] * len(t.keys or []) for t in transfers}

    def batch_set_v2(self, transfers: List[Any], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> Dict[str, List[bool]]:
        self._no_v2()
        return {t.name: [False] * len(t.keys or []) for t in transfers}

    # -- generic interface ------------------------------------------------
    @staticmethod
    def _fill(target: torch.Tensor, v: torch.Tensor) -> bool:
        """Copies block ``v`` into ``target``; ``False`` if their bytes differ in size."""
        if target.numel() * target.element_size() != v.numel() * v.element_size():
            return False
        if target.is_contiguous() and target.device.type == "cpu":
            _flat_bytes(target).copy_(_flat_bytes(v.contiguous()))
        elif target.dtype == v.dtype:
            target.copy_(v.reshape(target.shape))
        else:
            target.copy_(v.reshape(-1).view(torch.uint8).view(target.dtype).reshape(target.shape))
        return True

    @staticmethod
    def _private(v: torch.Tensor) -> torch.Tensor:
        out = torch.empty(tuple(v.shape), dtype=v.dtype)
        out.copy_(v)
        return out

    def get(
        self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None
    ) -> Optional[torch.Tensor]:
        """The page stored under ``key`` by ``set``: copied into
        ``target_location`` (a tensor of the same byte size) and returned, or a
        private copy when there is no target; ``None`` on a miss."""
        got = self.batch_get([key], None if target_location is None else [target_location], target_sizes)
        return got[0]

    def batch_get(
        self, keys: List[str], target_locations: Optional[Any] = None, target_sizes: Optional[Any] = None
    ) -> List[Optional[torch.Tensor]]:
        n = len(keys)
        self._add(get_pages=n)
        out: List[Optional[torch.Tensor]] = [None] * n
        if n == 0:
            return out
        if self.refused is not None:
            self._add(get_pages_refused=n)
            return out
        kc = self._link.client()
        if kc is None:
            return out
        try:
            views = kc.get_many(self._dkeys(self.ns_generic, keys))
            try:
                for i, v in enumerate(views):
                    if v is None:
                        continue
                    target = target_locations[i] if target_locations is not None else None
                    if isinstance(target, torch.Tensor):
                        if self._fill(target, v):
                            out[i] = target
                        else:
                            self._log_once("gshape", "KacheDB page %r does not fit its target: a miss", keys[i])
                    else:
                        out[i] = self._private(v)
            finally:
                v = None  # type: ignore[assignment]
                del views
        except Exception as e:
            self._failed("load", e)
            return [None] * n
        self._add(get_pages_hit=sum(x is not None for x in out))
        return out

    def set(
        self,
        key: str,
        value: Optional[Any] = None,
        target_location: Optional[Any] = None,
        target_sizes: Optional[Any] = None,
    ) -> bool:
        """Stores tensor ``value`` under ``key`` (skipped if stored already)."""
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: List[str],
        values: Optional[Any] = None,
        target_locations: Optional[Any] = None,
        target_sizes: Optional[Any] = None,
    ) -> bool:
        """Stores tensors ``values`` under ``keys`` (one LOOKUP, then one
        ``put_many`` of the pages not stored yet); ``True`` if all are stored."""
        n = len(keys)
        self._add(set_pages=n)
        if n == 0:
            return True
        if values is None or len(values) != n or any(not isinstance(v, torch.Tensor) for v in values):
            self._add(set_pages_failed=n)
            self._log_once("gvalues", "KacheDB HiCache set needs one tensor per key (zero-copy pointers: use interface_v1)")
            return False
        if self.refused is not None:
            self._add(set_pages_refused=n)
            return False
        if not self.is_writer:
            self._add(set_pages_replica_skipped=n)
            return True
        kc = self._link.client()
        if kc is None:
            self._add(set_pages_failed=n)
            return False
        try:
            dkeys = self._dkeys(self.ns_generic, keys)
            present = int(kc.lookup(dkeys))
            if present < n:
                kc.put_many(dkeys[present:], [v.detach() for v in values[present:]])
        except Exception as e:
            self._add(set_pages_failed=n)
            self._failed("store", e)
            return False
        self._add(set_pages_present=present, set_pages_stored=n - present)
        return True

    # -- housekeeping -----------------------------------------------------
    def clear(self) -> None:
        """Leaves the daemon's store alone: other servers on the node share it
        (its blocks are evicted by the daemon; restart it to empty it)."""
        self._log_once("clear", "KacheDB HiCache clear(): the shared KacheDB store is not cleared")

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` (pages and GB/s per batch since the last
        call) when storage metrics are on, else ``None``."""
        if not self.metrics:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        m = StorageMetrics()
        with self._metrics_lock:
            m.prefetch_pgs.extend(self._prefetch_pgs)
            m.backup_pgs.extend(self._backup_pgs)
            m.prefetch_bandwidth.extend(self._prefetch_gbps)
            m.backup_bandwidth.extend(self._backup_gbps)
            for lst in (self._prefetch_pgs, self._backup_pgs, self._prefetch_gbps, self._backup_gbps):
                lst.clear()
        return m

    def kachedb_stats(self) -> Dict[str, Any]:
        """This backend's counters, link state and namespace fields (for debugging a miss)."""
        return {
            **self.counters,
            "tier_off": self.refused is not None or not self._link.is_on,
            "refused": self.refused,
            "outages": self._link.outages,
            "reconnects": self._link.reconnects,
            "socket": self.socket,
            "namespace_v1": self.ns_v1.hex(),
            "namespace_generic": self.ns_generic.hex(),
            "fields": self.fields_v1,
        }

    def close(self) -> None:
        self._link.close()
