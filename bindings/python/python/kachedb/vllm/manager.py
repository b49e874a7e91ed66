"""Scheduler side: ``KacheDBOffloadingManager``.

The daemon is the source of truth (other engines store into it and it evicts
on its own), so the manager keeps no index: ``lookup`` asks the daemon,
``prepare_store`` skips the leading blocks the daemon already has and those
whose store is in flight, ``prepare_load`` just names the keys for the worker.

With tensor parallelism each block has one key per group of ranks holding the
same KV (every rank, or one for all ranks of an MLA model): ``lookup`` hits
and ``prepare_store`` skips a block only when every one of those keys is in
the daemon, so a copy one rank lost is stored again, never missed for ever.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Collection, List, Optional, Set

from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)

from ._link import daemon_link
from ._state import COUNTERS

if TYPE_CHECKING:
    from .spec import KacheDBOffloadingSpec


class KacheDBLoadStoreSpec(LoadStoreSpec):
    """The vLLM offload keys (block hash + group index) of a load or store, in the
    order of the GPU blocks of the matching ``GPULoadStoreSpec``; for a store,
    ``parent``: the offload key of the block before the first one in its
    request's chain (already in the daemon), if any. Picklable."""

    def __init__(self, keys: List[bytes], parent: Optional[bytes] = None) -> None:
        self.keys = [bytes(k) for k in keys]
        self.parent = None if parent is None else bytes(parent)

    def __repr__(self) -> str:
        return f"KacheDBLoadStoreSpec({len(self.keys)} keys)"


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


class KacheDBOffloadingManager(OffloadingManager):
    def __init__(self, spec: "KacheDBOffloadingSpec") -> None:
        self.spec = spec
        self.link = daemon_link(spec.socket, "scheduler", spec.retry_s)
        self._storing: Set[bytes] = set()
        self.link.client()  # connect (or warn once) at engine start

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
        keys = self._ranks_keys(key)
        try:
            n = kc.lookup(keys)
        except Exception as e:
            if _is_disconnected(e):
                self.link.failed(e)
                return LookupResult.MISS
            if _is_kachedb_error(e):
                COUNTERS["lookup_errors"] += 1
                return LookupResult.MISS
            raise
        if n == len(keys):
            COUNTERS["lookup_hits"] += 1
            return LookupResult.HIT
        return LookupResult.MISS

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        keys = [bytes(k) for k in keys]
        if keys:
            # The request's next store chains on from the last block it loads.
            _set_chain_tail(req_context, keys[-1])
        return KacheDBLoadStoreSpec(keys)

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput:
        keys = [bytes(k) for k in keys if bytes(k) not in self._storing]
        kc = self.link.client()
        if kc is None or not keys:
            if kc is None and keys:
                COUNTERS["store_skipped_off_blocks"] += len(keys)
            return PrepareStoreOutput(keys_to_store=[], store_spec=KacheDBLoadStoreSpec([]), evicted_keys=[])
        try:
            # Keys come in prefix order: the leading run the daemon holds for every
            # rank needs no store. A block missing for one rank (evicted) is stored
            # again by all: lookups need every rank's copy.
            present = self._present(kc, keys)
        except Exception as e:
            if _is_disconnected(e):
                self.link.failed(e)
            elif not _is_kachedb_error(e):
                raise
            return PrepareStoreOutput(keys_to_store=[], store_spec=KacheDBLoadStoreSpec([]), evicted_keys=[])
        todo = keys[present:]
        COUNTERS["store_already_present_blocks"] += present
        self._storing.update(todo)
        # The stored blocks chain on from the last one the daemon has, else from
        # the last one this request stored before (docs/eviction.md).
        parent = keys[present - 1] if present else _chain_tail(req_context)
        _set_chain_tail(req_context, keys[-1])
        return PrepareStoreOutput(
            keys_to_store=todo, store_spec=KacheDBLoadStoreSpec(todo, parent), evicted_keys=[]
        )

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        self._storing.difference_update(bytes(k) for k in keys)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def reset_cache(self) -> None:
        self._storing.clear()

    def shutdown(self) -> None:
        self.link.close()


def _is_kachedb_error(e: BaseException) -> bool:
    import kachedb

    return isinstance(e, kachedb.KacheDBError)


def _is_disconnected(e: BaseException) -> bool:
    import kachedb

    return isinstance(e, kachedb.Disconnected)
