"""Blocks stored with engine metadata (``kachedb.BlockMeta``: the engine's block hash, its
parent's, the block's tokens, the block size) through the Python client, and Dynamo's
standalone indexer subscribed to the daemon's KV events as the node's one worker: the indexer
scores a stored prompt with all its blocks; as the daemon evicts the prompt's chain from its
tail the score drops to the blocks still held (the delay from the put that evicted to the
indexer's new answer is printed, p50/p99); after a ``kill -9`` and a restart on a disk tier the
indexer holds no block the daemon lost."""

from __future__ import annotations

import random
import time

import pytest

import kachedb
from dynamo_support import evict_from_the_tail, metric, percentile
from harness.daemon import Daemon, built_binary
from kv_events_support import Subscriber, free_port, settle

if not hasattr(kachedb, "BlockMeta"):  # pragma: no cover - depends on the build
    pytest.skip("this build's client attaches no block metadata (kachedb.BlockMeta)", allow_module_level=True)

WORKER = 1
MODEL = "kachedb-test"
#: Tokens per block (the indexer is registered with it; the records carry it).
BLOCK_TOKENS = 16
BLOCK_BYTES = 64 * 1024


def node(endpoints, http: int, size: str, more=()):
    pub, rep = endpoints
    extra = ["--events-endpoint", pub, "--events-replay-endpoint", rep, "--metrics-addr", f"127.0.0.1:{http}", *more]
    return Daemon(size=size, extra=extra, binary=built_binary())


def subscribed(indexer, endpoints, http: int) -> None:
    """Registers the node with the indexer and waits for its subscription (a liveness bound)."""
    pub, rep = endpoints
    indexer.register(WORKER, pub, rep, BLOCK_TOKENS)
    deadline = time.monotonic() + 60
    while metric(http, "kachedb_events_subscribers") < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(http, "kachedb_events_subscribers") >= 1, indexer.log()


def store_prompt(kc, rng: random.Random, blocks: int):
    """A prompt of ``blocks`` whole blocks stored as one chain, each block with its record;
    returns (its tokens, its keys, its records)."""
    tokens = [rng.randrange(32000) for _ in range(blocks * BLOCK_TOKENS)]
    hashes = [rng.getrandbits(64) for _ in range(blocks)]
    keys = [h.to_bytes(8, "big") + b"prompt" for h in hashes]
    metas = [
        kachedb.BlockMeta(
            block_hash=hashes[i],
            parent_hash=hashes[i - 1] if i else None,
            token_ids=tokens[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS],
            block_size=BLOCK_TOKENS,
        )
        for i in range(blocks)
    ]
    res = kc.reserve_many(keys, (BLOCK_BYTES,), "uint8", chain=True)
    with res as outs:
        for out in outs:
            out[:] = 1
        res.attach_meta(metas)
    return tokens, keys, metas


def test_a_stored_prompt_scores_all_its_blocks_and_the_score_follows_evictions(endpoints, indexer):
    http = free_port()
    rng = random.Random(42)
    with node(endpoints, http, "16MiB") as d:
        subscribed(indexer, endpoints, http)
        sub = Subscriber(*endpoints).start()
        kc = d.connect()
        delays: list = []
        next_key = settle(kc, [sub], bytes(BLOCK_BYTES), 10**15, set())
        for round_ in range(8):
            tokens, keys, metas = store_prompt(kc, rng, 16)
            assert kc.lookup(keys) == 16
            # No engine looked the prompt up: the node's events alone tell the indexer.
            got, _ = indexer.wait_matched(tokens, WORKER, 16 * BLOCK_TOKENS)
            m = indexer.matched(tokens, WORKER)
            assert got == 16 * BLOCK_TOKENS and m["cpu"] == got and m["gpu"] == 0, (m, indexer.log())
            # A longer request over the same prefix matches the prefix only.
            longer = tokens + [rng.randrange(32000) for _ in range(3 * BLOCK_TOKENS)]
            assert indexer.matched(longer, WORKER)["longest_matched"] == 16 * BLOCK_TOKENS
            got_hashes = [m.block_hash for m in metas]
            d_round, next_key = evict_from_the_tail(
                kc, sub, indexer, WORKER, tokens, got_hashes, BLOCK_TOKENS, BLOCK_BYTES, next_key
            )
            delays += d_round
            assert kc.lookup(keys) == 0
        assert d.stats()["evictions"] >= 8 * 16
        print(
            f"\neviction to the indexer's new overlap, {len(delays)} rounds: p50 {percentile(delays, 0.5) * 1e3:.1f} ms, "
            f"p99 {percentile(delays, 0.99) * 1e3:.1f} ms, max {max(delays) * 1e3:.1f} ms"
        )
        kc.close()
        sub.close()
        d.stop(check=True)


def test_after_kill_9_and_a_restart_on_disk_the_indexer_matches_what_the_disk_kept(endpoints, indexer, tmp_path):
    """The disk tier's blocks are published (medium ``DISK``, Dynamo's disk tier) with the
    records their files keep. After a ``kill -9`` the restarted daemon's sequence numbers
    jump: the indexer asks for a replay and gets a snapshot (``AllBlocksCleared``, the empty
    megaslab) and the disk's blocks as the index rebuild finds them, with their tokens: the
    indexer scores the prompt in its disk tier, none of it in its host tier. The indexer
    learns of the restart without a store: the daemon publishes an empty batch just after a
    subscriber connects, and its sequence number is the gap."""
    http = free_port()
    disk = ["--disk", str(tmp_path / "disk"), "--disk-size", "256MiB"]
    rng = random.Random(7)
    d = node(endpoints, http, "64MiB", disk).start()
    try:
        subscribed(indexer, endpoints, http)
        kc = d.connect()
        tokens, keys, _ = store_prompt(kc, rng, 12)
        full = 12 * BLOCK_TOKENS
        deadline = time.monotonic() + 60
        while indexer.matched(tokens, WORKER)["disk"] != full and time.monotonic() < deadline:
            time.sleep(0.05)
        m = indexer.matched(tokens, WORKER)
        assert m["cpu"] == full and m["disk"] == full, (m, indexer.log())
        assert d.stats()["disk_writes"] >= 12
        kc.close()
        d.kill()
        t_restart = time.monotonic()
        d.start()  # the same socket, disk directory and endpoints
        kc = d.connect()
        # The indexer's SUB socket reconnects on its own; the empty batch the daemon sends
        # after it connects is the gap that brings the replay and the snapshot.
        deadline = time.monotonic() + 60
        while True:
            m = indexer.matched(tokens, WORKER)
            if (m["cpu"], m["disk"]) == (0, full) or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        matched_s = time.monotonic() - t_restart
        st = d.stats()
        assert st["blocks"] == 0 and st["disk_blocks"] == 12, st
        # Dynamo's `disk` figure counts the tiers above it too: 0 in the host tier, all on disk.
        assert (m["cpu"], m["disk"], m["longest_matched"]) == (0, full, full), (m, indexer.log())
        # Filled back from disk (a LOOKUP's fill), the chain is in the megaslab again,
        # published with the records its files kept.
        assert kc.lookup(keys) == 12
        got, _ = indexer.wait_matched(tokens, WORKER, full, key="cpu")
        assert got == full, (indexer.matched(tokens, WORKER), indexer.log())
        print(
            f"\nafter kill -9 and restart: the indexer scored the 12 blocks the disk kept "
            f"{matched_s * 1e3:.0f} ms after the restart began; in the host tier again once filled back"
        )
        kc.close()
    finally:
        d.stop()
