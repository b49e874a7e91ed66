"""Worker side: ``KacheDBOffloadingWorker`` moves KV blocks between vLLM's KV
cache and the daemon's shared memory.

A stored KacheDB block holds one vLLM block of one KV-cache group, all layers:
a ``(num_layers, page_bytes)`` uint8 tensor of the raw bytes of the worker's
pages, layers in vLLM's order (``keys.LAYOUT_VERSION``). It becomes visible
only when committed, after every layer is written.

Per scheduler step and direction there is one batch: a store is one RESERVE
batch, one copy per block straight into the reservations, and one COMMIT batch
(``reserve_many``); each
stored block names the one before it in its request's chain as its parent
(the first one: the last block the manager found in the daemon, else the last
block the request stored before; ``KacheDBLoadStoreSpec.parent``), so the
daemon's chain-aware eviction never evicts a block before the blocks that
follow it (docs/eviction.md). A load is
one ``get_prefix`` (lookup-and-pin of the leading present blocks, one round trip)
whose views are copied straight into the KV cache and then dropped (their pins go
with them). On vLLM's CPU engine a store batch is one native write of its
pages' byte ranges into the reservations (``Reservations.write_ranges``) and a
load a tensor copy per block, done before ``submit_*`` returns, so a block is in the daemon by the time the step
that stored it returns — or a store runs on the worker's store thread
(``_StoreThread``: reserve, copy, commit, in submission order, the GIL released
in the daemon calls and the copies), so ``submit_store`` returns at once and
the step goes on; ``get_finished`` reports the job once its blocks are
committed, ``wait`` blocks until then. vLLM learns of a finished store only at
a step, so the thread is used (``store_thread``: ``"auto"``, the default) only
for the stores of an engine that keeps stepping until they are reported (the
manager marks them, ``KacheDBLoadStoreSpec.background``: vLLM's engine-core
busy loop); in vLLM's in-process engine, which steps only for user requests,
the stores of a request's last step would be reported — ``complete_store``, KV
events — only at the next request, so there they stay inside the step.
A block is reported (and its ``BlockStored`` event published) only after its
job is committed. vLLM leaves the blocks of a store job
untouched until the job is reported finished: its scheduler frees or reuses
a stored block only after the job's completion, and flushes a job whose
blocks it must reuse sooner (preemption) through ``wait`` before the step's
forward pass (``jobs_to_flush``). What differs between devices is behind one
seam (``copies.py``): on CUDA the copies run on a side stream from the
registered region (``register_cuda``) and complete later, so reservations are
committed and pins dropped only once the copies' event has completed, and the
compute stream waits for a load's event; on the CPU engine they are done when
issued. The CPU suite drives the asynchronous branch with a stand-in device.

With tensor parallelism every rank stores and loads its own blocks under its
own namespace, except ranks that hold the same KV as a lower rank (MLA: every
rank holds the whole latent KV): those skip their stores, and load the blocks
the first rank of their group stored (``spec.is_store_writer``). In vLLM's
canonical layout (``spec.canonical``) a block holds every KV head: the
scheduler reserves it, each rank writes its heads into it in place through
vLLM's ``CanonicalPageMapping`` and sets its acknowledgement byte
(``_store_canonical``), the scheduler commits it once every rank's is set, and
each rank reads its heads back out of it, so engines of any TP degree share it.

Failures never give wrong KV to the engine: a block missing (evicted or deleted
since the lookup) or of the wrong shape is reported to vLLM as a failed load
(``get_block_ids_with_load_errors``), which recomputes it; a block of the wrong
shape or dtype can never load in this namespace, so it is also deleted from the
daemon (``_drop_unloadable``; the manager bounds a request's loads of one key
besides, ``MAX_LOADS_PER_KEY``); a full store skips the store; a daemon that is
gone turns the tier off (``_link``).
"""

from __future__ import annotations

import atexit
import collections
import threading
import weakref
import time
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence, Set, Tuple

import torch

from vllm.v1.kv_offload.base import CanonicalKVCaches, GPULoadStoreSpec, LoadStoreSpec, OffloadingWorker, TransferResult

from ._link import daemon_link
from .engine_spec import EngineSpec
from .copies import copies_for
from ._state import COUNTERS, LOADED_KEYS, STORED_KEYS, dump, stats_path


class _Group:
    """The layers of one KV-cache group: per-layer ``(num_blocks, page)`` uint8
    views, and when every layer lives in one buffer at a constant stride, a
    single ``(num_blocks, num_layers, page)`` view of it (one copy per block)."""

    def __init__(self, layers: List[torch.Tensor]) -> None:
        self.layers = layers
        self.num_layers = len(layers)
        self.page = int(layers[0].shape[1])
        if any(int(t.shape[1]) != self.page for t in layers):
            # Pages of different sizes: pad to the largest (the bytes stay exact).
            self.page = max(int(t.shape[1]) for t in layers)
        self.shape = (self.num_layers, self.page)
        self.blocks: Optional[torch.Tensor] = self._uniform_view(layers)
        self.device = layers[0].device
        #: Per range of a block: (address of block 0's bytes, bytes per block
        #: id, length); a block's bytes are these ranges in order, layers next
        #: to each other in memory merged. ``None`` when a block has padding
        #: (pages of different sizes) or a page is not contiguous.
        self._runs: Optional[List[Tuple[int, int, int]]] = self._byte_runs(layers)
        #: Canonical layout (``make_canonical``): each layer's vLLM ``CanonicalPageMapping``.
        self.mappings: Optional[List[Any]] = None
        self.canonical_page = 0
        #: The bytes of one block this rank moves (its own pages, all layers).
        self.block_bytes = self.num_layers * self.page

    def _byte_runs(self, layers: List[torch.Tensor]) -> Optional[List[Tuple[int, int, int]]]:
        if self.device.type != "cpu" or any(int(t.shape[1]) != self.page or t.stride(1) != 1 for t in layers):
            return None
        runs: List[Tuple[int, int, int]] = []
        for t in layers:
            base, stride = t.data_ptr(), t.stride(0)
            if runs and runs[-1][1] == stride and runs[-1][0] + runs[-1][2] == base:
                runs[-1] = (runs[-1][0], stride, runs[-1][2] + self.page)
            else:
                runs.append((base, stride, self.page))
        return runs

    def ranges(self, block_ids: Sequence[int]) -> Optional[Tuple[List[int], List[int]]]:
        """``(addresses, lengths)`` of the bytes of ``block_ids``, block after
        block (``Reservations.write_ranges``' order); ``None`` if the group's
        blocks are not plain byte ranges (see ``_runs``)."""
        if self._runs is None:
            return None
        addrs = [base + b * stride for b in block_ids for base, stride, _ in self._runs]
        return addrs, [n for _ in block_ids for _, _, n in self._runs]

    def _uniform_view(self, layers: List[torch.Tensor]) -> Optional[torch.Tensor]:
        first = layers[0]
        if any(int(t.shape[1]) != self.page or t.stride() != first.stride() for t in layers):
            return None
        if any(t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() for t in layers):
            return None
        if len(layers) == 1:
            return first.unsqueeze(1)
        step = layers[1].data_ptr() - first.data_ptr()
        if step <= 0 or any(layers[i].data_ptr() - first.data_ptr() != i * step for i in range(len(layers))):
            return None
        return first.as_strided(
            (int(first.shape[0]), len(layers), self.page),
            (first.stride(0), step, 1),
            first.storage_offset(),
        )

    def copy_block_out(self, dst: torch.Tensor, block_id: int, copy: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
        """Copies block ``block_id`` into ``dst`` (``(num_layers, page)``) with ``copy(dst, src)``."""
        if self.blocks is not None:
            copy(dst, self.blocks[block_id])
            return
        for l, t in enumerate(self.layers):
            copy(dst[l, : t.shape[1]], t[block_id])

    def make_canonical(self, mappings: List[Any], pages: List[int]) -> None:
        """Switches the group to vLLM's canonical layout: a stored block is
        ``(num_layers, canonical page)``, every KV head of each layer, into
        which this rank writes (and from which it reads) its own heads through
        each layer's ``CanonicalPageMapping`` (vLLM's: strided runs of bytes
        between this rank's page and the canonical page). Raises unless vLLM
        certified every layer's mapping as the same under any parallel config
        and its canonical page is the one the scheduler reserves."""
        if len(mappings) != self.num_layers or len(pages) != self.num_layers:
            raise RuntimeError(f"KacheDB: {len(mappings)} canonical mappings for {self.num_layers} layers")
        for l, (m, page) in enumerate(zip(mappings, pages)):
            if m is None or not bool(getattr(m, "parallelism_agnostic", False)):
                raise RuntimeError(
                    f"KacheDB: vLLM gave layer {l} no parallelism-agnostic canonical mapping: the canonical "
                    "layout cannot be written; start the engine without canonical_layout"
                )
            if int(m.canonical_page_size_bytes) != int(page):
                raise RuntimeError(
                    f"KacheDB: layer {l}'s canonical page is {m.canonical_page_size_bytes} bytes, the "
                    f"scheduler's {page}"
                )
        self.mappings = list(mappings)
        self.canonical_page = max(int(p) for p in pages)
        self.block_bytes = sum(int(m.local_page_size_bytes) for m in mappings)
        self.shape = (self.num_layers, self.canonical_page)

    def copy_canonical_out(self, dst: torch.Tensor, block_id: int, position: int, copy: Callable[[torch.Tensor, torch.Tensor], None]) -> int:
        """Copies this rank's heads of block ``block_id`` into the canonical
        block ``dst`` (``(num_layers, canonical page)``), layer by layer, where
        this rank is a writer of the job's ``position``-th block (ranks holding
        the same heads take turns, ``CanonicalPageMapping.is_writer``); the
        bytes it copied."""
        flat = dst.reshape(-1)
        written = 0
        for l, (t, m) in enumerate(zip(self.layers, self.mappings)):
            if not m.is_writer(position):
                continue
            written += int(m.local_page_size_bytes)
            page = t[block_id]
            for run in m.runs:
                shape = (int(run.num_fragments), int(run.fragment_size))
                src = page.as_strided(shape, (int(run.local_stride), 1), page.storage_offset() + int(run.local_offset))
                out = flat.as_strided(
                    shape, (int(run.canonical_stride), 1), flat.storage_offset() + l * self.canonical_page + int(run.canonical_offset)
                )
                copy(out, src)
        return written

    def copy_canonical_in(self, block_id: int, src: torch.Tensor, copy: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
        """Copies this rank's heads out of the canonical block ``src`` into block ``block_id``."""
        flat = src.reshape(-1)
        for l, (t, m) in enumerate(zip(self.layers, self.mappings)):
            page = t[block_id]
            for run in m.runs:
                shape = (int(run.num_fragments), int(run.fragment_size))
                dst = page.as_strided(shape, (int(run.local_stride), 1), page.storage_offset() + int(run.local_offset))
                piece = flat.as_strided(
                    shape, (int(run.canonical_stride), 1), flat.storage_offset() + l * self.canonical_page + int(run.canonical_offset)
                )
                copy(dst, piece)

    def copy_block_in(self, block_id: int, src: torch.Tensor, copy: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
        """Copies ``src`` (``(num_layers, page)``) into block ``block_id`` with ``copy(dst, src)``."""
        if self.mappings is not None:
            self.copy_canonical_in(block_id, src, copy)
            return
        if self.blocks is not None:
            copy(self.blocks[block_id], src)
            return
        for l, t in enumerate(self.layers):
            copy(t[block_id], src[l, : t.shape[1]])


@dataclass
class _Pending:
    """Copies in flight on an asynchronous device (``copies.py``): what to commit
    or release once ``event`` completes."""

    job_id: int
    event: Any
    nbytes: int
    started: float
    hold: List[Any] = field(default_factory=list)  # reservations to commit / views to keep pinned
    commit: bool = False
    blocks: int = 0  # blocks the reservations in ``hold`` hold (a ``reserve_many`` holds several)


class _StoreThread:
    """Runs store jobs one at a time, in submission order, off the engine's
    step: ``submit`` queues a job and returns; the thread runs it and
    ``on_done(job_id, nbytes, started)`` reports it. ``wait(ids)`` blocks
    until none of ``ids`` is queued or running; ``close()`` finishes the
    queued jobs, then stops the thread."""

    def __init__(self, run: Any, on_done: Any) -> None:
        self._run = run
        self._on_done = on_done
        self._cv = threading.Condition()
        self._queue: "collections.deque[Tuple[int, Any, Any, float]]" = collections.deque()
        self._open: Set[int] = set()  # queued or running
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="kachedb-vllm-store", daemon=True)
        self._thread.start()

    def submit(self, job_id: int, src_spec: Any, dst_spec: Any) -> None:
        with self._cv:
            if not self._closing:
                self._open.add(job_id)
                self._queue.append((job_id, src_spec, dst_spec, time.perf_counter()))
                self._cv.notify_all()
                return
        # closed (a store after shutdown): run here, so that it is still reported
        self._run_one(job_id, src_spec, dst_spec, time.perf_counter())

    def busy(self) -> bool:
        with self._cv:
            return bool(self._open)

    def wait(self, job_ids: Optional[Set[int]] = None) -> None:
        with self._cv:
            self._cv.wait_for(lambda: not (self._open if job_ids is None else self._open & set(job_ids)))

    def close(self) -> None:
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._thread.join()

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._closing)
                if not self._queue:
                    return
                job_id, src_spec, dst_spec, started = self._queue.popleft()
            self._run_one(job_id, src_spec, dst_spec, started)
            with self._cv:
                self._open.discard(job_id)
                self._cv.notify_all()

    def _run_one(self, job_id: int, src_spec: Any, dst_spec: Any, started: float) -> None:
        nbytes = 0
        try:
            nbytes = self._run(src_spec, dst_spec)
        except BaseException as e:  # never lose the thread: the job is reported, as a skipped store
            COUNTERS["store_errors"] += 1
            _log_once("store_thread", "KacheDB store failed (%r): skipped", e)
        self._on_done(job_id, nbytes, started)


class KacheDBOffloadingWorker(OffloadingWorker):
    def __init__(self, spec: EngineSpec, kv_caches: CanonicalKVCaches, copies: Any = None) -> None:
        """``copies``: how block copies run on the KV caches' device (``copies.py``;
        default: ``copies_for`` that device)."""
        self.spec = spec
        self.link = daemon_link(spec.socket, f"worker rank {spec.rank}", spec.retry_s, getattr(spec, "tenant", None))
        self.groups: List[_Group] = []
        canonical = getattr(spec, "canonical", None) is not None
        for gi, refs in enumerate(kv_caches.group_data_refs):
            layers = []
            for ref in refs:
                t = kv_caches.tensors[ref.tensor_idx].tensor
                t = t.view(torch.uint8) if t.dtype != torch.uint8 else t
                layers.append(t[:, : ref.page_size_bytes])
            group = _Group(layers)
            if canonical:
                group.make_canonical([getattr(r, "mapping", None) for r in refs], spec.canonical_pages[gi])
            self.groups.append(group)
        self.copies = copies if copies is not None else copies_for(self.groups[0].device)
        #: Copies may still run after the call that queued them: reservations are
        #: committed and views dropped once their event completes (``_reap``).
        self.asynchronous: bool = bool(self.copies.asynchronous)
        self._registered = False
        self._finished: List[TransferResult] = []
        self._pending: List[_Pending] = []
        self._invalid: Set[int] = set()
        self._failed_jobs: Set[int] = set()
        # ``_finished`` is appended to by the store thread too
        self._finished_lock = threading.Lock()
        #: ``"auto"`` (a store job runs on the thread when its spec says the engine
        #: keeps stepping until it is reported), ``True`` (every job) or ``False``.
        self._thread_mode: Any = getattr(spec, "store_thread", "auto")
        threaded = self._thread_mode is not False and not self.asynchronous
        self._stores: Optional[_StoreThread] = _StoreThread(self._store_job, self._done) if threaded else None
        _WORKERS.add(self)
        self.link.client()

    # -- helpers ---------------------------------------------------------
    def _client(self) -> Any:
        kc = self.link.client()
        if kc is not None and self.asynchronous and not self._registered:
            try:
                self.copies.register(kc)
                self._registered = True
            except Exception as e:  # copies still work, as pageable ones
                COUNTERS["register_cuda_failed"] += 1
                self._registered = True
                import logging

                logging.getLogger("kachedb.vllm").warning("register_cuda() failed (%s); copies are pageable", e)
        return kc

    def _split(self, spec: GPULoadStoreSpec, keys: Sequence[bytes]) -> List[Tuple[_Group, List[int], List[bytes]]]:
        """Per group: (group, GPU block ids, offload keys)."""
        ids = [int(b) for b in spec.block_ids]
        sizes = list(spec.group_sizes) if spec.group_sizes is not None else [len(ids)]
        if len(keys) != len(ids):
            raise ValueError(f"KacheDB: {len(keys)} keys for {len(ids)} blocks")
        out, start = [], 0
        for g, n in zip(self.groups, sizes):
            out.append((g, ids[start : start + n], list(keys[start : start + n])))
            start += n
        return out

    def _done(self, job_id: int, nbytes: int, started: float) -> None:
        r = TransferResult(job_id=job_id, success=True, transfer_size=nbytes, transfer_time=time.perf_counter() - started)
        with self._finished_lock:
            self._finished.append(r)

    # -- stores ----------------------------------------------------------
    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        """Queues the store on the store thread (CPU: reported by
        ``get_finished`` once committed), or starts its copies on the side
        stream (CUDA: committed once they complete)."""
        if self._stores is not None and (self._thread_mode is True or getattr(dst_spec, "background", False)):
            COUNTERS["store_thread_jobs"] += 1
            self._stores.submit(job_id, src_spec, dst_spec)
            return True
        started = time.perf_counter()
        nbytes, async_hold, async_blocks = self._store(src_spec, dst_spec)
        if async_hold:
            # Committed (made visible) once the device->shm copies have completed.
            ev = self.copies.record()
            self._pending.append(_Pending(job_id, ev, nbytes, started, async_hold, commit=True, blocks=async_blocks))
        else:
            self._done(job_id, nbytes, started)
        return True

    def _store_job(self, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> int:
        """One store job on the store thread (CPU): its bytes. Copied by this
        thread alone: the engine's step runs beside it."""
        return self._store(src_spec, dst_spec, copy_threads=1)[0]

    def _store(
        self, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec, copy_threads: Optional[int] = None
    ) -> Tuple[int, List[Any], int]:
        """Reserves, copies and (synchronous copies) commits one job's blocks;
        ``(bytes, reservations to commit once the copies complete (asynchronous
        copies), their blocks)``.
        ``copy_threads``: most threads of a CPU copy (``None``: by size)."""
        import kachedb

        started = time.perf_counter()
        keys = getattr(dst_spec, "keys", [])
        nbytes = 0
        async_hold: List[Any] = []
        async_blocks = 0
        if getattr(self.spec, "canonical", None) is not None:
            return self._store_canonical(dst_spec, src_spec)
        if not getattr(self.spec, "is_store_writer", True):
            # Another rank holds the same KV (MLA) and stores it, once, under the
            # key this rank reads too.
            COUNTERS["store_skipped_replica_blocks"] += len(keys)
            return 0, [], 0
        kc = self._client()
        if kc is None:
            COUNTERS["store_skipped_off_blocks"] += len(keys)
            return 0, [], 0
        # The block before the first one stored (with several KV-cache groups,
        # the one before the first in the store's chain order).
        first = getattr(dst_spec, "parent", None)
        first = self.spec.daemon_key(first) if first is not None else None
        # What the scheduler knows of each block (manager._block_metas), for the
        # daemon's KV events: attached by the first rank of the namespaces only,
        # so a block stored once per rank is one block to a router.
        metas = getattr(dst_spec, "metas", None)
        store_ranks = list(getattr(self.spec, "store_ranks", [0]) or [0])
        meta_of = dict(zip(keys, metas)) if metas and getattr(self.spec, "rank", 0) == store_ranks[0] else {}
        try:
            prev = first
            for group, ids, okeys in self._runs(src_spec, keys, getattr(dst_spec, "chain", None)):
                if not ids:
                    continue
                dkeys = [self.spec.daemon_key(k) for k in okeys]
                # consecutive blocks of one request chain, runs committed in its order
                parents = [prev] + dkeys[:-1]
                prev = dkeys[-1]
                gmetas = [meta_of.get(bytes(k)) for k in okeys] if meta_of else None
                held = self._store_blocks(kc, group, ids, dkeys, parents, copy_threads, gmetas)
                nbytes += len(ids) * group.num_layers * group.page
                STORED_KEYS.extend(k.hex() for k in dkeys)
                if self.asynchronous:
                    # Committed once the copies' event completes (_reap).
                    async_hold.extend(held)
                    async_blocks += len(ids)
                    continue
                for r in held:
                    r.commit()
                held = None
                COUNTERS["store_batches"] += 1
                COUNTERS["stored_blocks"] += len(ids)
        except (kachedb.OutOfMemory, kachedb.TooLarge) as e:
            COUNTERS["store_skipped_full"] += 1
            _log_once("store_full", "KacheDB store full (%s): skipping stores until there is room", e)
        except kachedb.Disconnected as e:
            self.link.failed(e)
        except kachedb.KacheDBError as e:  # anything else the daemon refused: skip, never stop the engine
            COUNTERS["store_errors"] += 1
            _log_once("store_error", "KacheDB store failed (%s): skipped", e)
        COUNTERS["store_seconds"] += time.perf_counter() - started
        return nbytes, async_hold, async_blocks

    def _store_canonical(self, dst_spec: Any, src_spec: GPULoadStoreSpec) -> Tuple[int, List[Any], int]:
        """Writes this rank's heads of a job's blocks into the canonical blocks
        the scheduler reserved (``dst_spec.slots``, offsets in the region), then
        sets this rank's acknowledgement byte (``dst_spec.ack``): the scheduler
        commits the blocks only once every rank's is set. Asynchronous copies
        set it once their event completes (``_Acknowledge``, reaped as a
        commit). A rank that cannot write (no daemon) leaves it unset, and the
        job's blocks are aborted, never committed without its heads."""
        keys = getattr(dst_spec, "keys", [])
        slots = getattr(dst_spec, "slots", None)
        ack = getattr(dst_spec, "ack", None)
        if not keys or slots is None or ack is None:
            return 0, [], 0
        kc = self._client()
        if kc is None:
            COUNTERS["store_skipped_off_blocks"] += len(keys)
            return 0, [], 0
        slot_of = {bytes(k): (i, int(o)) for i, (k, o) in enumerate(zip(keys, slots))}
        nbytes = 0
        try:
            base = int(kc._check().region_span()[0])
            self.copies.begin()
            with self.copies.stream():
                for group, ids, okeys in self._split(src_spec, keys):
                    block_bytes = group.num_layers * group.canonical_page
                    for b, k in zip(ids, okeys):
                        position, offset = slot_of[bytes(k)]
                        dst = _region_bytes(base + offset, block_bytes)
                        nbytes += group.copy_canonical_out(dst, b, position, self.copies.copy)
        except Exception as e:  # unacknowledged: the scheduler aborts the job's blocks
            self.copies.abandon()
            COUNTERS["store_errors"] += 1
            _log_once("store_canonical", "KacheDB canonical store failed (%r): its blocks are not committed", e)
            return 0, [], 0
        STORED_KEYS.extend(self.spec.daemon_key(k).hex() for k in keys)
        acknowledge = _Acknowledge(_region_bytes(base + ack, self.spec.world_size), self.spec.rank)
        COUNTERS["store_canonical_blocks"] += len(keys)
        if self.asynchronous:
            return nbytes, [acknowledge], len(keys)
        acknowledge.commit()
        COUNTERS["store_batches"] += 1
        COUNTERS["stored_blocks"] += len(keys)
        return nbytes, [], 0

    @staticmethod
    def _attach_metas(held: List[Any], metas: List[Any]) -> None:
        """Attaches the blocks' metadata to their reservations (one native call
        for a batch); a refusal leaves the blocks to be reported by key."""
        import kachedb

        try:
            if len(held) == 1 and isinstance(held[0], kachedb.Reservations):
                held[0].attach_meta(metas)
            else:
                for r, m in zip(held, metas):
                    if m is not None:
                        r.attach_meta(m)
            COUNTERS["store_meta_blocks"] += sum(m is not None for m in metas)
        except kachedb.Disconnected:
            raise
        except kachedb.KacheDBError as e:
            COUNTERS["store_meta_errors"] += 1
            _log_once("store_meta", "KacheDB refused block metadata (%s): the blocks are reported by key", e)

    def _runs(
        self, spec: GPULoadStoreSpec, keys: Sequence[bytes], chain: Optional[Sequence[bytes]]
    ) -> List[Tuple[_Group, List[int], List[bytes]]]:
        """The store's blocks as runs of one group each, in the order they are
        chained and committed: ``chain`` (the manager's chain order across
        groups) cut where the group changes; without it, group by group."""
        parts = self._split(spec, keys)
        if not chain or len(parts) < 2:
            return parts
        where = {bytes(k): (gi, i) for gi, (_, _, okeys) in enumerate(parts) for i, k in enumerate(okeys)}
        if len(where) != len(keys) or set(where) != {bytes(k) for k in chain} or len(chain) != len(keys):
            return parts  # not the same blocks: group by group
        runs: List[Tuple[_Group, List[int], List[bytes]]] = []
        last = -1
        for k in chain:
            gi, i = where[bytes(k)]
            group, ids, okeys = parts[gi]
            if gi != last:
                runs.append((group, [], []))
                last = gi
            runs[-1][1].append(ids[i])
            runs[-1][2].append(okeys[i])
        return runs

    def _store_blocks(
        self,
        kc: Any,
        group: _Group,
        ids: List[int],
        dkeys: List[bytes],
        parents: List[Optional[bytes]],
        copy_threads: Optional[int] = None,
        metas: Optional[List[Any]] = None,
    ) -> List[Any]:
        """Reserves the blocks of one group and copies them out of the KV cache
        into the reservations; returns the reservations, not committed yet (the
        caller commits: at once for synchronous copies, when the copies' event
        completes for asynchronous ones). One code path for both: ``store_mode``
        ``batched`` makes one RESERVE batch (``reserve_many``), ``reserve`` one
        RESERVE per block; asynchronous copies (CUDA) run after the forward pass
        that wrote the blocks (``copies.begin``). On CPU a batch whose blocks are plain byte ranges of
        the KV cache is written by one native call (``write_ranges``: streaming
        stores, GIL released once, no tensor made, on ``copy_threads``
        threads) instead of a torch copy per block, whose OpenMP team would
        take every core from the engine's step. ``metas``: each block's
        ``kachedb.BlockMeta`` (or ``None``), attached to its reservation."""
        ranges = None
        if self.spec.store_mode == "reserve":
            held = [kc.reserve(k, group.shape, torch.uint8, parent=p) for k, p in zip(dkeys, parents)]
            outs = [r.out for r in held]
        else:
            held = [kc.reserve_many(dkeys, group.shape, torch.uint8, parents=parents)]
            ranges = None if self.asynchronous else group.ranges(ids)
            outs = [] if ranges is not None else list(held[0].out)
        if metas and any(m is not None for m in metas):
            self._attach_metas(held, metas)
        try:
            if ranges is not None:
                held[0].write_ranges(*ranges, threads=copy_threads)
            else:
                self.copies.begin()
            with self.copies.stream():
                for out, b in zip(outs, ids):
                    group.copy_block_out(out, b, self.copies.copy)
        except BaseException:
            self.copies.abandon()
            outs = None
            for r in held:
                try:
                    r.abort()
                except Exception:
                    pass
            raise
        return held

    # -- loads -----------------------------------------------------------
    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        import kachedb

        started = time.perf_counter()
        keys = getattr(src_spec, "keys", [])
        nbytes = 0
        kc = self._client()
        parts = self._split(dst_spec, keys)
        hold: List[Any] = []
        for group, ids, okeys in parts:
            if not ids:
                continue
            views: List[Any] = []
            if kc is not None:
                try:
                    dkeys = [self.spec.daemon_key(k) for k in okeys]
                    # get_prefix pins each block as it looks it up (one round trip; no
                    # eviction in between) and stops at the first missing one.
                    views = kc.get_prefix(dkeys)
                except kachedb.Disconnected as e:
                    self.link.failed(e)
                    kc, views = None, []
                except kachedb.KacheDBError as e:  # reported as failed loads: recomputed
                    COUNTERS["load_errors"] += 1
                    _log_once("load_error", "KacheDB load failed (%s): the blocks are recomputed", e)
                    views = []
            COUNTERS["load_batches"] += 1
            n_ok = 0
            for v in views:
                if v is None or tuple(v.shape) != group.shape or v.dtype != torch.uint8:
                    break
                n_ok += 1
            if n_ok < len(views) and views[n_ok] is not None and kc is not None:
                self._drop_unloadable(kc, dkeys[n_ok], views[n_ok], group)
            if n_ok:
                self.copies.begin()
            with self.copies.stream():
                for b, v in zip(ids[:n_ok], views[:n_ok]):
                    group.copy_block_in(b, v, self.copies.copy)
            nbytes += n_ok * group.block_bytes
            COUNTERS["loaded_blocks"] += n_ok
            if n_ok:
                LOADED_KEYS.extend(k.hex() for k in dkeys[:n_ok])
            if n_ok < len(ids):
                # Missing (evicted or deleted since the lookup), foreign or daemon gone:
                # vLLM recomputes these blocks (kv_load_failure_policy="recompute").
                failed = ids[n_ok:]
                COUNTERS["load_failed_blocks"] += len(failed)
                COUNTERS["load_failures"] += 1
                self._invalid.update(failed)
                self._failed_jobs.add(job_id)
            if self.asynchronous:
                # The views (and their pins) live until the copies have read them.
                hold.extend(views[:n_ok])
            del views
        COUNTERS["load_seconds"] += time.perf_counter() - started
        if self.asynchronous and hold:
            ev = self.copies.record()
            # The loaded blocks must be in place before the forward pass reads them.
            self.copies.before_compute(ev)
            self._pending.append(_Pending(job_id, ev, nbytes, started, hold))
        else:
            self._done(job_id, nbytes, started)
        return True

    def _drop_unloadable(self, kc: Any, dkey: bytes, view: Any, group: _Group) -> None:
        """Deletes a block of this engine's namespace that is not of its layout
        (written by something that is not this layout's worker): it can never
        load, and left in place every lookup would find it again and every load
        fail on it. A delete the daemon refuses (another tenant's block) is
        logged; the manager's per-request bound ends the retries then."""
        import kachedb

        COUNTERS["load_unloadable_blocks"] += 1
        _log_once(
            "unloadable",
            "KacheDB: block %s is %s %s, this engine's blocks are uint8 %s: deleted (it can never load here)",
            dkey.hex(),
            getattr(view, "dtype", "?"),
            tuple(getattr(view, "shape", ())),
            group.shape,
        )
        try:
            kc.delete(dkey)
            COUNTERS["load_deleted_unloadable_blocks"] += 1
        except kachedb.Disconnected as e:
            self.link.failed(e)
        except kachedb.KacheDBError as e:
            _log_once("unloadable_delete", "KacheDB: could not delete unloadable block %s (%s)", dkey.hex(), e)

    # -- completion ------------------------------------------------------
    def _reap(self, block: bool) -> None:
        import kachedb

        still = []
        for p in self._pending:
            if block:
                self.copies.wait(p.event)
            elif not self.copies.done(p.event):
                still.append(p)
                continue
            if p.commit:
                try:
                    for r in p.hold:
                        r.commit()
                    COUNTERS["store_batches"] += 1
                    COUNTERS["stored_blocks"] += p.blocks
                except kachedb.Disconnected as e:
                    self.link.failed(e)
                except kachedb.KacheDBError:
                    for r in p.hold:
                        try:
                            r.abort()
                        except Exception:
                            pass
            p.hold.clear()  # releases pins (views) / reservations
            self._done(p.job_id, p.nbytes, p.started)
        self._pending = still

    def get_finished(self) -> List[TransferResult]:
        if self._pending:
            self._reap(block=False)
        with self._finished_lock:
            out, self._finished = self._finished, []
        return out

    def wait(self, job_ids: Set[int]) -> None:
        if self._stores is not None:
            self._stores.wait(set(job_ids))
        if self._pending:
            self._reap(block=True)

    def flush(self) -> None:
        """Waits until every store submitted so far is committed (or skipped)."""
        if self._stores is not None:
            self._stores.wait()
        if self._pending:
            self._reap(block=True)

    def take_invalid_block_ids(self) -> Set[int]:
        """GPU block ids whose load failed since the last call (vLLM recomputes them)."""
        out, self._invalid = self._invalid, set()
        return out

    def take_failed_load_jobs(self) -> Set[int]:
        """Load jobs with a failed block since the last call."""
        out, self._failed_jobs = self._failed_jobs, set()
        return out

    def shutdown(self) -> None:
        if self._stores is not None:
            self._stores.close()  # the queued stores first
        if self._pending:
            self._reap(block=True)
        if self.spec.stats_file:
            try:
                dump(stats_path(self.spec.stats_file, self.spec.rank, getattr(self.spec, "world_size", 1)))
            except OSError:
                pass
        self.link.close()


def _region_bytes(address: int, nbytes: int) -> torch.Tensor:
    """A writable uint8 tensor over ``nbytes`` of the daemon's region at
    ``address`` in this process (a block the scheduler holds reserved)."""
    import ctypes

    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), dtype=torch.uint8)


class _Acknowledge:
    """Sets a rank's byte of a canonical store job's acknowledgements once its
    part is written (``commit``; reaped like a reservation's commit)."""

    def __init__(self, acks: torch.Tensor, rank: int) -> None:
        self.acks = acks
        self.rank = int(rank)

    def commit(self) -> None:
        self.acks[self.rank] = 1

    def abort(self) -> None:
        """Leaves the byte unset: the scheduler aborts the job's blocks."""


#: The workers of this process (``flush_stores``; at exit, their queued stores
#: are finished before the interpreter stops their threads).
_WORKERS: "weakref.WeakSet[KacheDBOffloadingWorker]" = weakref.WeakSet()


def flush_stores() -> None:
    """Waits until every store submitted by this process's workers so far is
    committed (or skipped)."""
    for w in list(_WORKERS):
        w.flush()


atexit.register(flush_stores)


_logged: Set[str] = set()


def _log_once(tag: str, msg: str, *args: Any) -> None:
    if tag not in _logged:
        _logged.add(tag)
        import logging

        logging.getLogger("kachedb.vllm").warning(msg, *args)
