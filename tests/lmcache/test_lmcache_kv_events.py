"""LMCache chunks on the daemon's KV events with their tokens (issue 42).

A router matches a request by its tokens; LMCache's storage interface passes a
connector a chunk's key and bytes, not its tokens. The plugin watches LMCache's
token hashing (``kachedb.lmcache.records``) and attaches each stored chunk's
record — its hash, its parent's, its tokens, the chunk size — before the
commit, so the daemon publishes it as vLLM's ``BlockStored`` with what a router
needs (docs/lmcache.md, "KV events").

A real LMCache engine (``engine_proc.py`` scenario ``direct``, its own process)
stores a prompt into a daemon that publishes its KV events; a subscriber (ZMQ,
vLLM's schema) sees every chunk once, chained in the prompt's order, its tokens
the prompt's — for chunks committed in place in the daemon's region and for
chunks copied from LMCache's own memory (``max_pinned_bytes`` 0); both chain in
the daemon too (each names the chunk before it)."""

import time

import pytest

import lmcache_support as S
from engine_support import Daemon
from kv_events_support import Subscriber, free_port
from test_lmcache_engine import assert_kachedb_serving, run_engine

pytestmark = pytest.mark.timeout(600)

PROMPT = (128, 41)
CHUNKS = 8


@pytest.mark.parametrize("pinned", [None, 0], ids=["in_place", "copies"])
def test_stored_chunks_are_published_with_their_tokens_and_parents(workdir, pinned):
    pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    d = Daemon(str(workdir / f"lmcache-events-{pinned}.sock"), size="64MiB",
               extra=["--events-endpoint", pub, "--events-replay-endpoint", replay]).start()  # fmt: skip
    stored = {}
    counts = {}

    def on_event(ev):
        if type(ev).__name__ == "BlockStored":
            for h in ev.block_hashes:
                stored[h] = ev
                counts[h] = counts.get(h, 0) + 1

    sub = Subscriber(pub, replay, on_event=on_event).start()
    try:
        spec = {"scenario": "direct", "socket": d.socket, "prompt": PROMPT}
        if pinned is not None:
            spec["max_pinned_bytes"] = pinned
        r = run_engine(workdir, f"events-{pinned}", spec)
        assert_kachedb_serving(r)
        assert r["chunks"] == CHUNKS and r["landed"]["present"] == CHUNKS
        assert r["stats"]["stored_with_records"] == CHUNKS, r["stats"]
        # each chunk names the chunk before it (copied: at its reservation;
        # in place: in its COMMIT naming its key): one chain in the daemon
        assert r["daemon"]["chained_blocks"] == CHUNKS - 1, r["daemon"]
        want = r["event_hashes"]
        assert len(set(want)) == CHUNKS
        deadline = time.monotonic() + 30
        while not set(want) <= set(stored):
            assert time.monotonic() < deadline, f"published {sorted(stored)}, want {want}"
            time.sleep(0.05)
        tokens = S.prompt_tokens(*PROMPT)
        per = len(tokens) // CHUNKS
        for i, h in enumerate(want):
            ev = stored[h]
            assert list(ev.token_ids) == tokens[i * per : (i + 1) * per], i
            assert ev.block_size == S.CHUNK_TOKENS == per
            assert ev.parent_block_hash == (want[i - 1] if i else None), i
            assert counts[h] == 1, f"chunk {i} published {counts[h]} times"
    finally:
        sub.close()
        assert d.stop() == 0


@pytest.mark.parametrize("pinned", [None, 0], ids=["in_place", "copies"])
def test_a_longer_prompts_store_chains_onto_the_chunks_stored_before(workdir, pinned):
    """The store of a longer prompt with its saved prefix masked (how vLLM's
    adapter stores a conversation's next turn) is a batch that starts
    mid-prompt: its first chunk names the last chunk of the earlier store as
    its parent (the chunk LMCache's hashing says precedes it), so the daemon
    holds one chain of both stores."""
    d = Daemon(str(workdir / f"lmcache-extend-{pinned}.sock"), size="64MiB").start()
    try:
        spec = {"scenario": "direct", "socket": d.socket, "prompt": PROMPT, "extend": 64}
        if pinned is not None:
            spec["max_pinned_bytes"] = pinned
        r = run_engine(workdir, f"extend-{pinned}", spec)
        assert_kachedb_serving(r)
        more = 64 // S.CHUNK_TOKENS
        assert r["landed_extended"]["present"] == CHUNKS + more, r["landed_extended"]
        assert r["stats"]["stored_with_records"] == CHUNKS + more, r["stats"]
        assert r["daemon"]["chained_blocks"] == CHUNKS + more - 1, r["daemon"]
        assert r["daemon"]["parents_missing"] == 0, r["daemon"]
    finally:
        assert d.stop() == 0


@pytest.mark.parametrize("pinned", [None, 0], ids=["in_place", "copies"])
def test_chunks_keyed_by_handed_hashes_chain_in_the_daemon(workdir, pinned):
    """A store keyed by hashes LMCache is handed (``store(hashes=, offsets=)``,
    how its multi-process adapter stores vLLM's blocks: no tokens) has no
    records to publish, but the hashes' order says each chunk's parent: the
    chunks chain in the daemon all the same, and are published by key."""
    d = Daemon(str(workdir / f"lmcache-hashes-{pinned}.sock"), size="64MiB").start()
    try:
        spec = {"scenario": "direct", "socket": d.socket, "prompt": PROMPT, "by_hashes": True}
        if pinned is not None:
            spec["max_pinned_bytes"] = pinned
        r = run_engine(workdir, f"hashes-{pinned}", spec)
        assert r["landed"]["present"] == CHUNKS, r["landed"]
        assert r["stats"]["stored_with_records"] == 0, r["stats"]
        assert r["daemon"]["chained_blocks"] == CHUNKS - 1, r["daemon"]
        assert r["daemon"]["parents_missing"] == 0, r["daemon"]
    finally:
        assert d.stop() == 0
