"""Block metadata in the daemon's KV events (docs/events.md, "Block metadata"),
against the real daemon binary and real ZMQ subscribers decoding with vLLM's
msgspec schema: a writer that attaches what the engine knows of each block
(``kachedb.BlockMeta``: its hash, its parent's, its tokens, the block size,
the LoRA adapter) sees those published in ``BlockStored`` — on the stream, and
in the snapshot a late joiner gets — and its removal under the same hash; a
block stored without a record is published by key; a record out of bounds is
refused before anything is sent and leaves the block to be published by key.
The disk tier's blocks are published too (medium ``DISK``), with the records
written into their files: after a ``kill -9`` and a restart the stream holds
what the disk kept, under the engine's hashes."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("zmq", reason="pyzmq is not installed (make python installs it)")
pytest.importorskip("msgspec", reason="msgspec is not installed (make python installs it)")

import kachedb  # noqa: E402
from harness.daemon import Daemon, built_binary  # noqa: E402
from kv_events_support import Subscriber, free_port, settle  # noqa: E402

BLOCK = 16
# Engine hashes far from the keys' own (the keys are small ints, their own hashes).
H = [0xF000_0000_0000_0001 + i for i in range(4)]


class Recorder:
    """The last ``BlockStored`` seen per hash (``stored``: in the megaslab,
    ``disk``: on the disk tier), and every removed hash."""

    def __init__(self) -> None:
        self.stored: dict = {}
        self.disk: dict = {}
        self.removed: list = []
        self.lock = threading.Lock()

    def __call__(self, ev) -> None:
        with self.lock:
            name = type(ev).__name__
            if name == "BlockStored":
                for h in ev.block_hashes:
                    (self.disk if ev.medium == "DISK" else self.stored)[h] = ev
            elif name == "BlockRemoved":
                self.removed.extend(ev.block_hashes)


def tokens(i: int) -> list:
    return [1000 * i + t for t in range(BLOCK)]


def metas() -> list:
    return [
        kachedb.BlockMeta(
            block_hash=H[i],
            parent_hash=H[i - 1] if i else None,
            token_ids=tokens(i),
            block_size=BLOCK,
            lora_id=3 if i == 2 else None,
            lora_name="adapter" if i == 2 else None,
        )
        for i in range(3)
    ]


def test_a_writers_block_metadata_is_published_with_its_blocks_and_in_snapshots():
    pub, replay = free_port(), free_port()
    pub_ep, replay_ep = f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}"
    extra = ["--events-endpoint", pub_ep, "--events-replay-endpoint", replay_ep, "--events-replay-batches", "4"]
    rec = Recorder()
    value = b"\0" * 4096
    with Daemon(size="16MiB", extra=extra, binary=built_binary()) as d:
        sub = Subscriber(pub_ep, replay_ep, on_event=rec).start()
        try:
            kc = d.connect()
            next_key = settle(kc, [sub], value, 10**9, set())
            # Three chained blocks with their records, in one batch.
            res = kc.reserve_many([1, 2, 3], (4096,), "uint8", chain=True)
            res.attach_meta(metas())
            res.commit()
            # One without a record: published by key.
            kc.put(4, value, parent=3)
            for h in H[:3] + [4]:
                assert sub.saw(h, 30), f"hash {h:#x} not published"
            for i in range(3):
                ev = rec.stored[H[i]]
                assert ev.block_hashes == [H[i]] and ev.medium == "CPU"
                assert ev.parent_block_hash == (H[i - 1] if i else None)
                assert list(ev.token_ids) == tokens(i) and ev.block_size == BLOCK
                assert (ev.lora_id, ev.lora_name) == ((3, "adapter") if i == 2 else (None, None))
            plain = rec.stored[4]
            # Its parent is block 3, as the stream named it: the engine's hash.
            assert (plain.token_ids, plain.block_size, plain.parent_block_hash) == ([], 0, H[2])
            # The blocks' keys are not published: the engine's hashes are.
            assert not {1, 2, 3} & set(rec.stored)

            # A late joiner's snapshot (replay from 0, older than the buffer)
            # carries the same records.
            for k in range(next_key, next_key + 8):
                kc.put(k, value)  # push the first batches out of the replay buffer
            late_rec = Recorder()
            late = Subscriber(pub_ep, replay_ep, on_event=late_rec).start()
            try:
                settle(kc, [sub, late], value, next_key + 8, set())
                assert late.snapshots >= 1
                for i in range(3):
                    ev = late_rec.stored[H[i]]
                    assert list(ev.token_ids) == tokens(i) and ev.block_size == BLOCK
                    assert ev.parent_block_hash == (H[i - 1] if i else None)
                assert late_rec.stored[4].parent_block_hash == H[2]
            finally:
                late.close()

            # Removed under the hash it was stored under.
            kc.delete(2)
            kc.delete(4)
            settle(kc, [sub], value, next_key + 200, set())
            assert H[1] in rec.removed and 4 in rec.removed and 2 not in rec.removed
            assert H[1] not in sub.index and H[0] in sub.index
            kc.close()
        finally:
            sub.close()


def test_records_given_to_commit_as_are_published_with_blocks_reserved_without_a_key():
    """``Client.commit_as(reservations, keys, metas)``: blocks reserved before
    their keys were known (LMCache's chunks in the region) get their records in
    the commit's batch; a ``None`` leaves its block to be published by key."""
    pub, replay = free_port(), free_port()
    pub_ep, replay_ep = f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}"
    rec = Recorder()
    value = b"\0" * 4096
    with Daemon(size="16MiB", extra=["--events-endpoint", pub_ep, "--events-replay-endpoint", replay_ep],
                binary=built_binary()) as d:  # fmt: skip
        sub = Subscriber(pub_ep, replay_ep, on_event=rec).start()
        try:
            kc = d.connect()
            settle(kc, [sub], value, 10**9, set())
            held = kc.reserve_each(3, (4096,), "uint8")
            for i, r in enumerate(held):
                r.out.fill_(i)
            m = metas()
            with pytest.raises(kachedb.InvalidArgument):
                kc.commit_as(held, [21, 22, 23], [m[0]])  # one record for three: nothing committed
            assert kc.commit_as(held, [21, 22, 23], [m[0], None, m[2]]) == [True, True, True]
            held = r = None
            for h in (H[0], 22, H[2]):
                assert sub.saw(h, 30), f"hash {h:#x} not published"
            assert list(rec.stored[H[0]].token_ids) == tokens(0)
            assert list(rec.stored[H[2]].token_ids) == tokens(2) and rec.stored[H[2]].lora_name == "adapter"
            assert rec.stored[22].token_ids == [] and not {21, 23} & set(rec.stored)
            assert d.stats()["reserved"] == 0
            kc.close()
        finally:
            sub.close()


def test_block_metadata_out_of_bounds_is_refused_and_the_block_is_published_by_key():
    pub, replay = free_port(), free_port()
    pub_ep, replay_ep = f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}"
    rec = Recorder()
    value = b"\0" * 4096
    with Daemon(size="16MiB", extra=["--events-endpoint", pub_ep, "--events-replay-endpoint", replay_ep],
                binary=built_binary()) as d:  # fmt: skip
        sub = Subscriber(pub_ep, replay_ep, on_event=rec).start()
        try:
            kc = d.connect()
            settle(kc, [sub], value, 10**9, set())
            res = kc.reserve_many([7, 8], (4096,), "uint8")
            bad = [
                kachedb.BlockMeta(block_hash=H[0], token_ids=tokens(0), block_size=BLOCK - 1),  # more tokens than the block
                kachedb.BlockMeta(block_hash=-1, token_ids=tokens(0)),  # not a u64
                kachedb.BlockMeta(block_hash=H[0], token_ids=[1] * 5000, block_size=8192),  # past MAX_META_TOKENS
                kachedb.BlockMeta(block_hash=H[0], token_ids=tokens(0), lora_name="x" * 300),  # name too long
            ]
            for m in bad:
                with pytest.raises(kachedb.InvalidArgument):
                    res.attach_meta([m, None])
            with pytest.raises(kachedb.InvalidArgument, match="per reservation|one .* per"):
                res.attach_meta([None])  # one record per block
            with pytest.raises(kachedb.InvalidArgument):
                res.attach_meta(["not a record", None])
            good = kachedb.BlockMeta(block_hash=H[1], token_ids=tokens(1))
            res.attach_meta([None, good])
            res.commit()
            assert sub.saw(7, 30) and sub.saw(H[1], 30)
            assert (rec.stored[7].token_ids, rec.stored[7].block_size) == ([], 0)
            assert H[0] not in rec.stored and 8 not in rec.stored
            assert rec.stored[H[1]].block_size == BLOCK  # defaults to the tokens' count
            # After the commit nothing can be attached.
            with pytest.raises(kachedb.InvalidArgument):
                res.attach_meta([good, good])
            # One reservation; a second record replaces the first.
            kc.put(9, value)
            r = kc.reserve(10, (4096,), "uint8")
            r.attach_meta(kachedb.BlockMeta(block_hash=H[2], token_ids=tokens(2)))
            r.attach_meta(kachedb.BlockMeta(block_hash=H[3], token_ids=tokens(3), parent_hash=H[1]))
            r.commit()
            assert sub.saw(H[3], 30) and sub.saw(9, 30)
            assert H[2] not in rec.stored and 10 not in rec.stored
            assert (list(rec.stored[H[3]].token_ids), rec.stored[H[3]].parent_block_hash) == (tokens(3), H[1])
            kc.close()
        finally:
            sub.close()


def until(what, cond, timeout_s: float = 60.0) -> None:
    """Waits for ``cond()`` (a liveness bound, not a timing assertion)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)


def test_the_disk_tiers_blocks_are_published_with_their_records_and_what_it_kept_after_kill_9(tmp_path):
    """Each block written to the disk tier is published with medium ``DISK``
    and its writer's record (kept in the file's header area); a block deleted
    is removed from both media; after ``kill -9`` and a restart the node's
    stream (a gap, a replay, a snapshot) holds exactly what the disk kept —
    under the engine's hashes — and nothing in the megaslab; a block filled
    back from disk is published in the megaslab with its record again."""
    pub, replay = free_port(), free_port()
    pub_ep, replay_ep = f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}"
    extra = ["--events-endpoint", pub_ep, "--events-replay-endpoint", replay_ep,
             "--disk", str(tmp_path / "disk"), "--disk-size", "64MiB"]  # fmt: skip
    rec = Recorder()
    value = b"\0" * 4096
    d = Daemon(size="16MiB", extra=extra, binary=built_binary()).start()
    sub = Subscriber(pub_ep, replay_ep, on_event=rec).start()
    try:
        kc = d.connect()
        plain: set = set()
        settle(kc, [sub], value, 10**9, plain)
        res = kc.reserve_many([1, 2, 3], (4096,), "uint8", chain=True)
        res.attach_meta(metas())
        res.commit()
        kc.put(4, value, parent=3)
        on_disk = {H[0], H[1], H[2], 4} | plain
        until("every block published on the disk tier", lambda: on_disk <= sub.disk)
        assert sub.disk == on_disk and sub.index == on_disk
        for i in range(3):
            ev = rec.disk[H[i]]
            assert list(ev.token_ids) == tokens(i) and ev.block_size == BLOCK
            assert ev.parent_block_hash == (H[i - 1] if i else None)
        assert rec.disk[4].parent_block_hash == H[2] and rec.disk[4].token_ids == []
        # A DELETE removes the block from both media.
        kc.delete(2)
        until("block 2 removed from both media", lambda: H[1] not in sub.disk and H[1] not in sub.index)
        on_disk.discard(H[1])
        assert d.stats()["disk_blocks"] == len(on_disk)
        kc.close()

        d.kill()
        rec.disk.clear()
        rec.stored.clear()
        d.start()  # the same socket, disk directory and endpoints
        kc = d.connect()
        # The subscriber learns of the restart from the sequence's gap (an
        # empty batch follows its reconnection), replays, and gets a snapshot:
        # the megaslab empty, the disk's blocks as the index rebuild found them.
        until("the restarted node's disk published", lambda: sub.disk == on_disk and not sub.index)
        assert d.stats()["disk_blocks"] == len(on_disk)
        assert list(rec.disk[H[2]].token_ids) == tokens(2) and rec.disk[H[2]].parent_block_hash == H[1]
        assert (rec.disk[H[2]].lora_id, rec.disk[H[2]].lora_name) == (3, "adapter")
        # Filled back from disk: in the megaslab again, with its record.
        assert kc.lookup([1]) == 1
        until("block 1 published in the megaslab again", lambda: H[0] in sub.index)
        assert list(rec.stored[H[0]].token_ids) == tokens(0) and rec.stored[H[0]].medium == "CPU"
        kc.close()
        d.stop(check=True)
    finally:
        sub.close()
        d.stop()


def test_a_block_filled_from_the_remote_tier_is_published_with_its_writers_record():
    """Node A stores blocks with their records; its remote tier writes each
    record beside the block in the Redis Cluster (docs/remote.md, "A block's
    metadata record"). Node B, publishing KV events, fills them on a miss and
    publishes them in its megaslab with A's records — the engine's hashes,
    tokens and parents — as A's own stream did; a block stored without one,
    and one whose record was forged in Redis, are filled with their bytes
    and published by key."""
    import sys
    import uuid
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bindings" / "python" / "tests"))
    from redis_cluster import RedisCluster

    cluster = RedisCluster(3)
    ns = f"meta-{uuid.uuid4().hex[:8]}"
    remote = ["--remote", cluster.url, "--remote-namespace", ns]
    value = b"\x07" * 4096
    a_pub = f"tcp://127.0.0.1:{free_port()}"
    pub, replay = free_port(), free_port()
    pub_ep, replay_ep = f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}"
    a = Daemon(size="16MiB", extra=remote + ["--events-endpoint", a_pub], binary=built_binary()).start()
    b = Daemon(size="16MiB", extra=remote + ["--events-endpoint", pub_ep, "--events-replay-endpoint", replay_ep],
               binary=built_binary()).start()  # fmt: skip
    rec = Recorder()
    sub = Subscriber(pub_ep, replay_ep, on_event=rec).start()
    try:
        with a.connect() as kc:
            res = kc.reserve_many([1, 2, 3], (4096,), "uint8", chain=True)
            for out in res.out:
                out.fill_(7)
            res.attach_meta(metas())
            res.commit()
            kc.put(4, value, parent=3)
        until("A's four blocks written to the cluster", lambda: a.stats()["remote_writes"] >= 4)
        rc = cluster.client()
        assert rc.exists(f"{ns}:{{{kachedb.key_of(1):032x}}}:m") and not rc.exists(f"{ns}:{{{kachedb.key_of(4):032x}}}:m")
        # Block 3's record forged: another block's record under its key.
        rc.set(f"{ns}:{{{kachedb.key_of(3):032x}}}:m", rc.get(f"{ns}:{{{kachedb.key_of(2):032x}}}:m"))
        with b.connect() as kc:
            plain: set = set()
            settle(kc, [sub], value, 10**9, plain)
            for k in (1, 2, 3, 4):
                assert kc.lookup([k]) == 1, f"block {k} not filled from the cluster"
                got = kc.get_numpy(k)
                assert got.tobytes() == value, f"block {k}: not A's bytes"
                del got
            until("B's fills published", lambda: {H[0], H[1], 3, 4} <= sub.index)
        for i in range(2):
            ev = rec.stored[H[i]]
            assert ev.medium == "CPU" and list(ev.token_ids) == tokens(i) and ev.block_size == BLOCK
            assert ev.parent_block_hash == (H[i - 1] if i else None)
        assert H[2] not in sub.index, "a forged record was published"
        assert rec.stored[3].token_ids == [] and rec.stored[4].token_ids == []
        b.stop(check=True)
        a.stop(check=True)
    finally:
        sub.close()
        b.stop()
        a.stop()
        cluster.stop()
