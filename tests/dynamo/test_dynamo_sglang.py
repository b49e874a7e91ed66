"""SGLang's HiCache backend as the writer — SGLang's own cache-controller backup
(``HiCacheController._page_backup``) of a prompt's pages from a real SGLang host pool, as
tests/sglang/test_sglang_controller.py drives it — and Dynamo's standalone indexer subscribed to
the node's KV events as its one worker: once the controller has backed the prompt up into
KacheDB, the indexer scores the node with every page, matching by the tokens the backend's
records carry (SGLang's storage interface passes page hashes only; docs/sglang.md, "KV events
carry the pages' tokens"); the pages chain in the daemon, which evicts the prompt from its end,
and after each eviction the score drops to the pages still held (the delay from the put that
evicted to the indexer's new answer is printed, p50/p99). Runs in .venv-sglang (``make test-dynamo``); in another environment it says skipped."""

from __future__ import annotations

import random

import pytest

from engine_support import engine_installed

if not engine_installed("sglang"):
    pytest.skip("SGLang is not installed here (make test-dynamo runs this in .venv-sglang)", allow_module_level=True)

import pools  # noqa: E402  (tests/sglang: on sys.path where SGLang is installed)
from dynamo_support import Indexer, events_node, evict_from_the_tail, percentile, wait_subscribers  # noqa: E402
from kv_events_support import Subscriber  # noqa: E402
from test_sglang_controller import controller_for  # noqa: E402

pytestmark = pytest.mark.timeout(600)

WORKER = 1
MODEL = "sglang-tiny"
PAGES = 12


def test_pages_the_controller_backs_up_are_scored_on_the_node(workdir):
    from sglang.srt.managers.cache_controller import StorageOperation

    ps = pools.PAGE_SIZE
    r = random.Random(7)
    tokens = [r.randrange(32000) for _ in range(PAGES * ps)]
    d, pub, rep, http = events_node(workdir / "dyn-sglang.sock", "4MiB")
    ix = Indexer(workdir / "indexer-sglang.log").start()
    backend = sub = None
    try:
        ix.register(WORKER, pub, rep, ps, model=MODEL)
        # What the daemon holds, read from a second subscriber of the stream (a LOOKUP
        # would make the prompt the most recently used).
        sub = Subscriber(pub, rep).start()
        wait_subscribers(http, 2, ix)
        assert ix.matched(tokens, WORKER, model=MODEL)["longest_matched"] == 0

        host = pools.host_pool(pools.device_pool(), "page_first")
        src = host.alloc(PAGES * ps)
        pools.fill_random(host, src, seed=3)
        backend = pools.backend(d.socket, host, interface_v1=True)
        hashes = pools.page_hashes(tokens)
        controller_for(backend, host)._page_backup(StorageOperation(src, tokens, hash_value=hashes))
        assert backend.kachedb_stats()["set_pages_stored"] == PAGES

        got, waited = ix.wait_matched(tokens, WORKER, PAGES * ps, model=MODEL)
        assert got == PAGES * ps, (got, ix.query(tokens, model=MODEL), ix.log())
        m = ix.matched(tokens, WORKER, model=MODEL)
        assert m["cpu"] == PAGES * ps and m["gpu"] == 0, m
        print(f"\nthe controller backed up {PAGES} pages; the indexer scored the node {got} tokens "
              f"{waited * 1e3:.1f} ms after the backup returned")  # fmt: skip

        # The pages chain in the daemon: it evicts the prompt from its end, and after each
        # eviction the indexer's overlap drops to the pages still held.
        chain = [int(h[:16], 16) for h in hashes]
        dkeys = backend._dkeys(backend.ns_v1, hashes)
        with d.connect() as kc:
            with kc.get(dkeys[0]) as t:
                nbytes = t.numel() * t.element_size()
            del t  # a live view keeps its block pinned
            delays, _ = evict_from_the_tail(kc, sub, ix, WORKER, tokens, chain, ps, nbytes, 10**15, model=MODEL)
            assert kc.lookup(dkeys) == 0
        # One page at a time from the end (a page's parent is the one before it): as many
        # evictions as pages, each dropping the overlap by one page.
        assert len(delays) == PAGES, delays
        print(f"eviction to the indexer's new overlap, {len(delays)} evictions: p50 {percentile(delays, 0.5) * 1e3:.1f} ms, "
              f"p99 {percentile(delays, 0.99) * 1e3:.1f} ms, max {max(delays) * 1e3:.1f} ms")  # fmt: skip
    finally:
        if sub is not None:
            sub.close()
        if backend is not None:
            backend.close()
        ix.stop()
        d.stop()
