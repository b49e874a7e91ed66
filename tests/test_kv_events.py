"""The daemon's KV events (docs/events.md) against the real daemon binary and
real ZMQ subscribers decoding with vLLM's msgspec schema: after thousands of
mixed operations with evictions (a small megaslab), replacements, deletes and
chains, every subscriber's index (the stream applied in sequence order, gaps
repaired through the replay socket) equals the daemon's own set of blocks —
a fast subscriber, one that stops reading while the operations run, and one
that joins after them (a snapshot through the replay socket)."""

from __future__ import annotations

import os
import random
import subprocess
import time
import urllib.request

import pytest

pytest.importorskip("zmq", reason="pyzmq is not installed (make python installs it)")
pytest.importorskip("msgspec", reason="msgspec is not installed (make python installs it)")

from harness.daemon import Daemon, built_binary  # noqa: E402
from kv_events_support import DECODER_SOURCE, Subscriber, free_port, settle  # noqa: E402

OPS = int(os.environ.get("KACHEDB_EVENTS_TEST_OPS", "10000"))
OPS_AFTER_TAKEOVER = OPS // 10
KEYS = 3000
BLOCK_BYTES = 64 * 1024
# Keys of the blocks that mark points in the stream, apart from the others.
SENTINEL = 10**12


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} missing from /metrics")


def daemon_blocks(kc, universe) -> set:
    """The keys the daemon holds, probed one by one (a LOOKUP changes no
    membership)."""
    return {k for k in universe if kc.lookup([k]) == 1}


def mixed_ops(kc, rng, n: int, value: bytes, touched: set) -> None:
    """``n`` operations on keys below ``KEYS``: puts (most in chains, many
    replacing a block), deletes, batch deletes and lookups."""
    recent: list = []
    for _ in range(n):
        r = rng.random()
        key = rng.randrange(KEYS)
        touched.add(key)
        if r < 0.55:
            parent = rng.choice(recent) if recent and rng.random() < 0.6 else None
            kc.put(key, value, parent=parent)
            recent = (recent + [key])[-8:]
        elif r < 0.75:
            kc.delete(key)
        elif r < 0.85:
            other = rng.randrange(KEYS)
            touched.add(other)
            kc.delete_many([key, other])
        else:
            kc.lookup([key])


def take_over(d: Daemon, extra: list) -> None:
    """A new daemon (this binary, the same flags) takes over from ``d``'s;
    ``d`` then stands for it."""
    old = d.proc
    log_path = d.socket + ".takeover.log"
    with open(log_path, "wb") as log:
        new = subprocess.Popen(
            [built_binary(), "serve", "--socket", d.socket, "--takeover", *extra],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        assert old.wait(60) == 0, f"the old daemon exited with {old.returncode}:\n{d.log()}"
        deadline = time.monotonic() + 60
        while "took over" not in open(log_path, errors="replace").read():
            assert new.poll() is None, f"the new daemon exited:\n{open(log_path, errors='replace').read()}"
            assert time.monotonic() < deadline, "no takeover within 60 s"
            time.sleep(0.05)
    except BaseException:
        new.kill()
        raise
    d.proc, d.log_path = new, log_path


def test_every_subscribers_index_equals_the_daemons_after_mixed_operations():
    print(f"decoder: {DECODER_SOURCE}")
    pub, replay, http = free_port(), free_port(), free_port()
    pub_ep, replay_ep = f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}"
    extra = [
        "--events-endpoint", pub_ep,
        "--events-replay-endpoint", replay_ep,
        # Small enough that the late joiner's start (0) is gone: it gets a snapshot.
        "--events-replay-batches", "32",
        # Small enough that a burst may overflow it: drops, then a snapshot on the stream.
        "--events-queue", "64",
        "--metrics-addr", f"127.0.0.1:{http}",
    ]  # fmt: skip
    rng = random.Random(42)
    value = bytes(BLOCK_BYTES)
    with Daemon(size="32MiB", extra=extra, binary=built_binary()) as d:
        fast = Subscriber(pub_ep, replay_ep).start()
        slow = Subscriber(pub_ep, replay_ep, rcvhwm=4, rcvbuf=4096).start()
        subs = [fast, slow]
        try:
            kc = d.connect()
            touched: set = set()
            sentinel = settle(kc, subs, value, SENTINEL, touched)
            # From here on the slow one stops reading until the operations end.
            slow.paused.set()
            mixed_ops(kc, rng, OPS, value, touched)
            slow.paused.clear()
            sentinel = settle(kc, subs, value, sentinel, touched)
            late = Subscriber(pub_ep, replay_ep).start()
            subs.append(late)
            sentinel = settle(kc, subs, value, sentinel, touched)
            # A new daemon takes over (the client stays connected); its
            # sequence numbers go on above the old one's: every subscriber
            # sees a gap and gets a snapshot from the new daemon.
            snapshots_before = [s.snapshots for s in subs]
            before = urllib.request.urlopen(f"http://127.0.0.1:{http}/metrics", timeout=10).read().decode()
            take_over(d, extra)
            mixed_ops(kc, rng, OPS_AFTER_TAKEOVER, value, touched)
            settle(kc, subs, value, sentinel, touched)
            assert all(s.snapshots > b for s, b in zip(subs, snapshots_before)), "a snapshot after the takeover"
            held = daemon_blocks(kc, sorted(touched))
            st = kc.stats()
            assert st["blocks"] == len(held), "the probe missed blocks (a key outside the universe?)"
            assert st["evictions"] > 0, "the megaslab is meant to be small enough to evict"
            text = urllib.request.urlopen(f"http://127.0.0.1:{http}/metrics", timeout=10).read().decode()
            for name, s in (("fast", fast), ("slow", slow), ("late", late)):
                with s.changed:
                    index = set(s.index)
                missing, extra_ = held - index, index - held
                assert not missing and not extra_, (
                    f"{name} subscriber: {len(missing)} block(s) missing (e.g. {sorted(missing)[:5]}), "
                    f"{len(extra_)} reported that are gone (e.g. {sorted(extra_)[:5]})"
                )
            assert late.snapshots >= 1, "the late joiner's start was no longer buffered: a snapshot was due"
            for when, t in (("before the takeover", before), ("after it (the new daemon's)", text)):
                print(
                    f"{when}: published {int(metric(t, 'kachedb_events_batches_total'))} batches, "
                    f"{int(metric(t, 'kachedb_events_published_total'))} events, "
                    f"{int(metric(t, 'kachedb_events_bytes_total'))} bytes; "
                    f"dropped {int(metric(t, 'kachedb_events_dropped_total'))}, "
                    f"resyncs {int(metric(t, 'kachedb_events_resyncs_total'))}, "
                    f"send timeouts {int(metric(t, 'kachedb_events_send_timeouts_total'))}, "
                    f"replays {int(metric(t, 'kachedb_events_replays_total'))} "
                    f"({int(metric(t, 'kachedb_events_replay_snapshots_total'))} snapshots)"
                )
            print(
                f"{OPS} ops, a takeover, {OPS_AFTER_TAKEOVER} ops: {len(held)} blocks held, "
                f"{int(st['evictions'])} evictions; subscribers' gaps and snapshots: "
                + ", ".join(f"{n} {s.gaps}/{s.snapshots}" for n, s in (("fast", fast), ("slow", slow), ("late", late)))
            )
            assert metric(text, "kachedb_events_subscribers") >= 3
            assert metric(text, "kachedb_events_blocks") == len(held)
            kc.close()
        finally:
            for s in subs:
                s.close()
        d.stop(check=True)


def disk_keys(blocks_dir) -> set:
    """The published hashes (a key's low 64 bits: these blocks carry no record) of the block
    files under ``blocks_dir``: the disk tier's own index, as the files it holds."""
    return {int(name[16:32], 16) for name in os.listdir(blocks_dir) if name.endswith(".kdb")}


def quiet_disk(kc, timeout_s: float = 120.0) -> None:
    """Waits until the disk tier has written or dropped every queued block (a liveness bound)."""
    deadline = time.monotonic() + timeout_s
    while kc.stats()["disk_queue_blocks"] != 0:
        assert time.monotonic() < deadline, "the disk tier's queue never drained"
        time.sleep(0.05)


def test_every_subscribers_disk_index_equals_the_disk_tiers_after_mixed_operations(tmp_path):
    """The same with a disk tier smaller than the blocks put (it evicts too) and a queue of
    64 changes (its losses bring the tier's whole index): after the operations, the disk's
    queue drained and the stream quiet, each subscriber's disk view (medium ``DISK``) is the
    set of block files the tier holds, and its megaslab view the daemon's blocks — and again
    after a takeover, whose successor rebuilds the disk index from the files."""
    pub, replay, http = free_port(), free_port(), free_port()
    pub_ep, replay_ep = f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}"
    blocks_dir = tmp_path / "disk" / "blocks"
    extra = [
        "--events-endpoint", pub_ep,
        "--events-replay-endpoint", replay_ep,
        "--events-replay-batches", "32",
        "--events-queue", "64",
        "--disk", str(tmp_path / "disk"), "--disk-size", "48MiB",
        "--metrics-addr", f"127.0.0.1:{http}",
    ]  # fmt: skip
    rng = random.Random(7)
    value = bytes(BLOCK_BYTES)
    ops = max(OPS // 4, 500)
    with Daemon(size="32MiB", extra=extra, binary=built_binary()) as d:
        fast = Subscriber(pub_ep, replay_ep).start()
        slow = Subscriber(pub_ep, replay_ep, rcvhwm=4, rcvbuf=4096).start()
        subs = [fast, slow]
        try:
            kc = d.connect()
            touched: set = set()
            sentinel = settle(kc, subs, value, SENTINEL, touched)
            for phase in ("after the operations", "after a takeover"):
                if phase == "after a takeover":
                    take_over(d, extra)
                slow.paused.set()
                mixed_ops(kc, rng, ops, value, touched)
                slow.paused.clear()
                quiet_disk(kc)
                # A last block, its write awaited: every earlier change is on the stream by then.
                sentinel = settle(kc, subs, value, sentinel, touched)
                quiet_disk(kc)
                want = disk_keys(blocks_dir)
                deadline = time.monotonic() + 60
                while not all(s.disk == want for s in subs) and time.monotonic() < deadline:
                    time.sleep(0.05)
                # (Probing the megaslab key by key, as the test above does, would fill the
                # keys on disk back into it: its view is checked by count here, and exactly there.)
                st = kc.stats()
                assert st["disk_blocks"] == len(want), (phase, st["disk_blocks"], len(want))
                for name, s in (("fast", fast), ("slow", slow)):
                    with s.changed:
                        disk, index = set(s.disk), set(s.index)
                    assert disk == want, (
                        f"{phase}, {name} subscriber's disk view: {len(want - disk)} file(s) missing "
                        f"(e.g. {sorted(want - disk)[:5]}), {len(disk - want)} reported that are gone "
                        f"(e.g. {sorted(disk - want)[:5]})"
                    )
                    assert len(index) == st["blocks"] and index <= touched, (phase, name, len(index), st["blocks"])
                metrics = urllib.request.urlopen(f"http://127.0.0.1:{http}/metrics", timeout=10).read().decode()
                assert metric(metrics, "kachedb_events_disk_blocks") == len(want)
                text = urllib.request.urlopen(f"http://127.0.0.1:{http}/metrics", timeout=10).read().decode()
                print(
                    f"{phase}: {len(want)} blocks on disk, {st['blocks']} in the megaslab; changes dropped "
                    f"{int(metric(text, 'kachedb_events_dropped_total'))}, resyncs "
                    f"{int(metric(text, 'kachedb_events_resyncs_total'))}; gaps/snapshots "
                    f"fast {fast.gaps}/{fast.snapshots}, slow {slow.gaps}/{slow.snapshots}"
                )
            kc.close()
        finally:
            for s in subs:
                s.close()
        d.stop(check=True)


def test_a_bad_endpoint_is_refused_at_start_with_the_flag_named():
    d = Daemon(size="16MiB", extra=["--events-endpoint", "udp://x"], binary=built_binary())
    with pytest.raises(RuntimeError, match="--events-endpoint udp://x is not a ZMQ endpoint"):
        d.start()


def test_an_endpoint_in_use_is_refused_at_start():
    port = free_port()
    ep = f"tcp://127.0.0.1:{port}"
    with Daemon(size="16MiB", extra=["--events-endpoint", ep], binary=built_binary()):
        second = Daemon(size="16MiB", extra=["--events-endpoint", ep], binary=built_binary())
        with pytest.raises(RuntimeError, match="cannot publish KV events"):
            second.start()


def test_kachedb_events_prints_each_batch_with_its_sequence_and_events():
    pub = free_port()
    ep = f"tcp://127.0.0.1:{pub}"
    with Daemon(size="16MiB", extra=["--events-endpoint", ep], binary=built_binary()) as d:
        watcher = subprocess.Popen(
            [built_binary(), "events", "--endpoint", ep, "--count", "3"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            kc = d.connect()
            # Its SUB socket connects in the background: store until it has seen three batches.
            for key in range(0x1000, 0x1000 + 600):
                kc.put(key, b"x" * 100)
                if watcher.poll() is not None:
                    break
                time.sleep(0.05)
            out, err = watcher.communicate(timeout=30)
        finally:
            if watcher.poll() is None:
                watcher.kill()
        assert watcher.returncode == 0, err
        lines = out.splitlines()
        assert len(lines) == 3, out
        assert all(line.startswith("seq ") for line in lines), out
        assert "BlockStored [0x1" in out and " CPU" in out, out
        kc.close()
