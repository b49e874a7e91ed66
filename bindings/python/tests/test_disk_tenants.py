"""Tenants on the disk tier (``kachedb serve --disk … --tenant-disk-limit``,
docs/disk.md "Tenants") against real daemons and real block files: two
client processes of two tenants with disk limits write without pause past
them; each tenant's disk bytes stay within its limit, a third tenant's blocks
on disk are untouched, and the per-tenant disk figures add up to the disk
totals exactly, in ``stats()`` and in ``/metrics`` read by a real Prometheus
parser. After ``kill -9`` a daemon on the same directory counts every tenant's
disk bytes and blocks as before, and a block filled from disk counts for its
tenant in the megaslab. Nothing here asserts on timings."""

from __future__ import annotations

import multiprocessing as mp
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np

import kachedb
from kdb_support import Daemon, poll_until, metric_samples

KIB = 1 << 10
MIB = 1 << 20
BLOCK = 256 * KIB
# What a block of BLOCK bytes takes on disk: a 4 KiB header area, then its bytes.
ON_DISK = BLOCK + 4 * KIB
LIMITS = {"a": 2 * MIB, "b": 4 * MIB, "k": 8 * MIB}
KEPT = 8  # blocks of tenant k, written before a and b start


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def writer(sock: str, tenant: str, blocks: int, ready, go, out) -> None:
    """Puts ``blocks`` blocks of BLOCK bytes in chains of 8 without pause."""
    kc = kachedb.connect(sock, tenant=tenant)
    ready.set()
    go.wait()
    for i in range(blocks):
        chain = i // 8
        parent = f"{tenant}-{chain}-{i % 8 - 1}" if i % 8 else None
        kc.put(f"{tenant}-{chain}-{i % 8}", np.full(BLOCK, i % 251, dtype=np.uint8), parent=parent)
    out.put(tenant)
    kc.close()


def by_tenant(samples, name):
    return {dict(ls)["tenant"]: v for (n, ls), v in samples.items() if n == name and "tenant" in dict(ls)}


def serve(disk: str, port: int) -> Daemon:
    args = ["--disk", disk, "--disk-size", "32MiB", "--disk-queue-bytes", "64MiB"]
    for name, limit in LIMITS.items():
        args += ["--tenant-disk-limit", f"{name}={limit}"]
    # c: a megaslab limit only; its disk limit is the same share of the disk
    # (16 MiB of 128 MiB -> 4 MiB of 32 MiB).
    args += ["--tenant-limit", "c=16MiB", "--metrics-addr", f"127.0.0.1:{port}"]
    return Daemon("128MiB", *args)


def drained(d: Daemon) -> bool:
    st = d.stats()
    return st["disk_indexed"] and st["disk_queue_blocks"] == 0


def disk_rows(st) -> dict:
    return {t["name"]: t for t in st["tenants"]}


def check_adds_up(st, port: int) -> None:
    rows = disk_rows(st)
    assert sum(t["disk_bytes"] for t in rows.values()) == st["disk_bytes"] > 0
    assert sum(t["disk_blocks"] for t in rows.values()) == st["disk_blocks"] > 0
    s = metric_samples(port)
    for name, total in [("kachedb_tenant_disk_bytes", "kachedb_disk_bytes"),
                        ("kachedb_tenant_disk_blocks", "kachedb_disk_blocks")]:
        per = by_tenant(s, name)
        assert set(per) >= {"a", "b", "k", "default", "_other"}, (name, per)
        assert sum(per.values()) == s[(total, ())], name
    assert by_tenant(s, "kachedb_tenant_disk_limit_bytes") == {**LIMITS, "c": 4 * MIB}


def watch_frame(sock: str) -> str:
    """One whole frame of ``kachedb stats --watch`` (the real CLI, its output
    not a terminal: frames appended, each ending with ``Ctrl-C to quit``)."""
    proc = subprocess.Popen([sys.executable, "-m", "kachedb", "stats", "--socket", sock, "--watch", "0.2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watchdog = threading.Timer(60, proc.kill)
    watchdog.start()
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("Ctrl-C to quit"):
                break
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        watchdog.cancel()
    assert proc.returncode == 0, err
    assert lines and lines[-1].startswith("Ctrl-C"), "".join(lines)
    return "".join(lines)


def test_two_tenants_stay_within_their_disk_limits_add_up_and_survive_kill_9(tmp_path):
    disk = str(tmp_path / "disk")
    port = free_port()
    d = serve(disk, port)
    try:
        with kachedb.connect(d.socket, tenant="k") as kc:
            for i in range(KEPT):
                kc.put(f"k-{i}", np.full(BLOCK, 100 + i, dtype=np.uint8))
        poll_until(lambda: drained(d) and d.stats()["disk_writes"] == KEPT, 60, "k's writes")

        ctx = mp.get_context("spawn")
        go, out = ctx.Event(), ctx.Queue()
        readies = [ctx.Event(), ctx.Event()]
        # Each writes 10 MiB: five times a's disk limit, two and a half times b's.
        procs = [ctx.Process(target=writer, args=(d.socket, t, 40, r, go, out)) for t, r in zip("ab", readies)]
        for p in procs:
            p.start()
        for r in readies:
            assert r.wait(60)
        go.set()
        kc = kachedb.connect(d.socket)
        highest = {"a": 0, "b": 0}
        while any(p.is_alive() for p in procs) or not drained(d):
            rows = disk_rows(kc.stats())
            for t in highest:
                highest[t] = max(highest[t], rows.get(t, {}).get("disk_bytes", 0))
            time.sleep(0.02)
        for p in procs:
            p.join(60)
            assert p.exitcode == 0
        assert highest["a"] <= LIMITS["a"] and highest["b"] <= LIMITS["b"], highest

        st = kc.stats()
        rows = disk_rows(st)
        for t in "ab":
            assert rows[t]["disk_limit_bytes"] == LIMITS[t]
            assert 0 < rows[t]["disk_bytes"] <= LIMITS[t], rows[t]
            # The limit acted: by evicting the tenant's leaves, or, where the
            # blocks that could make room were in the same group commit (not
            # on disk yet) or were the new block's parents, by refusing it.
            assert rows[t]["disk_evictions"] + rows[t]["disk_limit_refusals"] > 0, rows[t]
        # One write at a time, each its own group commit: a at its limit
        # evicts its own least recently used leaves (roots here, no chains).
        with kachedb.connect(d.socket, tenant="a") as ka:
            evicted, writes = rows["a"]["disk_evictions"], d.stats()["disk_writes"]
            for i in range(LIMITS["a"] // ON_DISK + 1):
                ka.put(f"a-alone-{i}", np.full(BLOCK, i, dtype=np.uint8))
                writes += 1
                poll_until(lambda: drained(d) and d.stats()["disk_writes"] == writes, 60, f"a-alone-{i}")
        rows = disk_rows(kc.stats())
        assert rows["a"]["disk_evictions"] > evicted, rows["a"]
        assert 0 < rows["a"]["disk_bytes"] <= LIMITS["a"], rows["a"]
        # Nothing of k's was evicted by a or b: all its blocks are on disk.
        assert (rows["k"]["disk_blocks"], rows["k"]["disk_bytes"], rows["k"]["disk_evictions"]) == (
            KEPT, KEPT * ON_DISK, 0)
        assert rows["c"]["disk_limit_bytes"] == 4 * MIB
        check_adds_up(st, port)
        before = {t: (r["disk_bytes"], r["disk_blocks"]) for t, r in rows.items() if r["disk_blocks"]}
        kc.close()
    except BaseException:
        d.stop()
        raise
    d.kill()  # kill -9
    d.stop(check=False)

    port = free_port()
    d = serve(disk, port)
    try:
        poll_until(lambda: drained(d), 60, "the disk index")
        st = d.stats()
        rows = disk_rows(st)
        after = {t: (r["disk_bytes"], r["disk_blocks"]) for t, r in rows.items() if r["disk_blocks"]}
        assert after == before
        check_adds_up(st, port)
        # `kachedb stats --watch` has a row per tenant on disk: k's 8 blocks
        # within its limit, a's and b's limits.
        frame = watch_frame(d.socket)
        table = frame[frame.index("tenant on disk"):].splitlines()
        row = {line.split()[0]: line for line in table[1:] if line.strip()}
        mib = lambda n: f"{n / MIB:.1f} MiB"  # noqa: E731
        assert f"{mib(KEPT * ON_DISK)} / {mib(LIMITS['k'])}" in row["k"] and f" {KEPT} " in row["k"], frame
        for t in "ab":
            assert f" / {mib(LIMITS[t])}" in row[t], frame
        # A block filled from disk counts for its tenant in the megaslab, not for `default`.
        with kachedb.connect(d.socket) as kc:
            got = kc.get_numpy("k-3")
            assert got.tobytes() == bytes([103]) * BLOCK
            del got
            rows = disk_rows(kc.stats())
        assert rows["k"]["blocks"] == 1 and rows["k"]["bytes"] >= BLOCK, rows["k"]
        assert rows["default"]["blocks"] == 0, rows["default"]
    finally:
        d.stop()
