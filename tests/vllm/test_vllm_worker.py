"""kachedb.vllm's transfer worker on synthetic vLLM-shaped CPU KV caches (no engine):
lossless round trip, one batch per direction, failed loads reported, full store skipped,
daemon absent."""

import os
import threading
from types import SimpleNamespace

import pytest
import torch
from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor, GPULoadStoreSpec

import kachedb
from kachedb.vllm import _state
from kachedb.vllm.manager import KacheDBLoadStoreSpec
from kachedb.vllm.worker import KacheDBOffloadingWorker
from vllm_support import Daemon

LAYERS, BLOCKS, PAGE = 4, 64, 8192


def caches(layout="layer_major"):
    """KV caches of LAYERS layers of BLOCKS pages. ``layer_major``: vLLM's CPU
    layout, one buffer; ``separate``: a buffer per layer; ``block_major``: one
    buffer, a block's layers next to each other (its bytes one range);
    ``padded``: the odd layers' pages half as large (a block is padded: stored
    by torch copies, not as byte ranges)."""
    g = torch.Generator().manual_seed(0)
    pages = [PAGE // 2 if layout == "padded" and l % 2 else PAGE for l in range(LAYERS)]
    if layout == "layer_major":
        buf = torch.randint(-128, 127, (LAYERS, BLOCKS, PAGE), dtype=torch.int8, generator=g)
        layers = [buf[l] for l in range(LAYERS)]
    elif layout == "block_major":
        buf = torch.randint(-128, 127, (BLOCKS, LAYERS, PAGE), dtype=torch.int8, generator=g)
        layers = [buf[:, l] for l in range(LAYERS)]
    else:
        layers = [torch.randint(-128, 127, (BLOCKS, p), dtype=torch.int8, generator=g) for p in pages]
    c = CanonicalKVCaches([CanonicalKVCacheTensor(t, p) for t, p in zip(layers, pages)],
                          [[CanonicalKVCacheRef(l, p) for l, p in enumerate(pages)]])
    return c, layers


def worker(sock, c, store_thread=False):
    ns = os.urandom(16)
    spec = SimpleNamespace(socket=sock, rank=0, retry_s=0.2, store_mode="batched", stats_file=None,
                           store_thread=store_thread, daemon_key=lambda k, rank=None: ns + bytes(k))
    return KacheDBOffloadingWorker(spec, c), spec


def keys(n, start=0):
    return [i.to_bytes(32, "big") + b"\0\0\0\0" for i in range(start, start + n)]


@pytest.fixture(scope="module")
def daemon(workdir):
    d = Daemon(str(workdir / "worker.sock"), size="64MiB").start()
    yield d
    d.stop()


@pytest.mark.parametrize("layout", ["layer_major", "separate", "block_major", "padded"])
@pytest.mark.parametrize("mode", ["batched", "reserve"])
@pytest.mark.parametrize("store_thread", [False, True])
def test_store_then_load_is_lossless_and_batched(daemon, layout, mode, store_thread):
    c, layers = caches(layout)
    w, spec = worker(daemon.socket, c, store_thread)
    # A block's bytes as byte ranges: one per layer, one for a block-major
    # buffer, none (torch copies) for padded pages.
    runs = w.groups[0]._runs
    assert (None if runs is None else len(runs)) == {"layer_major": LAYERS, "separate": LAYERS, "block_major": 1,
                                                     "padded": None}[layout]
    spec.store_mode = mode
    before = dict(_state.COUNTERS)
    n = 16
    src, dst = list(range(n)), list(range(32, 32 + n))
    w.submit_store(1, GPULoadStoreSpec(src, [n], [0]), KacheDBLoadStoreSpec(keys(n)))
    w.wait({1})  # vLLM loads a block only once its store is reported finished
    w.submit_load(2, KacheDBLoadStoreSpec(keys(n)), GPULoadStoreSpec(dst, [n], [0]))
    assert sorted(r.job_id for r in w.get_finished()) == [1, 2]
    for t in layers:
        assert torch.equal(t[src], t[dst])
    assert w.take_invalid_block_ids() == set()
    assert _state.COUNTERS["store_batches"] - before.get("store_batches", 0) == 1
    assert _state.COUNTERS["load_batches"] - before.get("load_batches", 0) == 1
    w.shutdown()
    st = daemon.stats()
    assert st["pins"] == 0 and st["reserved"] == 0


def test_store_runs_off_the_step_and_is_reported_once_committed(daemon, monkeypatch):
    # submit_store returns while the store is still to be done (here: held at its
    # RESERVE on the store thread); the blocks are not in the daemon and
    # get_finished does not report the job until they are committed; then the
    # job is reported once and the bytes load back equal.
    c, layers = caches()
    w, spec = worker(daemon.socket, c, store_thread=True)
    gate, reached = threading.Event(), threading.Event()
    reserve_many = kachedb.Client.reserve_many

    def held_reserve_many(self, *a, **kw):
        if threading.current_thread() is not threading.main_thread():
            reached.set()
            assert gate.wait(60)
        return reserve_many(self, *a, **kw)

    monkeypatch.setattr(kachedb.Client, "reserve_many", held_reserve_many)
    n = 8
    src, dst = list(range(n)), list(range(48, 48 + n))
    dkeys = [spec.daemon_key(k) for k in keys(n, 700)]
    try:
        assert w.submit_store(7, GPULoadStoreSpec(src, [n], [0]), KacheDBLoadStoreSpec(keys(n, 700)))
        assert reached.wait(60), "the store did not reach the daemon on a thread of its own"
        assert w.get_finished() == []
        with kachedb.connect(daemon.socket) as kc:
            assert kc.lookup(dkeys) == 0
    finally:
        gate.set()
    w.wait({7})
    assert [(r.job_id, r.success) for r in w.get_finished()] == [(7, True)]
    assert w.get_finished() == []
    with kachedb.connect(daemon.socket) as kc:
        assert kc.lookup(dkeys) == n
    w.submit_load(8, KacheDBLoadStoreSpec(keys(n, 700)), GPULoadStoreSpec(dst, [n], [0]))
    assert [r.job_id for r in w.get_finished()] == [8]
    for t in layers:
        assert torch.equal(t[src], t[dst])
    w.shutdown()
    st = daemon.stats()
    assert st["pins"] == 0 and st["reserved"] == 0


def test_auto_store_thread_follows_the_store_spec(daemon, monkeypatch):
    # "auto": a store the manager marks background (the engine keeps stepping
    # until it is reported) runs on the thread; an unmarked one is committed and
    # reported by the time submit_store returns.
    c, layers = caches()
    w, spec = worker(daemon.socket, c, store_thread="auto")
    n = 4
    with kachedb.connect(daemon.socket) as kc:
        assert w.submit_store(1, GPULoadStoreSpec(list(range(n)), [n], [0]), KacheDBLoadStoreSpec(keys(n, 900)))
        assert kc.lookup([spec.daemon_key(k) for k in keys(n, 900)]) == n
        assert [r.job_id for r in w.get_finished()] == [1]
        gate, reached = threading.Event(), threading.Event()
        reserve_many = kachedb.Client.reserve_many

        def held_reserve_many(self, *a, **kw):
            if threading.current_thread() is not threading.main_thread():
                reached.set()
                assert gate.wait(60)
            return reserve_many(self, *a, **kw)

        monkeypatch.setattr(kachedb.Client, "reserve_many", held_reserve_many)
        bg = KacheDBLoadStoreSpec(keys(n, 910), background=True)
        try:
            assert w.submit_store(2, GPULoadStoreSpec(list(range(n, 2 * n)), [n], [0]), bg)
            assert reached.wait(60), "the background store did not run on the store thread"
            assert w.get_finished() == []
        finally:
            gate.set()
        w.wait({2})
        assert [r.job_id for r in w.get_finished()] == [2]
        assert kc.lookup([spec.daemon_key(k) for k in keys(n, 910)]) == n
    w.shutdown()


def test_shutdown_finishes_the_queued_stores(daemon):
    c, layers = caches()
    w, spec = worker(daemon.socket, c, store_thread=True)
    for j in range(4):
        w.submit_store(j, GPULoadStoreSpec([2 * j, 2 * j + 1], [2], [0]), KacheDBLoadStoreSpec(keys(2, 800 + 2 * j)))
    w.shutdown()
    with kachedb.connect(daemon.socket) as kc:
        assert kc.lookup([spec.daemon_key(k) for k in keys(8, 800)]) == 8
    assert sorted(r.job_id for r in w.get_finished()) == [0, 1, 2, 3]
    # a store submitted after shutdown is not left queued: it is reported at once
    w.submit_store(9, GPULoadStoreSpec([20, 21], [2], [0]), KacheDBLoadStoreSpec(keys(2, 820)))
    assert [r.job_id for r in w.get_finished()] == [9]


def test_missing_block_is_a_failed_load_from_there_on(daemon):
    c, layers = caches()
    w, spec = worker(daemon.socket, c)
    w.submit_store(1, GPULoadStoreSpec([0, 1, 2, 3], [4], [0]), KacheDBLoadStoreSpec(keys(4)))
    w.wait({1})
    with kachedb.connect(daemon.socket) as kc:
        assert kc.delete(spec.daemon_key(keys(4)[2]))
    snapshot = [t[40:44].clone() for t in layers]
    w.submit_load(2, KacheDBLoadStoreSpec(keys(4)), GPULoadStoreSpec([40, 41, 42, 43], [4], [0]))
    assert {r.job_id: r.success for r in w.get_finished()} == {1: True, 2: True}
    assert w.take_invalid_block_ids() == {42, 43}
    for t, s in zip(layers, snapshot):
        assert torch.equal(t[40:42], t[0:2])  # the leading blocks were loaded
        assert torch.equal(t[42:44], s[2:4])  # the failed ones were not touched
    w.shutdown()


@pytest.mark.parametrize("bad", ["shape", "dtype"])
def test_a_block_that_can_never_load_is_deleted_and_reported(daemon, bad):
    # A block in this engine's namespace of another layout (written by anything
    # but this layout's worker): the load fails from there on, as for a missing
    # block, and the block is deleted, so the next lookup no longer finds it.
    c, layers = caches()
    w, spec = worker(daemon.socket, c)
    w.submit_store(1, GPULoadStoreSpec([0, 1, 2, 3], [4], [0]), KacheDBLoadStoreSpec(keys(4, 300)))
    w.wait({1})
    dkeys = [spec.daemon_key(k) for k in keys(4, 300)]
    wrong = torch.zeros((LAYERS, PAGE // 2), dtype=torch.uint8) if bad == "shape" else \
        torch.zeros((LAYERS, PAGE // 2), dtype=torch.int16)
    before = dict(_state.COUNTERS)
    with kachedb.connect(daemon.socket) as kc:
        kc.put(dkeys[2], wrong)
        assert kc.lookup(dkeys) == 4
    snapshot = [t[40:44].clone() for t in layers]
    w.submit_load(2, KacheDBLoadStoreSpec(keys(4, 300)), GPULoadStoreSpec([40, 41, 42, 43], [4], [0]))
    assert {r.job_id: r.success for r in w.get_finished()} == {1: True, 2: True}
    assert w.take_invalid_block_ids() == {42, 43}
    for t, s in zip(layers, snapshot):
        assert torch.equal(t[40:42], t[0:2]) and torch.equal(t[42:44], s[2:4])
    with kachedb.connect(daemon.socket) as kc:
        assert kc.lookup(dkeys) == 2  # the unloadable block is gone, the good ones stay
        assert kc.lookup(dkeys[3:]) == 1
        kc.delete_many(dkeys)
    assert _state.COUNTERS["load_unloadable_blocks"] - before.get("load_unloadable_blocks", 0) == 1
    assert _state.COUNTERS["load_deleted_unloadable_blocks"] - before.get("load_deleted_unloadable_blocks", 0) == 1
    w.shutdown()


def test_a_request_loads_one_block_at_most_twice(daemon):
    # A block the daemon holds that fails every load (here: it is simply never
    # loaded) would send vLLM's recompute policy round for ever: lookup hit, load
    # fail, lookup hit ... The manager's lookups miss a key the request has
    # already been handed to a load MAX_LOADS_PER_KEY times; other requests, and
    # the request's other keys, still hit.
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    from kachedb.vllm.manager import MAX_LOADS_PER_KEY, KacheDBOffloadingManager

    ns = os.urandom(16)
    spec = SimpleNamespace(socket=daemon.socket, retry_s=0.2, world_size=1, store_ranks=[0],
                           daemon_key=lambda k, rank=None: ns + bytes(k))
    m = KacheDBOffloadingManager(spec)
    k = keys(2, 1200)
    with kachedb.connect(daemon.socket) as kc:
        for key in k:
            kc.put(spec.daemon_key(key), torch.zeros(16, dtype=torch.uint8))
    req = ReqContext(req_id="again")
    assert MAX_LOADS_PER_KEY == 2
    for _ in range(MAX_LOADS_PER_KEY):
        assert m.lookup(k[0], req) == LookupResult.HIT
        m.prepare_load([k[0]], req)
    assert m.lookup(k[0], req) == LookupResult.MISS
    assert m.lookup(k[1], req) == LookupResult.HIT
    assert m.lookup(k[0], ReqContext(req_id="other")) == LookupResult.HIT
    with kachedb.connect(daemon.socket) as kc:
        kc.delete_many([spec.daemon_key(key) for key in k])
    m.shutdown()


@pytest.mark.parametrize("mode", ["batched", "reserve"])
def test_stored_blocks_chain_on_from_the_spec_parent(daemon, mode):
    # Each stored block names the one before it; a job's first block names the
    # spec's parent (the manager's last block already in the daemon).
    c, layers = caches()
    w, spec = worker(daemon.socket, c)
    spec.store_mode = mode
    before = daemon.stats()
    w.submit_store(1, GPULoadStoreSpec([0, 1, 2, 3], [4], [0]), KacheDBLoadStoreSpec(keys(4, 500)))
    w.submit_store(2, GPULoadStoreSpec([4, 5, 6], [3], [0]), KacheDBLoadStoreSpec(keys(3, 504), parent=keys(4, 500)[3]))
    w.wait({1, 2})
    assert sorted(r.job_id for r in w.get_finished()) == [1, 2]
    st = daemon.stats()
    assert st["chained_blocks"] - before["chained_blocks"] == 6  # 3 in each job
    assert st["parents_missing"] == before["parents_missing"]
    with kachedb.connect(daemon.socket) as kc:
        assert kc.delete_many([spec.daemon_key(k) for k in keys(7, 500)]) == 7
    w.shutdown()


def test_manager_chains_a_store_on_from_the_request_s_last_load_or_store(daemon):
    # The parent of a store's first block: the daemon's last leading present key,
    # else the last block this request loaded, else the last one it stored before.
    from vllm.v1.kv_offload.base import ReqContext

    from kachedb.vllm.manager import KacheDBOffloadingManager

    ns = os.urandom(16)
    spec = SimpleNamespace(socket=daemon.socket, retry_s=0.2, world_size=1, store_ranks=[0],
                           daemon_key=lambda k, rank=None: ns + bytes(k))
    m = KacheDBOffloadingManager(spec)
    k = keys(6, 900)
    loading = ReqContext(req_id="loading")
    assert m.prepare_load(k[:2], loading).keys == k[:2]
    assert m.prepare_store(k[2:4], loading).store_spec.parent == k[1]
    m.complete_store(k[2:4], loading)
    assert m.prepare_store(k[4:], loading).store_spec.parent == k[3]
    fresh = ReqContext(req_id="fresh")
    assert m.prepare_store(k[:1], fresh).store_spec.parent is None
    m.shutdown()


def test_full_store_skips(daemon):
    c, layers = caches()
    w, spec = worker(daemon.socket, c)
    with kachedb.connect(daemon.socket) as kc:
        # 63 of the 64 MiB held by a pinned block: 48 blocks of 32 KiB can never fit
        kc.put(b"filler", torch.zeros(63 << 20, dtype=torch.uint8))
        with kc.get(b"filler"):
            before = _state.COUNTERS.get("store_skipped_full", 0)
            n = 48
            w.submit_store(10, GPULoadStoreSpec(list(range(n)), [n], [0]), KacheDBLoadStoreSpec(keys(n, 1000)))
            w.wait({10})
            assert [r.success for r in w.get_finished()] == [True]
            assert _state.COUNTERS["store_skipped_full"] == before + 1
            assert kc.lookup([spec.daemon_key(k) for k in keys(n, 1000)]) == 0
        kc.delete(b"filler")
    w.shutdown()
    st = daemon.stats()
    assert st["pins"] == 0 and st["reserved"] == 0


def test_daemon_absent_loads_fail_stores_skip(workdir):
    c, layers = caches()
    w, spec = worker(str(workdir / "nobody.sock"), c)
    w.submit_store(1, GPULoadStoreSpec([0, 1], [2], [0]), KacheDBLoadStoreSpec(keys(2)))
    w.wait({1})
    w.submit_load(2, KacheDBLoadStoreSpec(keys(2)), GPULoadStoreSpec([5, 6], [2], [0]))
    assert sorted(r.job_id for r in w.get_finished()) == [1, 2]
    assert w.take_invalid_block_ids() == {5, 6}
    w.shutdown()
