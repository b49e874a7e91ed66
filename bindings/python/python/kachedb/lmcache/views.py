"""``MemoryObj``s that are views of pinned KacheDB blocks, within a byte budget.

A chunk that a get returns this way is LMCache's ``TensorMemoryObj`` whose raw
data is the block's view in shared memory (no copy): the engine's transfer into
its KV cache reads the daemon's bytes directly. The view holds the block's pin,
so the daemon neither evicts nor reuses the block while LMCache holds the
object; ``ViewPins`` is the object's parent allocator, and LMCache's ``free``
(last reference and last LMCache pin gone) drops the view, and with it the pin.

LMCache writes a chunk got from a remote tier back into its local CPU tier
(``StorageManager.batched_get``), where it stays until LMCache evicts it. Those
objects hold pins without using the local tier's memory, so LMCache's own
eviction (driven by that memory) does not bound them: ``ViewPins`` does, for
them and for the chunks LMCache stores in the region (``region.py``), which
share its budget (``take``/``give``). The bytes of live view and region objects
stay within ``max_bytes``; to make room it drops the oldest ones that only the
local CPU tier holds and the daemon has (views, and stored chunks once
committed: ``track``) with ``LocalCPUBackend.remove``, as any external removal
(the chunk stays in the daemon, where a later lookup finds it), and when
nothing can be dropped the caller copies the chunk into the local CPU tier's
own memory instead (``wrap`` returns ``None``; the region allocator hands the
chunk to LMCache's own allocator).

The objects are read-only by contract, as every KacheDB view: LMCache reads a
retrieved chunk (into the KV cache, or to serialise it for another tier) and
never writes it.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Any, List, Optional, Sequence, Tuple

import torch

from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj


class ViewPins:
    """Parent allocator of the view-backed ``MemoryObj``s of one connector (see
    the module doc). Thread-safe: LMCache frees objects from its event loop, the
    engine's thread and its local tier's eviction; no LMCache lock is ever taken
    while this object's lock is held."""

    def __init__(self, max_bytes: int, local_cpu_backend: Any) -> None:
        self.max_bytes = int(max_bytes)
        self.local_cpu_backend = local_cpu_backend
        self._lock = threading.Lock()
        # id(obj) -> (key, weak reference to obj, bytes) of the objects that may
        # be dropped, oldest first: views (``wrap``) and committed region objects
        # (``track``); an entry leaves when the object is freed (weak: an object
        # LMCache loses without freeing it is still collected, and its
        # ``__del__`` frees it)
        self._live: "OrderedDict[int, Tuple[CacheEngineKey, Any, int]]" = OrderedDict()
        self._bytes = 0
        #: objects made, objects freed, objects dropped from LMCache's local tier to make room
        self.made = 0
        self.freed = 0
        self.dropped = 0

    @property
    def live_bytes(self) -> int:
        """Bytes of the view and region objects alive now (their blocks pinned
        or reserved)."""
        with self._lock:
            return self._bytes

    @property
    def live_objects(self) -> int:
        with self._lock:
            return len(self._live)

    def wrap(
        self,
        key: CacheEngineKey,
        view: torch.Tensor,
        shapes: Sequence[torch.Size],
        dtypes: Sequence[torch.dtype],
        fmt: MemoryFormat,
    ) -> Optional[TensorMemoryObj]:
        """A ``MemoryObj`` (one reference, the caller's) whose raw data is
        ``view`` (a 1-D uint8 view of a pinned block, exactly the chunk's bytes),
        or ``None`` when the budget has no room for it even after dropping what
        can be dropped."""
        nbytes = int(view.numel())
        if nbytes > self.max_bytes:
            return None
        if not self._reserve(nbytes):
            self.make_room(nbytes)
            if not self._reserve(nbytes):
                return None
        shapes, dtypes = list(shapes), list(dtypes)
        meta = MemoryObjMetadata(
            shapes[0], dtypes[0], view.data_ptr(), nbytes, 1, 0, fmt, shapes=shapes, dtypes=dtypes
        )
        obj = TensorMemoryObj(raw_data=view, metadata=meta, parent_allocator=self)
        with self._lock:
            self._live[id(obj)] = (key, weakref.ref(obj), nbytes)
            self.made += 1
        return obj

    def take(self, nbytes: int) -> bool:
        """Takes ``nbytes`` of the budget for an object made elsewhere (the
        ``RegionAllocator``'s chunks share it); ``False`` if they do not fit."""
        return self._reserve(nbytes)

    def give(self, nbytes: int) -> None:
        """Gives back what ``take`` took."""
        with self._lock:
            self._bytes -= nbytes

    def _reserve(self, nbytes: int) -> bool:
        with self._lock:
            if self._bytes + nbytes > self.max_bytes:
                return False
            self._bytes += nbytes
            return True

    def track(self, key: CacheEngineKey, obj: Any, nbytes: int) -> None:
        """Registers a region object committed under ``key`` (its bytes taken
        with ``take``) as one ``make_room`` may drop; ``forget`` when it is freed."""
        with self._lock:
            self._live[id(obj)] = (key, weakref.ref(obj), nbytes)

    def forget(self, obj: Any) -> None:
        """Unregisters what ``track`` registered (no bytes given back)."""
        with self._lock:
            self._live.pop(id(obj), None)

    def make_room(self, nbytes: int) -> None:
        """Asks LMCache's local CPU tier to drop its oldest registered objects
        that nothing else holds (one reference, no LMCache pin) until ``nbytes``
        more would fit. Their ``free`` gives the room back."""
        with self._lock:
            need = self._bytes + nbytes - self.max_bytes
            candidates: List[Tuple[CacheEngineKey, Any, int]] = list(self._live.values())
        lcb = self.local_cpu_backend
        hot = getattr(lcb, "hot_cache", None)
        if hot is None:
            return
        for key, ref, n in candidates:
            if need <= 0:
                break
            obj = ref()
            if obj is None or hot.get(key) is not obj or not obj.can_evict:
                continue
            if lcb.remove(key, force=True):
                self.dropped += 1
                need -= n

    # -- the allocator side LMCache calls ----------------------------------
    def free(self, memory_obj: Any) -> None:
        """LMCache's last reference (and last pin) of a view object is gone:
        the view goes, and with it the block's pin (once no tensor made from
        it is alive either). Idempotent."""
        with self._lock:
            entry = self._live.pop(id(memory_obj), None)
            if entry is None:
                return
            self._bytes -= entry[2]
            self.freed += 1
        memory_obj.invalidate()
        # the view is the pin: drop this object's hold on it now, not at GC
        memory_obj.raw_data = torch.empty(0, dtype=torch.uint8)

    def memcheck(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"<ViewPins {self.live_objects} objects, {self.live_bytes} of {self.max_bytes} bytes>"
