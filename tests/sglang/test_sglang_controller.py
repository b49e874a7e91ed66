"""The backend under SGLang's own HiCache controller code: the controller's
backup (``_page_backup``), hit query (``_storage_hit_query``, which hashes the
tokens itself) and prefetch transfer (``_page_transfer_kv_batch``) functions,
on the zero-copy v1 path and on the generic path, both layouts.

A whole ``HiCacheController`` needs a GPU runtime, process groups and a
scheduler (none of which run here), so its functions are bound to an object
that carries only the attributes they read; the functions themselves, the
operations, the pools and the daemon are SGLang's and KacheDB's real ones."""

import time
import types

import pytest
import torch

import pools

pytestmark = pytest.mark.timeout(900)

PAGES = 6
_BOUND = ("_page_set_zero_copy", "_page_get_zero_copy", "_generic_page_set", "_generic_page_get", "_page_backup",
          "_storage_hit_query", "_page_transfer_kv_batch")


def controller_for(backend, host):
    from sglang.srt.managers.cache_controller import HiCacheController

    ctl = types.SimpleNamespace(storage_backend=backend, page_size=host.page_size, storage_host_pool=host,
                                mem_pool_host=host)
    for name in _BOUND:
        setattr(ctl, name, types.MethodType(getattr(HiCacheController, name), ctl))
    # the controller's own choice (attach_storage_backend): zero-copy when the config says interface_v1
    v1 = bool(backend.storage_config.extra_config.get("interface_v1", 0))
    ctl.page_set_func = ctl._page_set_zero_copy if v1 else ctl._generic_page_set
    ctl.page_get_func = ctl._page_get_zero_copy if v1 else ctl._generic_page_get
    return ctl


@pytest.fixture(scope="module")
def kv():
    return pools.device_pool()


@pytest.mark.parametrize("interface_v1", [True, False], ids=["v1", "generic"])
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_backup_then_prefetch_through_the_controller(daemon, kv, layout, interface_v1):
    from sglang.srt.managers.cache_controller import PrefetchOperation, StorageOperation
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    ps = pools.PAGE_SIZE
    tokens = list(range(300, 300 + PAGES * ps))
    # server 1 backs a prompt up from its host pool
    host1 = pools.host_pool(kv, layout)
    src = host1.alloc(PAGES * ps)
    pools.fill_random(host1, src, seed=11)
    ctl1 = controller_for(pools.backend(daemon.socket, host1, interface_v1=interface_v1), host1)
    backup = StorageOperation(src, tokens, hash_value=pools.page_hashes(tokens))
    ctl1._page_backup(backup)
    assert backup.completed_tokens == PAGES * ps

    # server 2 (another host pool) gets a longer prompt: the controller's hit query
    # hashes the tokens itself and finds the stored prefix
    host2 = pools.host_pool(kv, layout)
    host2.alloc((PAGES + 1) * ps)
    ctl2 = controller_for(pools.backend(daemon.socket, host2, interface_v1=interface_v1), host2)
    op = PrefetchOperation("req-1", tokens + list(range(9000, 9000 + 2 * ps)))
    hashes, hit_tokens = ctl2._storage_hit_query(op)
    assert hit_tokens == PAGES * ps
    assert hashes == backup.hash_value
    dst = host2.alloc(PAGES * ps)
    hits = ctl2._page_transfer_kv_batch(op, hashes, dst, HiCacheStorageExtraInfo(prefix_keys=None), [])
    assert hits == PAGES
    for a, e in zip(pools.pages_bytes(host2, dst), pools.pages_bytes(host1, src)):
        assert torch.equal(a, e)
    assert daemon.stats()["pins"] == 0
    ctl1.storage_backend.close()
    ctl2.storage_backend.close()


def test_pages_backed_up_by_the_controller_are_published_with_their_tokens(workdir, kv):
    """The backend watches the controller's backup (``_page_backup``, SGLang's
    own code): each page it stores carries its record — the first 64 bits of
    its page hash, its parent page's, its tokens, the page size — and the
    daemon's KV events publish it so, for a router that matches by tokens
    (docs/sglang.md, "KV events"); a page stored outside a backup is published
    by key."""
    from sglang.srt.managers.cache_controller import StorageOperation
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    from engine_support import Daemon
    from kv_events_support import Subscriber, free_port

    pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    d = Daemon(str(workdir / "sglang-events.sock"),
               extra=["--events-endpoint", pub, "--events-replay-endpoint", replay]).start()  # fmt: skip
    stored = {}
    sub = Subscriber(pub, replay, on_event=lambda ev: stored.update(
        {h: ev for h in getattr(ev, "block_hashes", ())} if type(ev).__name__ == "BlockStored" else {})).start()
    try:
        ps = pools.PAGE_SIZE
        tokens = list(range(700, 700 + PAGES * ps))
        hashes = pools.page_hashes(tokens)
        host = pools.host_pool(kv, "page_first")
        src = host.alloc(PAGES * ps)
        pools.fill_random(host, src, seed=5)
        backend = pools.backend(d.socket, host, interface_v1=True)
        ctl = controller_for(backend, host)
        # the first two pages stored before, by a backup whose operation named them
        ctl._page_backup(StorageOperation(src[: 2 * ps], tokens[: 2 * ps], hash_value=hashes[:2]))
        ctl._page_backup(StorageOperation(src[2 * ps :], tokens[2 * ps :], hash_value=hashes[2:],
                                          prefix_keys=hashes[:2]))  # fmt: skip
        want = [int(h[:16], 16) for h in hashes]
        deadline = time.monotonic() + 30
        while not set(want) <= set(stored):
            assert time.monotonic() < deadline, f"published: {sorted(stored)}"
            time.sleep(0.05)
        for i, h in enumerate(want):
            ev = stored[h]
            assert list(ev.token_ids) == tokens[i * ps : (i + 1) * ps] and ev.block_size == ps
            assert ev.parent_block_hash == (want[i - 1] if i else None), i
        # outside a backup: by key
        other = host.alloc(ps)
        key = pools.page_hashes(list(range(50_000, 50_000 + ps)))[0]
        assert backend.batch_set_v1([key], other, HiCacheStorageExtraInfo(prefix_keys=None)) == [True]
        assert backend.records
        backend.close()
    finally:
        sub.close()
        d.stop()
