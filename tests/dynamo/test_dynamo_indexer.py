"""The node's KV events (docs/events.md) in Dynamo's standalone KV indexer
(``python -m dynamo.indexer``, ai-dynamo-runtime 1.6.1), subscribed to the real daemon as one
worker: what the indexer makes of the stream, and how its score for a prompt follows the
daemon's index."""

from __future__ import annotations

import time

from dynamo_support import metric
from harness.daemon import Daemon, built_binary
from kv_events_support import free_port

#: The worker id the node is registered under in the indexer.
WORKER = 1
#: Tokens per block: the indexer's ``block_size`` (it must equal the events' ``block_size``).
BLOCK_TOKENS = 16


def test_a_late_indexer_gets_the_nodes_state_and_drops_blocks_stored_without_tokens(endpoints, indexer):
    """The indexer joins after blocks were stored: at the first batch it sees it asks the
    replay socket for everything from sequence 0, and the daemon answers with a snapshot. A
    block stored with no engine metadata goes out with ``token_ids: []`` and ``block_size: 0``;
    the indexer needs ``block_size`` equal to its own and the block's tokens (it hashes them
    itself), so it logs "Block not published" and indexes nothing: such a node is invisible to
    Dynamo."""
    pub, rep = endpoints
    http = free_port()
    extra = ["--events-endpoint", pub, "--events-replay-endpoint", rep, "--metrics-addr", f"127.0.0.1:{http}"]
    with Daemon(size="64MiB", extra=extra, binary=built_binary()) as d:
        kc = d.connect()
        for key in range(1, 5):
            kc.put(key, bytes(4096), parent=key - 1 if key > 1 else None)
        indexer.register(WORKER, pub, rep, BLOCK_TOKENS)
        # The subscription is made in the background; a block stored afterwards brings the
        # first batch, and with it the replay request. A liveness bound, not a timing assertion.
        key = 5
        deadline = time.monotonic() + 60
        while metric(http, "kachedb_events_replay_snapshots_total") < 1 and time.monotonic() < deadline:
            kc.put(key, bytes(4096))
            key += 1
            time.sleep(0.2)
        assert metric(http, "kachedb_events_replay_snapshots_total") >= 1, indexer.log()
        kc.put(key, bytes(4096), parent=key - 1)
        deadline = time.monotonic() + 30
        while "Block not published" not in indexer.log() and time.monotonic() < deadline:
            time.sleep(0.1)
        log = indexer.log()
        assert "Block size must be 16 tokens to be published. Block size is: 0" in log, log
        dump = indexer.dump()
        assert [ev for part in dump.values() for ev in part["events"]] == [], dump
        assert indexer.matched(range(BLOCK_TOKENS * 4), WORKER)["longest_matched"] == 0
        kc.close()
        d.stop(check=True)
