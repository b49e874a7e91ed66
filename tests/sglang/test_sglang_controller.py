"""The backend under SGLang's own HiCache controller code: the controller's
backup (``_page_backup``), hit query (``_storage_hit_query``, which hashes the
tokens itself) and prefetch transfer (``_page_transfer_kv_batch``) functions,
on the zero-copy v1 path and on the generic path, both layouts.

A whole ``HiCacheController`` needs a GPU runtime, process groups and a
scheduler (none of which run here), so its functions are bound to an object
that carries only the attributes they read; the functions themselves, the
operations, the pools and the daemon are SGLang's and KacheDB's real ones."""

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
