"""LMCache's local CPU tier allocating its chunks in the daemon's shared memory.

Every chunk LMCache stores is allocated from its ``LocalCPUBackend``'s allocator
(``StorageManager.allocate``, no key) and written there by its GPU connector (the
one copy a store needs); the remote backends are then handed that same
``MemoryObj`` (``StorageManager.batched_put``: a backend whose allocator backend
is the local CPU one gets the object itself, and the ``naive`` serde passes it
through). ``RegionAllocator`` takes the local backend's allocator's place: a
chunk's ``MemoryObj`` is LMCache's ``TensorMemoryObj`` over a block reserved in
the daemon's region without a key (``Client.reserve(None, ...)``). When the
KacheDB connector is handed the object to store, it commits that reservation
under the chunk's key (``commit_objects``: one batch of COMMIT_PINs naming the
keys, docs/PROTOCOL.md "COMMIT and the key"): the chunk is in the daemon with no
further copy, and pinned while LMCache holds the object (its local tier keeps
reading it). LMCache's ``free`` (last reference, last LMCache pin) drops the
object's tensor: the pin goes, or, for a chunk never stored, the reservation
is aborted.

What it does not take, its original allocator serves (which stays the local
backend's allocator in every other respect: ``close``, ``memcheck``,
``align_bytes``...): another memory format or layout than the engine's chunks, a
chunk while the daemon is not connected or refuses the RESERVE, and the copies
the connector itself makes (``bypass()``). Its objects and the views of
``ViewPins`` share one byte budget (``max_pinned_bytes``): past it the oldest
committed ones only LMCache's local tier holds are dropped from it
(``ViewPins.make_room``; they stay in the daemon), and when that frees nothing
the chunk goes to the original allocator (and is copied when stored, as
before).

Full chunks are reserved ahead, in one batch: right after a store's commit
(on the same thread, while the daemon is awake from it) as many full-chunk
reservations as that commit had are made for the next store (``refill``; at
most ``POOL_MAX_CHUNKS`` and a quarter of the budget, taken from the budget),
so a store's allocations make no round trip to the daemon. ``drain`` (and
``close``) gives them back.

Thread-safe: LMCache allocates on the engine's thread and its event loop, and
frees from either and from its eviction; no LMCache lock is taken here.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

import kachedb
from lmcache.v1.memory_management import (
    MemoryAllocatorInterface,
    MemoryFormat,
    MemoryObj,
    MemoryObjMetadata,
    TensorMemoryObj,
)

from ._stats import COUNTERS

#: Most full-chunk reservations kept ready for the next store.
POOL_MAX_CHUNKS = 32


class RegionAllocator(MemoryAllocatorInterface):
    """The local CPU backend's allocator with its chunks in the daemon's region
    (see the module doc). ``original`` is the allocator it stands in front of;
    ``client`` returns the connected client or ``None``; ``fits(shapes,
    dtypes, fmt)`` says whether a chunk is laid out as the engine's chunks are;
    ``budget`` is the ``ViewPins`` whose byte budget it shares."""

    def __init__(
        self,
        original: MemoryAllocatorInterface,
        client: Callable[[], Any],
        fits: Callable[[Sequence[torch.Size], Sequence[torch.dtype], MemoryFormat], bool],
        budget: Any,
        full_chunk_bytes: Callable[[], int],
    ) -> None:
        self.original = original
        self._client = client
        self._fits = fits
        self.budget = budget
        self._full_chunk_bytes = full_chunk_bytes
        self._lock = threading.Lock()
        # (reservation, client, bytes) of full chunks reserved ahead
        self._pool: List[Tuple[Any, Any, int]] = []
        self._last_batch = 0
        # id(obj) -> (reservation, client, bytes) of every live region object
        self._live: Dict[int, Tuple[Any, Any, int]] = {}
        self._bypass = threading.local()
        #: objects made in the region, freed, committed by a store
        self.made = 0
        self.freed = 0
        self.committed = 0

    def __getattr__(self, name: str) -> Any:
        # Everything else LMCache reads off its allocator (align_bytes,
        # numa_mapping, ...) is the original's.
        if name == "original":
            raise AttributeError(name)
        return getattr(self.original, name)

    @property
    def live_objects(self) -> int:
        with self._lock:
            return len(self._live)

    @property
    def pooled(self) -> int:
        """Full-chunk reservations kept ready for the next store."""
        with self._lock:
            return len(self._pool)

    # -- LMCache's allocator interface -------------------------------------
    def allocate(
        self,
        shapes: Any,
        dtypes: Any,
        fmt: MemoryFormat = MemoryFormat.UNDEFINED,
        allocator_type: Optional[str] = None,
    ) -> Optional[MemoryObj]:
        shapes_l, dtypes_l = self._adapt_shapes_and_dtypes(shapes, dtypes)
        kc = None if getattr(self._bypass, "on", False) or not self._fits(shapes_l, dtypes_l, fmt) else self._client()
        if kc is None:
            return self.original.allocate(shapes, dtypes, fmt, allocator_type)
        nbytes = sum(s.numel() * d.itemsize for s, d in zip(shapes_l, dtypes_l))
        if nbytes <= 0:
            return self.original.allocate(shapes, dtypes, fmt, allocator_type)
        r = self._from_pool(kc, nbytes)
        if r is None:
            if not self.budget.take(nbytes):
                self.budget.make_room(nbytes)
                if not self.budget.take(nbytes):
                    COUNTERS["region_budget_full"] += 1
                    return self.original.allocate(shapes, dtypes, fmt, allocator_type)
            try:
                r = kc.reserve(None, (nbytes,), torch.uint8)
            except kachedb.KacheDBError:
                self.budget.give(nbytes)
                COUNTERS["region_reserve_failed"] += 1
                return self.original.allocate(shapes, dtypes, fmt, allocator_type)
        view = r.out
        meta = MemoryObjMetadata(
            shapes_l[0], dtypes_l[0], view.data_ptr(), nbytes, 1, 0, fmt, shapes=list(shapes_l), dtypes=list(dtypes_l)
        )
        obj = TensorMemoryObj(raw_data=view, metadata=meta, parent_allocator=self)
        with self._lock:
            self._live[id(obj)] = (r, kc, nbytes)
            self.made += 1
        COUNTERS["region_allocated"] += 1
        return obj

    def batched_allocate(
        self,
        shapes: Any,
        dtypes: Any,
        batch_size: int,
        fmt: MemoryFormat = MemoryFormat.UNDEFINED,
        allocator_type: Optional[str] = None,
    ) -> Optional[List[MemoryObj]]:
        # Layerwise batches (the only caller) are not stored by this tier.
        return self.original.batched_allocate(shapes, dtypes, batch_size, fmt, allocator_type)

    def free(self, memory_obj: MemoryObj, allocator_type: Optional[str] = None) -> None:
        """LMCache's last reference (and last pin) of a region object is gone:
        its tensor goes, and with the last tensor made from it the block's pin
        (a stored chunk) or the reservation (one never stored). Idempotent."""
        with self._lock:
            entry = self._live.pop(id(memory_obj), None)
            if entry is None:
                return
            self.freed += 1
        memory_obj.invalidate()
        memory_obj.raw_data = torch.empty(0, dtype=torch.uint8)
        self.budget.forget(memory_obj)
        self.budget.give(entry[2])
        reservation = entry[0]
        del entry
        if not reservation.finished:
            # Never stored: abort it (at once, or when the last tensor of it goes).
            reservation.abort()

    def batched_free(
        self, memory_objs: List[MemoryObj], allocator_type: Optional[str] = None, update_stats: bool = True
    ) -> None:
        for obj in memory_objs:
            if obj.parent_allocator is self:
                self.free(obj)
            else:
                self.original.free(obj)

    def close(self) -> None:
        self.drain()
        self.original.close()

    def memcheck(self) -> bool:
        return self.original.memcheck()

    # -- the connector's side ------------------------------------------------
    def owns_open(self, memory_obj: Any) -> bool:
        """Whether ``memory_obj`` is a region object of this allocator not yet
        committed (a store commits it in place)."""
        with self._lock:
            entry = self._live.get(id(memory_obj))
        return entry is not None and not entry[0].finished

    def commit_objects(
        self,
        kc: Any,
        objs: Sequence[MemoryObj],
        keys: Sequence[bytes],
        chunk_keys: Sequence[Any],
        metas: Optional[Sequence[Any]] = None,
        parents: Optional[Sequence[Any]] = None,
    ) -> List[bool]:
        """Commits the open region objects ``objs`` under ``keys`` (one batch;
        those of a client other than ``kc``, which is gone, are left open),
        each with its record ``metas[i]`` (a ``kachedb.BlockMeta`` or ``None``)
        attached first and naming ``parents[i]`` (a key or ``None``) as the
        block it follows: whether each is in the daemon now, pinned while LMCache
        holds it, and droppable from LMCache's local tier (``chunk_keys``, its
        keys there) to make room. Errors of the batch (``Disconnected``...)
        propagate."""
        with self._lock:
            entries = [self._live.get(id(o)) for o in objs]
        ok = [False] * len(objs)
        at = [i for i, e in enumerate(entries) if e is not None and e[1] is kc and not e[0].finished]
        if not at:
            return ok
        done = kc.commit_as(
            [entries[i][0] for i in at],
            [keys[i] for i in at],
            None if metas is None else [metas[i] for i in at],
            None if parents is None else [parents[i] for i in at],
        )
        for i, d in zip(at, done):
            ok[i] = bool(d)
            if ok[i]:
                self.budget.track(chunk_keys[i], objs[i], entries[i][2])
        with self._lock:
            self.committed += sum(ok)
            self._last_batch = sum(ok)
        return ok

    # -- full chunks reserved ahead -------------------------------------------
    def _from_pool(self, kc: Any, nbytes: int) -> Optional[Any]:
        """A reservation of ``nbytes`` kept ready by ``refill`` (its budget
        taken), or ``None``. Ones of another client than ``kc`` are dropped."""
        stale = []
        with self._lock:
            while self._pool and self._pool[-1][1] is not kc:
                stale.append(self._pool.pop())
            got = self._pool.pop() if self._pool and self._pool[-1][2] == nbytes else None
        for r, _, n in stale:
            self.budget.give(n)
            r.abort()
        return None if got is None else got[0]

    def refill(self, kc: Any) -> None:
        """Reserves ahead, in one batch, as many full chunks as the last commit
        had (at most ``POOL_MAX_CHUNKS`` and a quarter of the budget, within
        what the budget has free). Errors are the caller's (a full daemon is
        not one: nothing is reserved then)."""
        full = int(self._full_chunk_bytes())
        if full <= 0:
            return
        with self._lock:
            if self._pool and self._pool[-1][1] is not kc or any(n != full for _, _, n in self._pool):
                stale, self._pool = self._pool, []
            else:
                stale = []
            want = min(POOL_MAX_CHUNKS, self._last_batch, self.budget.max_bytes // 4 // full) - len(self._pool)
        for r, _, n in stale:
            self.budget.give(n)
            r.abort()
        taken = 0
        while taken < want and self.budget.take(full):
            taken += 1
        if taken == 0:
            return
        try:
            rs = kc.reserve_each(taken, (full,), torch.uint8)
        except (kachedb.OutOfMemory, kachedb.TooLarge):
            self.budget.give(taken * full)
            return
        except BaseException:
            self.budget.give(taken * full)
            raise
        with self._lock:
            self._pool.extend((r, kc, full) for r in rs)

    def drain(self) -> None:
        """Gives back every reservation kept ready (aborts them)."""
        with self._lock:
            pool, self._pool = self._pool, []
        for r, _, n in pool:
            self.budget.give(n)
            r.abort()

    def bypass(self) -> "_Bypass":
        """``with alloc.bypass(): ...``: allocations of this thread go to the
        original allocator (the connector's copies of got chunks, which are in
        the daemon already)."""
        return _Bypass(self._bypass)

    def __repr__(self) -> str:
        return f"<RegionAllocator {self.live_objects} objects in front of {self.original!r}>"


class _Bypass:
    def __init__(self, flag: threading.local) -> None:
        self.flag = flag

    def __enter__(self) -> None:
        self.prev = getattr(self.flag, "on", False)
        self.flag.on = True

    def __exit__(self, *exc: Any) -> None:
        self.flag.on = self.prev
