"""The KacheDB HiCache backend in one SGLang process: a daemon that is down or
dies gives misses / False (never an exception into SGLang's controller), bad
input and a full store change nothing, the config SGLang is given, and the
generic interface."""

import json
import logging
import os
import subprocess
import sys
import time

import pytest
import torch

import kachedb
import kachedb.sglang
import pools
from engine_support import Daemon

pytestmark = pytest.mark.timeout(900)

N = 6


@pytest.fixture(scope="module")
def kv():
    return pools.device_pool()


def _prompt(seed: int):
    toks = list(range(seed * 1000, seed * 1000 + N * pools.PAGE_SIZE))
    return pools.page_hashes(toks)


def _host(kv, layout="page_first"):
    host = pools.host_pool(kv, layout)
    idx = host.alloc(N * pools.PAGE_SIZE)
    pools.fill_random(host, idx, seed=3)
    return host, idx


def test_hicache_config_is_what_sglang_loads(workdir):
    cfg = kachedb.sglang.hicache_config("/tmp/x.sock", namespace="n1")
    assert cfg == {
        "backend_name": "kachedb",
        "module_path": "kachedb.sglang.storage",
        "class_name": "KacheDBStorage",
        "interface_v1": 1,
        "socket": "/tmp/x.sock",
        "namespace": "n1",
    }
    out = subprocess.run([sys.executable, "-m", "kachedb", "sglang-config", "--socket", "/tmp/x.sock", "--namespace", "n1"],
                         capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == cfg
    env = dict(os.environ, KACHEDB_SOCKET="/tmp/from-env.sock")
    out = subprocess.run([sys.executable, "-m", "kachedb", "sglang-config"], capture_output=True, text=True, check=True, env=env)
    assert json.loads(out.stdout)["socket"] == "/tmp/from-env.sock"


def test_factory_builds_it_and_selects_the_zero_copy_path(daemon, kv):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

    from kachedb.sglang.storage import KacheDBStorage

    host, _ = _host(kv)
    b = pools.backend(daemon.socket, host)
    assert isinstance(b, KacheDBStorage) and isinstance(b, HiCacheStorage)
    # what SGLang's cache controller tests to pick batch_get_v1 / batch_set_v1
    assert bool(b.storage_config.extra_config.get("interface_v1", 0))
    b.close()


@pytest.mark.parametrize("namespace, tenant, seen", [
    (None, "team-s", "team-s"),
    ("team-n", None, "team-n"),  # the default: the namespace label
    (None, None, "default"),
])
def test_the_daemon_sees_the_tenant(daemon, kv, namespace, tenant, seen):
    host, idx = _host(kv)
    keys = _prompt(7)
    b = pools.backend(daemon.socket, host, namespace=namespace, tenant=tenant)
    assert b.batch_set_v1(keys, idx) == [True] * N
    assert b.batch_exists(keys) == N
    rows = {t["name"]: t for t in daemon.stats()["tenants"]}
    assert rows[seen]["blocks"] == N and rows[seen]["stored_bytes"] > 0, rows
    assert rows[seen]["lookup_hits"] >= N, rows[seen]
    if seen != "default":
        assert rows["default"]["blocks"] == 0, rows["default"]
    b.close()


def test_a_bad_tenant_is_a_clear_error():
    with pytest.raises(ValueError, match="not a tenant name"):
        kachedb.sglang.hicache_config("/tmp/x.sock", tenant="no spaces")
    out = subprocess.run([sys.executable, "-m", "kachedb", "sglang-config", "--tenant", "_x"], capture_output=True, text=True)
    assert out.returncode == 2 and "not a tenant name" in out.stderr


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_round_trip_in_one_process(daemon, kv, layout):
    host, idx = _host(kv, layout)
    keys = _prompt(1)
    b = pools.backend(daemon.socket, host)
    assert b.batch_exists(keys) == 0
    assert b.batch_get_v1(keys, idx) == [False] * N
    assert b.batch_set_v1(keys, idx) == [True] * N
    assert b.batch_exists(keys) == N
    dst = host.alloc(N * pools.PAGE_SIZE)
    assert b.batch_get_v1(keys, dst) == [True] * N
    for a, e in zip(pools.pages_bytes(host, dst), pools.pages_bytes(host, idx)):
        assert torch.equal(a, e)
    assert daemon.stats()["pins"] == 0
    b.close()


def _zero(host, indices):
    for s in range(0, len(indices), pools.PAGE_SIZE):
        page = host.get_data_page(int(indices[s]), flat=True)
        host.set_from_flat_data_page(int(indices[s]), torch.zeros_like(page))


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_page_ranges_are_kept_until_the_pool_buffer_moves(daemon, kv, layout, monkeypatch):
    # A page's byte ranges come from get_page_buffer_meta once and are kept: storing or
    # loading pages seen before asks the pool nothing. A pool whose buffer moved
    # is asked again, and the bytes go to the new buffer, never the old one.
    host, idx = _host(kv, layout)
    calls = []
    meta = host.get_page_buffer_meta

    def counting_meta(indices):
        calls.append(int(len(indices)))
        return meta(indices)

    monkeypatch.setattr(host, "get_page_buffer_meta", counting_meta)
    b = pools.backend(daemon.socket, host)
    keys = _prompt(40 + (layout == "layer_first"))
    assert b.batch_set_v1(keys, idx) == [True] * N
    assert len(calls) == 1
    dst = host.alloc(N * pools.PAGE_SIZE)
    assert b.batch_get_v1(keys, dst) == [True] * N  # pages not seen yet: asked
    assert len(calls) == 2
    _zero(host, dst)
    assert b.batch_get_v1(keys, dst) == [True] * N
    assert b.batch_set_v1(keys, idx) == [True] * N  # present: skipped, and asked nothing
    assert len(calls) == 2, "pages seen before were asked for again"
    want = [p.clone() for p in pools.pages_bytes(host, idx)]
    assert all(torch.equal(a, e) for a, e in zip(pools.pages_bytes(host, dst), want))

    _zero(host, dst)
    old = host.kv_buffer
    host.kv_buffer = torch.zeros_like(old)  # the pool's memory moved
    assert b.batch_get_v1(keys, dst) == [True] * N
    assert len(calls) == 3
    assert all(torch.equal(a, e) for a, e in zip(pools.pages_bytes(host, dst), want))
    assert not any(torch.equal(a, torch.zeros_like(a)) for a in want)
    host.kv_buffer = old  # the old buffer: untouched by the load
    assert all(torch.equal(a, torch.zeros_like(a)) for a in pools.pages_bytes(host, dst))
    assert daemon.stats()["pins"] == 0
    b.close()


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("order", ["meta", "reversed"])
def test_v1_block_holds_the_byte_ranges_in_meta_order(daemon, kv, layout, order, monkeypatch):
    # The block is the page's ranges concatenated in get_page_buffer_meta's
    # order, whether the pool names them in address order or (reversed within
    # each page) not.
    import ctypes

    host, idx = _host(kv, layout)
    if order == "reversed":
        meta = host.get_page_buffer_meta

        def reversed_meta(indices):
            ptrs, sizes = meta(indices)
            per = len(ptrs) // (len(indices) // pools.PAGE_SIZE)
            return [a for i in range(0, len(ptrs), per) for a in reversed(ptrs[i : i + per])], sizes

        monkeypatch.setattr(host, "get_page_buffer_meta", reversed_meta)
    keys = _prompt(20 + 2 * (layout == "layer_first") + (order == "reversed"))
    b = pools.backend(daemon.socket, host)
    assert b.batch_set_v1(keys, idx) == [True] * N
    ptrs, sizes = host.get_page_buffer_meta(idx)
    per = len(ptrs) // N
    kc = kachedb.connect(daemon.socket)
    for p, dkey in enumerate(b._dkeys(b.ns_v1, keys)):
        want = b"".join(ctypes.string_at(ptrs[p * per + r], sizes[p * per + r]) for r in range(per))
        got = kc.get(dkey)
        assert got.numpy().tobytes() == want
        del got
    kc.close()
    dst = host.alloc(N * pools.PAGE_SIZE)
    assert b.batch_get_v1(keys, dst) == [True] * N
    for a, e in zip(pools.pages_bytes(host, dst), pools.pages_bytes(host, idx)):
        assert torch.equal(a, e)
    assert daemon.stats()["pins"] == 0
    b.close()


def test_daemon_down_gives_misses_and_the_tier_comes_back(workdir, kv, caplog):
    sock = str(workdir / "down.sock")
    assert not os.path.exists(sock)
    host, idx = _host(kv)
    keys = _prompt(2)
    caplog.set_level(logging.WARNING, logger="kachedb.sglang")
    b = pools.backend(sock, host, retry_seconds=0.2)
    for _ in range(3):
        assert b.batch_exists(keys) == 0
        assert b.exists(keys[0]) is False
        assert b.batch_set_v1(keys, idx) == [False] * N
        assert b.batch_get_v1(keys, idx) == [False] * N
        assert b.get(keys[0]) is None
        assert b.batch_get(keys) == [None] * N
        assert b.set(keys[0], torch.zeros(4)) is False
        assert b.batch_set(keys, [torch.zeros(4)] * N) is False
        time.sleep(0.25)
    off = [r for r in caplog.records if "tier off" in r.getMessage()]
    assert len(off) == 1, [r.getMessage() for r in caplog.records]  # one warning per outage
    assert b.kachedb_stats()["tier_off"]
    d = Daemon(sock).start()
    try:
        time.sleep(0.3)  # past retry_seconds: the next call connects
        assert b.batch_set_v1(keys, idx) == [True] * N
        assert b.batch_exists(keys) == N
        assert b.kachedb_stats()["reconnects"] == 1
        assert d.stats()["blocks"] == N
    finally:
        b.close()
        d.stop()


def test_daemon_killed_mid_run_gives_misses(workdir, kv):
    d = Daemon(str(workdir / "killed.sock")).start()
    host, idx = _host(kv)
    keys = _prompt(3)
    b = pools.backend(d.socket, host, retry_seconds=60)
    try:
        assert b.batch_set_v1(keys, idx) == [True] * N
        d.kill()
        assert b.batch_exists(keys) == 0
        assert b.batch_get_v1(keys, idx) == [False] * N
        assert b.batch_set_v1(keys, idx) == [False] * N
        assert b.batch_get(keys) == [None] * N
        assert b.kachedb_stats()["tier_off"]
    finally:
        b.close()
        d.stop()


def test_bad_input_is_a_miss_and_changes_nothing(daemon, kv):
    host, idx = _host(kv)
    keys = _prompt(4)
    b = pools.backend(daemon.socket, host)
    before = daemon.stats()
    # host indices for fewer pages than keys
    assert b.batch_set_v1(keys, idx[: (N - 1) * pools.PAGE_SIZE]) == [False] * N
    assert b.batch_get_v1(keys, idx[:3]) == [False] * N
    # generic set without tensors
    assert b.batch_set(keys, None) is False
    assert b.batch_set(keys, [b"bytes"] * N) is False
    after = daemon.stats()
    assert after["blocks"] == before["blocks"] and after["reserved"] == 0 and after["pins"] == 0
    assert b.kachedb_stats()["errors"] >= 2
    b.close()


def test_a_page_stored_with_another_size_is_a_logged_miss(daemon, kv, caplog):
    host, idx = _host(kv)
    keys = _prompt(7)
    b = pools.backend(daemon.socket, host)
    assert b.batch_set_v1(keys, idx) == [True] * N
    dkeys = b._dkeys(b.ns_v1, keys)
    dst = host.alloc(N * pools.PAGE_SIZE)
    kc = kachedb.connect(daemon.socket)
    # a page simply missing: a miss, not logged
    kc.delete(dkeys[2])
    with caplog.at_level(logging.WARNING, logger="kachedb.sglang"):
        assert b.batch_get_v1(keys, dst) == [True, True] + [False] * (N - 2)
    assert "stored as" not in caplog.text
    # another layout's page under the same key: a miss, logged, nothing copied past the prefix
    kc.put(dkeys[2], torch.ones(100, dtype=torch.uint8))
    kc.close()
    _zero(host, dst)
    with caplog.at_level(logging.WARNING, logger="kachedb.sglang"):
        assert b.batch_get_v1(keys, dst) == [True, True] + [False] * (N - 2)
    assert "is stored as torch.uint8 of 100 bytes" in caplog.text
    got, want = pools.pages_bytes(host, dst), pools.pages_bytes(host, idx)
    assert all(torch.equal(a, e) for a, e in zip(got[:2], want[:2]))
    assert not any(a.any() for a in got[2:])
    assert daemon.stats()["pins"] == 0
    b.close()


def test_full_store_skips_the_batch(workdir):
    # pages of 256 KiB (16 tokens x 4 layers x 8 heads x 128 x bf16 x K,V); 32 of them > a 4 MiB store
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    kv = MHATokenToKVPool(size=256, page_size=16, dtype=torch.bfloat16, head_num=8, head_dim=128, layer_num=4,
                          device="cpu", enable_memory_saver=False, start_layer=0, end_layer=4)
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    host = MHATokenToKVPoolHost(kv.get_device_pool_infos()[0].buffer_info, host_to_device_ratio=2.0, host_size=0,
                                page_size=16, layout="page_first", pin_memory=False, device="cpu",
                                device_capacity_tokens=kv.size, start_layer=0, end_layer=4)
    idx = host.alloc(32 * 16)
    keys = [f"{i:064x}" for i in range(32)]
    d = Daemon(str(workdir / "full.sock"), size="4MiB").start()
    b = None
    try:
        b = pools.backend(d.socket, host)
        assert b.batch_set_v1(keys, idx) == [False] * 32
        s = d.stats()
        assert s["blocks"] == 0 and s["reserved"] == 0
        assert b.kachedb_stats()["store_full"] == 1
        # the tier stays on: a batch that fits is stored
        assert b.batch_set_v1(keys[:4], idx[: 4 * 16]) == [True] * 4
        assert b.batch_exists(keys) == 4
    finally:
        if b is not None:
            b.close()
        d.stop()


def test_generic_interface_in_one_process(daemon, kv):
    host, idx = _host(kv)
    keys = _prompt(5)
    b = pools.backend(daemon.socket, host, interface_v1=False)
    pages = [host.get_data_page(int(idx[i * pools.PAGE_SIZE]), flat=True) for i in range(N)]
    assert b.exists(keys[0]) is False
    assert b.set(keys[0], pages[0]) is True
    assert b.exists(keys[0]) is True
    assert b.batch_set(keys, pages) is True
    assert b.batch_exists(keys) == N
    target = host.get_dummy_flat_data_page()
    assert b.get(keys[2], target) is target
    assert torch.equal(target, pages[2])
    got = b.batch_get(keys + ["0" * 64])
    assert got[-1] is None
    assert all(torch.equal(g, p) for g, p in zip(got[:N], pages))
    # a target of another size is a miss, not a wrong copy
    assert b.get(keys[1], torch.zeros(3, dtype=torch.bfloat16)) is None
    # the v1 namespace is another one: the generic pages are not v1 pages
    v1 = pools.backend(daemon.socket, host)
    assert v1.batch_exists(keys) == 0
    del got
    assert daemon.stats()["pins"] == 0
    b.close()
    v1.close()


def test_v2_interface_is_misses_not_exceptions(daemon, kv):
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    host, idx = _host(kv)
    keys = _prompt(6)
    b = pools.backend(daemon.socket, host)
    t = PoolTransfer(name=PoolName.MAMBA, host_indices=idx, keys=keys)
    assert b.batch_exists_v2(keys, [t]).kv_hit_pages == 0
    assert b.batch_set_v2([t]) == {PoolName.MAMBA: [False] * N}
    assert b.batch_get_v2([t]) == {PoolName.MAMBA: [False] * N}
    assert daemon.stats()["blocks"] == 0
    b.close()
