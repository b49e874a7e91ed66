"""Scheduler side: ``KacheDBOffloadingManager``.

The daemon is the source of truth (other engines store into it and it evicts
on its own), so the manager keeps no index: ``lookup`` asks the daemon,
``prepare_store`` skips the leading blocks the daemon already has and those
whose store is in flight, ``prepare_load`` just names the keys for the worker.

With tensor parallelism each block has one key per group of ranks holding the
same KV (every rank, or one for all ranks of an MLA model): ``lookup`` hits
and ``prepare_store`` skips a block only when every one of those keys is in
the daemon, so a copy one rank lost is stored again, never missed for ever.

In vLLM's canonical layout (``spec.canonical``) one key names a block of
every KV head for all ranks of any TP degree: ``prepare_store`` reserves the
blocks (and one acknowledgement byte per rank) and hands their offsets to the
workers, which write their heads into them; ``complete_store`` commits them
once every rank acknowledged, else aborts them (``_CanonicalStore``).

A store's spec carries what only the scheduler knows of each block — the
engine's block hash and its parent's, the block's tokens, the LoRA adapter
(``kachedb.BlockMeta``, ``_block_metas``) — for the worker to attach to the
reservations, so the daemon's KV events name the block as this engine's own
events do (docs/events.md, "Block metadata").
"""

from __future__ import annotations

import collections
import sys
from typing import Any, Callable, Collection, Dict, Iterable, List, Optional, Set

from kachedb._meta import BlockMeta, int_hash

from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    get_offload_block_hash,
    ReqContext,
    RequestOffloadingContext,
)

from ._link import daemon_link
from .engine_spec import DEFAULT_KV_EVENTS_MAX_BLOCKS, EngineSpec
from ._state import COUNTERS


class KacheDBLoadStoreSpec(LoadStoreSpec):
    """The vLLM offload keys (block hash + group index) of a load or store, in the
    order of the GPU blocks of the matching ``GPULoadStoreSpec``; for a store,
    ``parent``: the offload key of the block before the first one in its
    request's chain (already in the daemon), if any, ``background``: whether
    the engine keeps stepping until the store is reported (``engine_keeps_stepping``),
    so that the worker may finish it off the step, and ``metas``: each key's
    ``kachedb.BlockMeta`` (or ``None``), or ``None`` for none. Picklable."""

    def __init__(
        self,
        keys: List[bytes],
        parent: Optional[bytes] = None,
        background: bool = False,
        metas: Optional[List[Optional[BlockMeta]]] = None,
        chain: Optional[List[bytes]] = None,
        slots: Optional[List[int]] = None,
        ack: Optional[int] = None,
    ) -> None:
        self.keys = [bytes(k) for k in keys]
        #: Canonical layout: each key's reserved block, as its offset in the
        #: daemon's region (the scheduler holds the reservations; every rank
        #: writes its heads into them), and the offset of the job's
        #: acknowledgement bytes (one per rank, set once its part is written).
        self.slots = None if slots is None else [int(o) for o in slots]
        self.ack = None if ack is None else int(ack)
        self.parent = None if parent is None else bytes(parent)
        self.background = bool(background)
        self.metas = metas
        #: A store's keys in chain order (several KV-cache groups: by the token
        #: position each block ends at, then by group; ``None``: ``keys``' order).
        self.chain = None if chain is None else [bytes(k) for k in chain]

    def __repr__(self) -> str:
        return f"KacheDBLoadStoreSpec({len(self.keys)} keys)"


#: How many times one request may load one block. vLLM recomputes a block
#: whose load failed and asks the lookup again; a block the daemon holds but
#: that cannot load (another layout's bytes in this namespace, a delete the
#: daemon refused) would be found and fail again for ever. Past this many loads
#: the request's lookups miss it, so the request computes it and finishes. Two:
#: a request preempted after a load may load it once more.
MAX_LOADS_PER_KEY = 2


class _Loads:
    """Per request (in its ``ReqContext``): how many times each offload key was
    handed to a load."""

    def __init__(self) -> None:
        self.count: Dict[bytes, int] = {}


def _loads(req_context: ReqContext) -> Optional[_Loads]:
    """The request's ``_Loads`` (made at its first load); ``None`` without
    per-request state (no context, a vLLM without it)."""
    get, put = getattr(req_context, "get_state", None), getattr(req_context, "set_state", None)
    if get is None or put is None:
        return None
    st = get(_Loads)
    if st is None:
        st = _Loads()
        put(st)
    return st


class _ChainTail:
    """Per request (in its ``ReqContext``): the last offload key it handed to a
    load or a store, the parent of the first block of its next store."""

    def __init__(self, key: bytes) -> None:
        self.key = key


def _chain_tail(req_context: ReqContext) -> Optional[bytes]:
    get = getattr(req_context, "get_state", None)  # vLLM versions without per-request state: none
    tail = get(_ChainTail) if get is not None else None
    return tail.key if tail is not None else None


def _set_chain_tail(req_context: ReqContext, key: bytes) -> None:
    put = getattr(req_context, "set_state", None)
    if put is not None:
        put(_ChainTail(key))


def engine_keeps_stepping() -> bool:
    """Whether the caller runs inside vLLM's engine-core busy loop
    (``EngineCoreProc.run_busy_loop``: ``vllm serve``, and ``LLM`` in its default
    multiprocess mode). That loop keeps stepping, without any request, while the
    connector has transfer jobs not yet reported (vLLM 0.32: ``Scheduler.has_requests``
    asks ``OffloadingConnector.has_pending_push_work``, true while a store job is
    pending), so a store that completes after its request's last step is still
    reported — ``complete_store``, its ``BlockStored`` events — within a step or
    two. vLLM's in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) steps
    only while a user request is unfinished: there it is false."""
    try:
        from vllm.v1.engine.core import EngineCoreProc
    except Exception:  # another vLLM layout: the safe answer
        return False
    f = sys._getframe(1)
    while f is not None:
        if f.f_code.co_name == "run_busy_loop" and isinstance(f.f_locals.get("self"), EngineCoreProc):
            return True
        f = f.f_back
    return False


class _Reported:
    """The offload keys the KV events have reported as loadable from KacheDB and
    not yet as removed (oldest first, at most ``max_blocks``), and the events
    not yet taken. Each key is reported stored once and removed once, in that
    order: consumers of vLLM's events count repeated announcements of a hash.

    vLLM's block hashes chain each block to its prefix, so a block whose key is
    missing from the daemon makes every later block of its prefix unloadable
    too; those are reported removed when this engine's lookups or stores reach
    them (a router matches a prefix block by block and stops at the first gap)."""

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self.keys: "collections.OrderedDict[bytes, None]" = collections.OrderedDict()
        self.events: List[OffloadingEvent] = []

    def _event(self, keys: List[bytes], removed: bool) -> None:
        if keys:
            # Medium.CPU for vLLM's event translation; KacheDBConnector.take_events
            # names the medium KACHEDB. Node-local: LOCAL to the publishing engine.
            self.events.append(OffloadingEvent(keys=keys, medium=Medium.CPU, removed=removed, locality=Locality.LOCAL))

    def stored(self, keys: Iterable[bytes]) -> None:
        new = [k for k in keys if k not in self.keys]
        for k in new:
            self.keys[k] = None
        self._event(new, removed=False)
        COUNTERS["kv_events_stored_blocks"] += len(new)
        over = len(self.keys) - self.max_blocks
        if over > 0:
            # Past the bound the oldest report is withdrawn (the block may still be
            # loadable: a router then under-estimates, never over-estimates).
            self.removed([k for k, _ in zip(self.keys, range(over))])

    def removed(self, keys: Iterable[bytes]) -> None:
        gone = [k for k in keys if k in self.keys]
        for k in gone:
            del self.keys[k]
        self._event(gone, removed=True)
        COUNTERS["kv_events_removed_blocks"] += len(gone)

    def take(self) -> List[OffloadingEvent]:
        out, self.events = self.events, []
        return out


class _CanonicalStore:
    """A store job's canonical blocks (reserved by the scheduler, written in
    place by every rank): committed when vLLM reports the job complete and
    every rank acknowledged its part, else aborted."""

    def __init__(self, held: List[Any], ack: Any, keys: List[bytes], world: int) -> None:
        self.held = held
        self.ack = ack
        self.left = set(keys)
        self.world = world
        self.blocks = len(keys)

    def finish(self) -> bool:
        """Commits (every rank acknowledged) or aborts the blocks; whether committed."""
        try:
            acked = bytes(self.ack.out.tolist()) == b"\x01" * self.world
            for r in self.held:
                if acked:
                    r.commit()
                else:
                    r.abort()
            return acked
        finally:
            self.held = []
            try:
                self.ack.abort()
            except Exception:
                pass

    def abort(self) -> None:
        for r in self.held + [self.ack]:
            try:
                r.abort()
            except Exception:
                pass
        self.held = []


class KacheDBOffloadingManager(OffloadingManager):
    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self.link = daemon_link(spec.socket, "scheduler", spec.retry_s, getattr(spec, "tenant", None))
        self._storing: Set[bytes] = set()
        #: Whether this engine reports a store that completes after its step
        #: (``engine_keeps_stepping``; known at the first ``prepare_store``, which
        #: vLLM calls from its scheduler's step).
        self._background: Optional[bool] = None
        events = getattr(spec, "kv_events_config", None)
        #: The KV events' record (``None`` unless the engine publishes KV events:
        #: vLLM drains ``take_events`` only then).
        on = events is not None and events.enable_kv_cache_events
        bound = getattr(spec, "kv_events_max_blocks", DEFAULT_KV_EVENTS_MAX_BLOCKS)
        self._reported: Optional[_Reported] = _Reported(bound) if on else None
        #: The scheduler's request of a request id (``KacheDBConnector`` sets
        #: it): the tokens and block hashes of the blocks a store names.
        self.request_of: Optional[Callable[[str], Any]] = None
        #: Canonical layout: the store job of each key whose blocks this
        #: scheduler holds reserved until the job completes.
        self._canonical: Dict[bytes, _CanonicalStore] = {}
        self.link.client()  # connect (or warn once) at engine start

    def _block_metas(self, keys: List[bytes], req_context: ReqContext) -> Optional[List[Optional[BlockMeta]]]:
        """Each key's ``BlockMeta`` as the engine's own KV events tell the block
        (``block_pool``: its hash and its parent's as 64-bit ints, its tokens,
        the block size, the LoRA adapter); ``None`` for a key whose request or
        position the scheduler does not know, or whose block hash is not the
        request's hash at that position (a chunk of several hash blocks)."""
        request_of = self.request_of
        req = request_of(req_context.req_id) if request_of is not None else None
        position = getattr(req_context, "get_offload_key_position", None)
        if req is None or position is None:
            return None
        hashes = list(getattr(req, "block_hashes", ()) or ())
        tokens = req.all_token_ids
        lora = getattr(req, "lora_request", None)
        out: List[Optional[BlockMeta]] = []
        per_group = tuple(getattr(self.spec, "tokens_per_block", ()) or ())
        for key in keys:
            end = position(key)
            group = int.from_bytes(key[-4:], "big")
            size = int(per_group[group]) if group < len(per_group) else 0
            index = end // size - 1 if end and size else -1
            block_hash = get_offload_block_hash(OffloadKey(key))
            if index < 0 or index >= len(hashes) or bytes(hashes[index]) != block_hash:
                out.append(None)
                continue
            out.append(
                BlockMeta(
                    block_hash=int_hash(block_hash),
                    parent_hash=int_hash(hashes[index - 1]) if index > 0 else None,
                    token_ids=tuple(tokens[end - size : end]),
                    block_size=size,
                    lora_id=lora.adapter_id if lora is not None else None,
                    lora_name=lora.name if lora is not None else None,
                )
            )
        return out

    @staticmethod
    def _chain_order(keys: List[bytes], req_context: ReqContext) -> List[bytes]:
        """``keys`` in chain order: with blocks of several KV-cache groups, by the
        token position each ends at, then by group (stable); one group's, or keys
        whose positions the request does not know, as they come."""
        if len({k[-4:] for k in keys}) < 2:
            return keys
        position = getattr(req_context, "get_offload_key_position", None)
        if position is None:
            return keys
        try:
            ends = [position(k) for k in keys]
        except Exception:  # a vLLM that does not know one of them: as they come
            return keys
        if any(not isinstance(e, int) or e <= 0 for e in ends):
            return keys
        order = sorted(range(len(keys)), key=lambda i: (ends[i], int.from_bytes(keys[i][-4:], "big")))
        return [keys[i] for i in order]

    def _link_failed(self, e: BaseException) -> None:
        self.link.failed(e)
        if self._reported is not None:
            # The daemon went away: whatever it held is gone for this engine (a
            # restarted daemon starts empty).
            self._reported.removed(list(self._reported.keys))

    def _ranks_keys(self, key: bytes) -> List[bytes]:
        """The block's key in each namespace (one per group of ranks holding the same KV)."""
        return [self.spec.daemon_key(key, r) for r in self.spec.store_ranks]

    def _present(self, kc: Any, keys: List[bytes]) -> int:
        """How many leading blocks of ``keys`` the daemon holds for every rank
        (one LOOKUP of the blocks' keys, rank by rank within each block)."""
        per = len(self.spec.store_ranks)
        return int(kc.lookup([k for key in keys for k in self._ranks_keys(key)])) // per

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        COUNTERS["lookups"] += 1
        kc = self.link.client()
        if kc is None:
            return LookupResult.MISS
        get = getattr(req_context, "get_state", None)
        loads = get(_Loads) if get is not None else None
        if loads is not None and loads.count.get(bytes(key), 0) >= MAX_LOADS_PER_KEY:
            COUNTERS["lookup_reload_refused"] += 1
            return LookupResult.MISS
        keys = self._ranks_keys(key)
        try:
            n = kc.lookup(keys)
        except Exception as e:
            if _is_disconnected(e):
                self._link_failed(e)
                return LookupResult.MISS
            if _is_kachedb_error(e):
                COUNTERS["lookup_errors"] += 1
                return LookupResult.MISS
            raise
        if n == len(keys):
            COUNTERS["lookup_hits"] += 1
            if self._reported is not None:
                self._reported.stored([bytes(key)])
            return LookupResult.HIT
        if self._reported is not None:
            self._reported.removed([bytes(key)])
        return LookupResult.MISS

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        keys = [bytes(k) for k in keys]
        if keys:
            # The request's next store chains on from the last block it loads.
            _set_chain_tail(req_context, keys[-1])
            loads = _loads(req_context)
            if loads is not None:
                for k in keys:
                    loads.count[k] = loads.count.get(k, 0) + 1
        return KacheDBLoadStoreSpec(keys)

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput:
        keys = [bytes(k) for k in keys if bytes(k) not in self._storing]
        kc = self.link.client()
        if kc is None or not keys:
            if kc is None and keys:
                COUNTERS["store_skipped_off_blocks"] += len(keys)
            return PrepareStoreOutput(keys_to_store=[], store_spec=KacheDBLoadStoreSpec([]), evicted_keys=[])
        # One chain per request across its KV-cache groups: the blocks in the
        # order of the token position each ends at (then by group), so that the
        # blocks a prefix boundary needs — every group's up to it — are a prefix
        # of the chain, and chain-aware eviction, which takes a chain's tail
        # first, drops a later boundary's blocks before an earlier one's
        # (docs/vllm.md, "Hybrid models").
        chain = self._chain_order(keys, req_context)
        try:
            # In chain order: the leading run the daemon holds for every rank needs
            # no store. A block missing for one rank (evicted) is stored again by
            # all: lookups need every rank's copy.
            present = self._present(kc, chain)
        except Exception as e:
            if _is_disconnected(e):
                self._link_failed(e)
            elif not _is_kachedb_error(e):
                raise
            return PrepareStoreOutput(keys_to_store=[], store_spec=KacheDBLoadStoreSpec([]), evicted_keys=[])
        todo_chain = chain[present:]
        todo_set = set(todo_chain)
        # vLLM's order (group by group), which the GPU blocks of the store follow.
        todo = [k for k in keys if k in todo_set]
        COUNTERS["store_already_present_blocks"] += present
        self._storing.update(todo)
        # The stored blocks chain on from the last one the daemon has, else from
        # the last one this request stored before (docs/eviction.md).
        parent = chain[present - 1] if present else _chain_tail(req_context)
        _set_chain_tail(req_context, chain[-1])
        if self._background is None:
            self._background = engine_keeps_stepping()
        try:
            metas = self._block_metas(todo, req_context)
        except Exception as e:  # never fail a store for its events' sake: reported by key
            COUNTERS["store_meta_errors"] += 1
            _log_meta_error(e)
            metas = None
        slots = ack = None
        if getattr(self.spec, "canonical", None) is not None and todo:
            try:
                slots, ack = self._reserve_canonical(kc, todo, todo_chain, parent, metas)
            except Exception as e:
                self._storing.difference_update(todo)
                if _is_disconnected(e):
                    self._link_failed(e)
                elif not _is_kachedb_error(e):
                    raise
                else:
                    COUNTERS["store_skipped_full"] += 1
                return PrepareStoreOutput(keys_to_store=[], store_spec=KacheDBLoadStoreSpec([]), evicted_keys=[])
            metas = None  # attached to the reservations here
        return PrepareStoreOutput(
            keys_to_store=todo,
            store_spec=KacheDBLoadStoreSpec(
                todo, parent, self._background, metas, todo_chain if todo_chain != todo else None, slots, ack
            ),
            evicted_keys=[],
        )

    def _reserve_canonical(
        self,
        kc: Any,
        todo: List[bytes],
        chain: List[bytes],
        parent: Optional[bytes],
        metas: Optional[List[Optional[BlockMeta]]],
    ) -> "tuple[List[int], int]":
        """Reserves the canonical blocks of a store (one RESERVE batch per run of
        one KV-cache group, in chain order, each naming its chain parent) and the
        job's acknowledgement bytes; returns each key's block offset in the
        region (``todo``'s order) and the acknowledgements' offset. All or
        nothing: a refused reservation gives back the ones made before."""
        import torch

        spec = self.spec
        base = int(kc._check().region_span()[0])
        world = max(1, int(getattr(spec, "world_size", 1)))
        meta_of = dict(zip(todo, metas)) if metas else {}
        runs: List[List[bytes]] = []
        for k in chain:
            if runs and runs[-1][-1][-4:] == k[-4:]:
                runs[-1].append(k)
            else:
                runs.append([k])
        held: List[Any] = []
        offsets: Dict[bytes, int] = {}
        prev = spec.daemon_key(parent) if parent is not None else None
        try:
            for run in runs:
                pages = spec.canonical_pages[spec.group_positions[int.from_bytes(run[0][-4:], "big")]]
                dkeys = [spec.daemon_key(k) for k in run]
                r = kc.reserve_many(dkeys, (len(pages), max(pages)), torch.uint8, parents=[prev] + dkeys[:-1])
                held.append(r)
                prev = dkeys[-1]
                if meta_of:
                    try:
                        r.attach_meta([meta_of.get(k) for k in run])
                        COUNTERS["store_meta_blocks"] += sum(meta_of.get(k) is not None for k in run)
                    except Exception as e:  # the blocks are reported by key
                        if _is_disconnected(e):
                            raise
                for k, out in zip(run, r.out):
                    offsets[k] = int(out.data_ptr()) - base
            ack = kc.reserve(None, (world,), torch.uint8)
        except BaseException:
            for r in held:
                try:
                    r.abort()
                except Exception:
                    pass
            raise
        ack.out.zero_()
        job = _CanonicalStore(held, ack, todo, world)
        for k in todo:
            self._canonical[k] = job
        COUNTERS["store_canonical_reserved_blocks"] += len(todo)
        return [offsets[k] for k in todo], int(ack.out.data_ptr()) - base

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        keys = [bytes(k) for k in keys]
        self._storing.difference_update(keys)
        self._finish_canonical(keys)
        if self._reported is not None and keys:
            self._report_store(keys)

    def _finish_canonical(self, keys: List[bytes]) -> None:
        """Commits the canonical blocks of the jobs ``keys`` complete, once
        every rank acknowledged writing its part; a job a rank did not
        acknowledge (its daemon link down, its copy failed) is aborted, never
        committed with another block's or no bytes in that rank's heads."""
        for k in keys:
            job = self._canonical.pop(k, None)
            if job is None:
                continue
            job.left.discard(k)
            if job.left:
                continue
            try:
                if job.finish():
                    COUNTERS["store_canonical_committed_blocks"] += job.blocks
                else:
                    COUNTERS["store_canonical_unacknowledged_blocks"] += job.blocks
            except Exception as e:
                if _is_disconnected(e):
                    self._link_failed(e)
                elif not _is_kachedb_error(e):
                    raise

    def _abort_canonical(self) -> None:
        for job in set(self._canonical.values()):
            job.abort()
        self._canonical.clear()

    def _report_store(self, keys: List[bytes]) -> None:
        # A finished store job need not have stored anything (the daemon full,
        # gone): report what the daemon holds, from the first block on (the
        # job's blocks are consecutive blocks of one prefix).
        kc = self.link.client()
        present = 0
        if kc is not None:
            try:
                present = self._present(kc, keys)
            except Exception as e:
                if _is_disconnected(e):
                    self._link_failed(e)
                    return
                if not _is_kachedb_error(e):
                    raise
        self._reported.stored(keys[:present])
        self._reported.removed(keys[present:])

    def take_events(self) -> Iterable[OffloadingEvent]:
        return self._reported.take() if self._reported is not None else ()

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def reset_cache(self) -> None:
        self._storing.clear()

    def shutdown(self) -> None:
        self._abort_canonical()
        self.link.close()


def _log_meta_error(e: BaseException) -> None:
    """Warns once per process that a store goes without block metadata."""
    if COUNTERS["store_meta_errors"] == 1:
        import logging

        logging.getLogger("kachedb.vllm").warning(
            "KacheDB: no block metadata for a store (%r): its blocks are reported by key", e
        )


def _is_kachedb_error(e: BaseException) -> bool:
    import kachedb

    return isinstance(e, kachedb.KacheDBError)


def _is_disconnected(e: BaseException) -> bool:
    import kachedb

    return isinstance(e, kachedb.Disconnected)
