"""Rank-replicated KV (issue 25, item 3): every TP rank of an MLA model holds the
same latent KV, so a page is stored once, by SGLang's storage writer (rank 0),
and read by every rank. Real MLA pools (``MLATokenToKVPool`` /
``MLATokenToKVPoolHost``) on CPU, the backends of ranks 0 and 1 of a TP=2
server built as SGLang's controller builds them (``is_mla_model``), both layouts.

The pools of the two ranks are filled with different bytes here (on a real
server they are equal), so the bytes a rank loads say who stored them."""

import pytest
import torch

import pools

pytestmark = pytest.mark.timeout(900)
N = 6


@pytest.fixture(scope="module")
def kv():
    return pools.mla_device_pool()


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_mla_page_is_stored_once_by_the_writer_and_read_by_every_rank(daemon, kv, layout):
    keys = pools.page_hashes(list(range(7000, 7000 + N * pools.PAGE_SIZE)))
    hosts, src, backends = [], [], []
    for rank in (0, 1):
        host = pools.mla_host_pool(kv, layout)
        idx = host.alloc(N * pools.PAGE_SIZE)
        pools.fill_random(host, idx, seed=40 + rank)
        hosts.append(host)
        src.append(idx)
        backends.append(pools.backend(daemon.socket, host, tp_rank=rank, tp_size=2, mla=True))
    b0, b1 = backends
    assert b0.ns_v1 == b1.ns_v1  # one namespace: the TP rank is not in it
    # Rank 1 first (backups run in parallel on a real server): it stores nothing.
    assert b1.batch_set_v1(keys, src[1]) == [True] * N
    assert daemon.stats()["blocks"] == 0
    assert b0.batch_set_v1(keys, src[0]) == [True] * N
    assert daemon.stats()["blocks"] == N  # once, not once per rank
    assert b0.kachedb_stats()["set_pages_stored"] == N
    assert b1.kachedb_stats()["set_pages_stored"] == 0
    assert b1.kachedb_stats()["set_pages_replica_skipped"] == N
    for rank, (b, host) in enumerate(zip(backends, hosts)):  # every rank reads rank 0's pages
        assert b.batch_exists(keys) == N
        dst = host.alloc(N * pools.PAGE_SIZE)
        assert b.batch_get_v1(keys, dst) == [True] * N
        for a, e in zip(pools.pages_bytes(host, dst), pools.pages_bytes(hosts[0], src[0])):
            assert torch.equal(a, e), rank
    assert daemon.stats()["pins"] == 0
    for b in backends:
        b.close()
