"""``KacheDBConnector``: vLLM's ``OffloadingConnector`` with three additions that
the stock connector lacks (vLLM 0.32):

* failed loads are reported to the scheduler (``get_block_ids_with_load_errors``),
  which recomputes those blocks (``kv_load_failure_policy="recompute"``); the
  stock connector asserts that every transfer succeeds;
* a step's stores are submitted when the step ends (``wait_for_save``), not at
  the start of the next step, so the blocks of a finished ``generate()`` are in
  the daemon when it returns (on the worker's store thread, off the step: on
  their way, committed moments later; ``kachedb.vllm.flush_stores()`` waits
  for them) and none is dropped at shutdown (vLLM drops stores still deferred then; the
  worker's shutdown finishes the queued ones);
* the spec sees the full engine config and the KV-cache config, so the key
  namespace covers the model's config, dtype, load format and hash algorithm,
  and knows which tensor-parallel ranks hold the same KV (MLA);
* its KV events (``--kv-events-config``: the blocks this engine can load from
  KacheDB, manager.py) name their medium ``KACHEDB`` (``MEDIUM``), not ``CPU``;
* its stores carry each block's hash, parent, tokens and block size (the
  scheduler's request, found by its id: ``manager.request_of``), which the
  daemon publishes in its own KV events (docs/events.md, "Block metadata").
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Set

from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

from . import spec as _spec

#: The ``medium`` of this connector's ``BlockStored`` / ``BlockRemoved`` events.
MEDIUM = "KACHEDB"


class KacheDBConnector(OffloadingConnector):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Optional[Any] = None) -> None:
        _spec._building.vllm_config = vllm_config
        _spec._building.kv_cache_config = kv_cache_config
        try:
            super().__init__(vllm_config, role, kv_cache_config)
        finally:
            _spec._building.vllm_config = None
            _spec._building.kv_cache_config = None
        scheduler = self.connector_scheduler
        manager = getattr(scheduler, "manager", None)
        if manager is not None and hasattr(manager, "request_of"):
            # The manager's stores name each block's tokens and hashes (for the
            # daemon's KV events): it finds them in the scheduler's request.
            states = getattr(scheduler, "_req_status", None)

            def request_of(req_id: str) -> Any:
                st = states.get(req_id) if states is not None else None
                return getattr(st, "req", None)

            manager.request_of = request_of

    def _kachedb_worker(self) -> Any:
        cw = self.connector_worker
        return None if cw is None else cw.worker

    def _submit_stores_now(self) -> None:
        cw = self.connector_worker
        if cw is None or cw.worker is None:
            return
        jobs = getattr(cw, "_unsubmitted_store_jobs", None)
        if not jobs:
            return
        for job_id, src_spec, dst_spec in jobs:
            cw.worker.submit_store(job_id, src_spec, dst_spec)
        jobs.clear()

    def wait_for_save(self) -> None:
        super().wait_for_save()
        self._submit_stores_now()

    def _multi_group(self) -> bool:
        w = self._kachedb_worker()
        return w is not None and len(getattr(w, "groups", ())) > 1

    def get_transfer_results(self, finished_req_ids: Set[str]) -> Any:
        # With several KV-cache groups vLLM cannot map failed block ids to requests
        # (it raises): report the requests of failed loads instead; vLLM then
        # recomputes them from scratch.
        cw = self.connector_worker
        if cw is None or not self._multi_group():
            return super().get_transfer_results(finished_req_ids)
        load_jobs = dict(cw._load_jobs)
        results = super().get_transfer_results(finished_req_ids)
        failed = self._kachedb_worker().take_failed_load_jobs()
        results.failed_recving |= {load_jobs[j] for j in failed if j in load_jobs}
        return results

    def get_block_ids_with_load_errors(self) -> Set[int]:
        w = self._kachedb_worker()
        if w is None or self._multi_group():
            if w is not None:
                w.take_invalid_block_ids()  # reported per request instead
            return set()
        take = getattr(w, "take_invalid_block_ids", None)
        failed = take() if take is not None else set()
        w.take_failed_load_jobs()
        return failed

    def take_events(self) -> Iterable[Any]:
        # Every event of this connector comes from KacheDBOffloadingManager.
        for ev in super().take_events():
            if isinstance(ev, (BlockStored, BlockRemoved)):
                ev.medium = MEDIUM
            yield ev

    def shutdown(self) -> None:
        try:
            self._submit_stores_now()
        finally:
            super().shutdown()
