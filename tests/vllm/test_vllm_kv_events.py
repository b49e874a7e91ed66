"""KV events for routers and tenants in the vLLM integration (issue 29).

vLLM publishes KV cache events (``kv_events_config``: a ZMQ publisher of
``KVEventBatch``es of ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``);
the offloading connector adds its manager's events (``take_events``). KacheDB's
report the blocks the engine can load from the daemon, medium ``KACHEDB``.

* Engine tests (real vLLM CPU engines, each its own process, each with its own
  ZMQ publisher; a real subscriber here decodes the batches with vLLM's
  ``KVEventBatch`` through msgspec, as vLLM's example subscriber does): engine A
  (tenant ``team-a``) stores a prompt; engine B (tenant ``team-b``, another
  process) loads it: B's KACHEDB ``BlockStored`` events name the blocks A's
  events named, with their tokens; another client then fills the daemon so it
  evicts them, and B's next lookup of the prompt is followed by a KACHEDB
  ``BlockRemoved`` of its first block. The daemon's per-tenant figures show
  each engine's tenant.
* Without an engine (seconds): the manager's events for a block found, stored
  and gone; the tenant option and its default (the namespace label) as the
  daemon sees them.
"""

import json
import random
import subprocess
import sys
import threading
import time

import msgspec
import pytest
import zmq

from vllm_support import Daemon, run_engine

BLOCK = 32
pytestmark = pytest.mark.timeout(900)


def _prompt(seed, n):
    r = random.Random(seed)
    return [r.randrange(2048) for _ in range(n)]


P, S, T = _prompt(21, 1000), _prompt(22, 40), _prompt(23, 40)
N_P = len(P) // BLOCK  # whole blocks of P: 31


class Subscriber:
    """A ZMQ SUB socket on an engine's KV-event endpoint, decoding each message
    as vLLM's subscriber example does: (topic, seq, msgpack KVEventBatch)."""

    def __init__(self, endpoint):
        from vllm.distributed.kv_events import KVEventBatch

        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.batches = []  # (seq, KVEventBatch, raw payload)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            if self.sock.poll(100):
                _topic, seq, payload = self.sock.recv_multipart()
                self.batches.append((int.from_bytes(seq, "big"), self.decoder.decode(payload), payload))

    def close(self, quiet_s=1.0):
        """Waits until nothing has arrived for ``quiet_s`` seconds, then stops."""
        n = -1
        while n != len(self.batches):
            n = len(self.batches)
            time.sleep(quiet_s)
        self._stop.set()
        self._thread.join()
        self.sock.close(0)
        self.ctx.term()

    def events(self, kind=None, medium=None, after=None, before=None):
        out = []
        for _seq, batch, _raw in self.batches:
            if after is not None and batch.ts < after:
                continue
            if before is not None and batch.ts > before:
                continue
            for ev in batch.events:
                if kind is not None and type(ev).__name__ != kind:
                    continue
                if medium is not None and getattr(ev, "medium", None) != medium:
                    continue
                out.append(ev)
        return out


def _tenants(stats):
    return {t["name"]: t for t in stats.get("tenants", [])}


@pytest.fixture(scope="module")
def run(workdir, model_dir):
    """A (tenant team-a) stores P then T and exits; B (tenant team-b) runs P+S
    (a KacheDB hit), a filler client evicts everything from the 64 MiB daemon,
    and B runs P+S again after a prefix-cache reset. Each engine publishes its
    KV events on its own ZMQ endpoint; a subscriber here collects them."""
    d = Daemon(str(workdir / "events.sock"), size="64MiB").start()
    ep_a, ep_b = f"ipc://{workdir}/a.events", f"ipc://{workdir}/b.events"
    sub_a, sub_b = Subscriber(ep_a), Subscriber(ep_b)
    try:
        a = run_engine(workdir, "EA", dict(model=model_dir, socket=d.socket, kv_events_endpoint=ep_a,
                                           options={"tenant": "team-a"},
                                           phases=[{"prompts": [P], "max_tokens": 1},
                                                   {"prompts": [T], "max_tokens": 1}]))
        after_a = d.stats()
        b = run_engine(workdir, "EB", dict(model=model_dir, socket=d.socket, kv_events_endpoint=ep_b,
                                           options={"tenant": "team-b"},
                                           phases=[{"prompts": [P + S], "max_tokens": 4,
                                                    "after": [{"fill_daemon": {"bytes": 96 << 20}}]},
                                                   {"before": [{"reset_prefix_cache": True}],
                                                    "prompts": [P + S], "max_tokens": 1}]))
        after_b = d.stats()
    finally:
        sub_a.close()
        sub_b.close()
        d.stop()
    return {"A": a, "B": b, "after_a": after_a, "after_b": after_b, "sub_a": sub_a, "sub_b": sub_b}


def _hashes(events):
    return [h for ev in events for h in ev.block_hashes]


def test_engine_b_reports_the_blocks_it_loaded_from_what_a_stored(run):
    a_stored = run["sub_a"].events("BlockStored", "KACHEDB")
    b = run["B"]
    assert b["phases"][0]["stats"]["loaded_blocks"] == N_P
    assert b["phases"][0]["outputs"][0]["num_cached_tokens"] >= N_P * BLOCK
    # A reported the blocks it stored (P's and T's), with their tokens and chain.
    a_by_hash = {ev.block_hashes[0]: ev for ev in a_stored}
    assert len(a_stored) >= N_P + 1, [len(ev.block_hashes) for ev in a_stored]
    p_chain = [ev for ev in a_stored if ev.token_ids and list(ev.token_ids) == P[: BLOCK]]
    assert len(p_chain) == 1, "A's events name P's first block once"
    # B's KACHEDB BlockStored events while it served P+S the first time: P's blocks
    # as A stored them (same hashes, tokens, parents), found by B's lookups.
    t0, t1 = b["phases"][0]["t0"], b["phases"][0]["t1"]
    b_stored = run["sub_b"].events("BlockStored", "KACHEDB", after=t0, before=t1)
    b_hashes = _hashes(b_stored)
    a_p_hashes = []
    parent = None
    for i in range(N_P):
        ev = next(e for e in a_stored if list(e.token_ids) == P[i * BLOCK:(i + 1) * BLOCK] and e.parent_block_hash == parent)
        a_p_hashes.append(ev.block_hashes[0])
        parent = ev.block_hashes[0]
    assert b_hashes[:N_P] == a_p_hashes, "B's first KACHEDB events are P's blocks as A's events named them, in order"
    for i, ev in enumerate(b_stored[:N_P]):
        assert list(ev.token_ids) == P[i * BLOCK:(i + 1) * BLOCK]
        assert ev.block_size == BLOCK and ev.locality == "LOCAL"
        assert ev.parent_block_hash == (a_p_hashes[i - 1] if i else None)
        assert a_by_hash[ev.block_hashes[0]].token_ids == ev.token_ids
    # ... then the block B computed and stored itself (P+S's 32nd).
    assert len(b_hashes) == len(set(b_hashes)), "each block reported stored once"
    assert len(b_hashes) == (len(P) + len(S)) // BLOCK
    assert list(b_stored[-1].token_ids) == (P + S)[N_P * BLOCK:(N_P + 1) * BLOCK]
    # vLLM's own GPU events are still there, unchanged (another medium).
    assert run["sub_b"].events("BlockStored", "GPU")


def test_a_removal_follows_the_eviction(run):
    b = run["B"]
    assert b.get("filled") == 96
    t1, t2 = b["phases"][0]["t1"], b["phases"][1]["t1"]
    removed = run["sub_b"].events("BlockRemoved", "KACHEDB", after=t1, before=t2)
    stored_first = run["sub_b"].events("BlockStored", "KACHEDB", before=t1)
    first_block = stored_first[0].block_hashes[0]
    assert removed and removed[0].block_hashes == [first_block], removed
    assert b["phases"][1]["stats"]["kv_events_removed_blocks"] >= 1
    # Nothing was removed before the eviction.
    assert not run["sub_b"].events("BlockRemoved", "KACHEDB", before=t1)
    # B computed P+S again and stored it: its first block is reported loadable again.
    again = run["sub_b"].events("BlockStored", "KACHEDB", after=t1)
    assert first_block in _hashes(again)
    assert b["phases"][1]["outputs"][0]["tokens"][0] == b["phases"][0]["outputs"][0]["tokens"][0]


def test_each_engine_is_counted_as_its_tenant(run):
    ta, tb = _tenants(run["after_a"]), _tenants(run["after_b"])
    assert ta["team-a"]["blocks"] == N_P + len(T) // BLOCK, ta["team-a"]
    assert ta["team-a"]["stored_bytes"] > 0
    assert "team-b" not in ta or ta["team-b"]["lookup_hits"] == 0
    assert tb["team-b"]["lookup_hits"] >= N_P, tb["team-b"]
    assert tb["team-b"]["stored_bytes"] > 0
    # the filler (another client, the default tenant) evicted team-a's blocks
    assert tb["team-a"]["evictions"] >= N_P


def test_engine_core_stores_off_the_step_and_reports_them_without_another_request(workdir, model_dir):
    """In vLLM's engine-core process (``mode: mp``, the default ``store_thread``
    "auto"), the stores run on the worker's store thread, and those of a
    request's last step are still reported: the engine keeps stepping while a
    store job is pending, so every block's KACHEDB ``BlockStored`` arrives while
    the engine is idle, before any further request (with the thread and no such
    stepping, they would arrive with the next request, or never)."""
    d = Daemon(str(workdir / "core.sock"), size="64MiB").start()
    ep = f"ipc://{workdir}/core.events"
    sub = Subscriber(ep)
    stats = workdir / "core.stats.json"
    try:
        out = run_engine(workdir, "EC", dict(model=model_dir, socket=d.socket, kv_events_endpoint=ep, mode="mp",
                                             options={"stats_file": str(stats)},
                                             phases=[{"prompts": [P], "max_tokens": 1, "after": [{"sleep": 3}]},
                                                     {"prompts": [T], "max_tokens": 1, "after": [{"sleep": 3}]}]))
    finally:
        sub.close()
        d.stop()
    st = json.loads(stats.read_text())
    assert st["store_thread_jobs"] >= 1 and st["stored_blocks"] == N_P + len(T) // BLOCK, st
    before_t = out["phases"][1]["t0"]
    p_hashes = _hashes(sub.events("BlockStored", "KACHEDB", before=before_t))
    assert len(p_hashes) == N_P, "every block of P reported before the next request"
    t_events = sub.events("BlockStored", "KACHEDB", after=before_t)
    assert [list(ev.token_ids) for ev in t_events] == [T[:BLOCK]], "T's block reported while the engine was idle"


def _readable(ev):
    out = {"type": type(ev).__name__}
    for k, v in msgspec.structs.asdict(ev).items():
        if k == "token_ids" and v:
            v = v[:4] + ["..."]
        out[k] = v.hex() if isinstance(v, bytes) else v
    return out


def test_one_decoded_batch_for_the_record(run, workdir):
    """Writes B's batch with the KACHEDB removal, decoded (for the docs and the issue)."""
    for seq, batch, _raw in run["sub_b"].batches:
        if any(type(ev).__name__ == "BlockRemoved" and ev.medium == "KACHEDB" for ev in batch.events):
            rec = {"seq": seq, "ts": batch.ts, "data_parallel_rank": batch.data_parallel_rank,
                   "events": [_readable(ev) for ev in batch.events]}
            (workdir / "kv_events_batch.json").write_text(json.dumps(rec, indent=1))
            return
    pytest.fail("no batch with a KACHEDB removal")


# -- without an engine ---------------------------------------------------------

def _spec(socket, extra, events=True):
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from kachedb.vllm import spec as _s

    cfg = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("model.layers.0.self_attn.attn",), group_id=0),),
        worker_kv_bytes_per_block=4096,
        enable_kv_cache_events=events,
        extra_config=dict({"socket": socket, "retry_seconds": 0.2}, **extra),
        engine_id="events-test",
        model=OffloadingModelConfig(name="/nonexistent/model", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                                          is_parallelism_agnostic=False),
    )
    # What KacheDBConnector does around vLLM's connector constructor.
    _s._building.kv_cache_config = KVCacheConfig(
        num_blocks=16, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"],
                                          FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32,
                                                            dtype=torch.bfloat16))])
    try:
        return _s.KacheDBOffloadingSpec(cfg)
    finally:
        _s._building.kv_cache_config = None


def _key(i):
    return bytes([i]) * 32 + (0).to_bytes(4, "big")  # block hash + group index


def test_stores_are_marked_background_only_in_the_engine_core_loop(tmp_path):
    from vllm.v1.engine.core import EngineCoreProc
    from vllm.v1.kv_offload.base import ReqContext

    from kachedb.vllm.manager import engine_keeps_stepping

    def run_busy_loop(self, fn):  # what vLLM's engine-core process runs
        return fn()

    core = EngineCoreProc.__new__(EngineCoreProc)
    assert run_busy_loop(core, engine_keeps_stepping) is True
    assert engine_keeps_stepping() is False  # the in-process engine
    assert run_busy_loop(object(), engine_keeps_stepping) is False
    d = Daemon(str(tmp_path / "bg.sock"), size="64MiB").start()
    try:
        ctx = ReqContext(req_id="r")
        inproc = _spec(d.socket, {}).get_manager()
        assert inproc.prepare_store([_key(1)], ctx).store_spec.background is False
        core_mgr = _spec(d.socket, {}).get_manager()
        spec = run_busy_loop(core, lambda: core_mgr.prepare_store([_key(2)], ctx)).store_spec
        assert spec.background is True and spec.keys == [_key(2)]
        inproc.shutdown()
        core_mgr.shutdown()
    finally:
        d.stop()


def test_manager_events_found_stored_gone(tmp_path):
    import numpy as np
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    d = Daemon(str(tmp_path / "m.sock"), size="64MiB").start()
    try:
        spec = _spec(d.socket, {})
        assert spec.kv_events_config.enable_kv_cache_events and spec.kv_events_config.self_describing_kv_events
        m = spec.get_manager()
        ctx = ReqContext(req_id="r")
        kc = d.client()
        kc.put(spec.daemon_key(_key(1)), np.zeros(8, np.uint8))  # another engine stored block 1
        assert m.lookup(_key(1), ctx) == LookupResult.HIT
        assert m.lookup(_key(1), ctx) == LookupResult.HIT  # reported once
        assert m.lookup(_key(2), ctx) == LookupResult.MISS  # never reported: no removal
        ev = list(m.take_events())
        assert [(e.keys, e.removed, e.medium.value, e.locality.value) for e in ev] == [([_key(1)], False, "CPU", "LOCAL")]
        # A store job of blocks 2, 3 of which only 2 reached the daemon (3: the daemon was full).
        kc.put(spec.daemon_key(_key(2)), np.zeros(8, np.uint8))
        m.complete_store([_key(2), _key(3)], ctx)
        assert [(e.keys, e.removed) for e in m.take_events()] == [([_key(2)], False)]
        kc.delete(spec.daemon_key(_key(1)))  # evicted
        assert m.lookup(_key(1), ctx) == LookupResult.MISS
        assert [(e.keys, e.removed) for e in m.take_events()] == [([_key(1)], True)]
        assert list(m.take_events()) == []
        # The daemon goes away: every block still reported is removed.
        d.kill()
        assert m.lookup(_key(2), ctx) == LookupResult.MISS
        assert [(e.keys, e.removed) for e in m.take_events()] == [([_key(2)], True)]
        kc.close()
        m.shutdown()
    finally:
        d.stop()


def test_manager_events_are_bounded_and_off_without_kv_events(tmp_path):
    import numpy as np
    from vllm.v1.kv_offload.base import ReqContext

    d = Daemon(str(tmp_path / "b.sock"), size="64MiB").start()
    try:
        kc = d.client()
        spec = _spec(d.socket, {"kv_events_max_blocks": 2})
        for i in (1, 2, 3):
            kc.put(spec.daemon_key(_key(i)), np.zeros(8, np.uint8))
        m = spec.get_manager()
        ctx = ReqContext(req_id="r")
        for i in (1, 2, 3):
            m.lookup(_key(i), ctx)
        assert [(e.keys, e.removed) for e in m.take_events()] == [
            ([_key(1)], False), ([_key(2)], False), ([_key(3)], False), ([_key(1)], True)]
        m.shutdown()
        off = _spec(d.socket, {}, events=False).get_manager()
        off.lookup(_key(1), ctx)
        off.complete_store([_key(2)], ctx)
        assert list(off.take_events()) == []
        off.shutdown()
        with pytest.raises(ValueError, match="kv_events_max_blocks"):
            _spec(d.socket, {"kv_events_max_blocks": 0})
        kc.close()
    finally:
        d.stop()


@pytest.mark.parametrize("extra, tenant", [
    ({"tenant": "team-x"}, "team-x"),
    ({"namespace": "team-y"}, "team-y"),  # the default: the namespace label
    ({"namespace": "org/team z"}, "org_team_z"),  # made a valid name
    ({"namespace": "n", "tenant": "team-w"}, "team-w"),
    ({}, "default"),
])
def test_the_daemon_sees_the_tenant(tmp_path, extra, tenant):
    from vllm.v1.kv_offload.base import ReqContext

    d = Daemon(str(tmp_path / "t.sock"), size="64MiB").start()
    try:
        m = _spec(d.socket, extra).get_manager()
        m.lookup(_key(9), ReqContext(req_id="r"))  # a miss, counted for the tenant
        rows = _tenants(d.stats())
        assert rows[tenant]["clients"] >= 1 and rows[tenant]["lookup_misses"] == 1, rows
        if tenant != "default":
            assert rows[tenant]["clients"] == 1 and rows["default"]["lookup_misses"] == 0, rows
        m.shutdown()
    finally:
        d.stop()


def test_a_bad_tenant_is_a_clear_error(tmp_path):
    import kachedb.vllm

    with pytest.raises(ValueError, match="not a tenant name"):
        kachedb.vllm.kv_transfer_config(str(tmp_path / "x.sock"), tenant="no spaces")
    with pytest.raises(ValueError, match="not a tenant name"):
        _spec(str(tmp_path / "x.sock"), {"tenant": "_other"})
    out = subprocess.run([sys.executable, "-m", "kachedb", "vllm-config", "--tenant", "_x"], capture_output=True, text=True)
    assert out.returncode == 2 and "not a tenant name" in out.stderr
    out = subprocess.run([sys.executable, "-m", "kachedb", "vllm-config", "--tenant", "team-c"], capture_output=True,
                         text=True, check=True)
    assert json.loads(out.stdout)["kv_connector_extra_config"]["tenant"] == "team-c"
