"""Tenants (``connect(tenant=...)``, ``kachedb serve --tenant-limit``) against a
real daemon: two client processes of two tenants with limits of 1 GiB and 3 GiB
on a 4 GiB megaslab write without pause; each stays within its limit, neither's
pinned block is touched, and the per-tenant figures add up to the totals
exactly, in ``stats()`` and in ``/metrics`` read by a real HTTP client and a real
Prometheus parser. Nothing here asserts on timings."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time

import numpy as np
import pytest

import kachedb
from kdb_support import Daemon, metric_samples

GIB = 1 << 30
MIB = 1 << 20
BLOCK = 16 * MIB


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def block(seed: int) -> np.ndarray:
    return np.full(BLOCK, seed % 251, dtype=np.uint8)


def writer(sock: str, tenant: str, total_bytes: int, ready, go, out) -> None:
    """Pins a block of its own, then puts chains of 16 MiB blocks (and GETs
    some back) until it has written ``total_bytes``; reports what it saw."""
    kc = kachedb.connect(sock, tenant=tenant)
    kc.put(f"{tenant}-pinned", block(7))
    pinned = kc.get(f"{tenant}-pinned")  # held until the end: pinned
    ready.set()
    go.wait()
    written, refused, i = 0, 0, 0
    while written < total_bytes:
        chain = i // 8
        parent = f"{tenant}-{chain}-{i % 8 - 1}" if i % 8 else None
        try:
            kc.put(f"{tenant}-{chain}-{i % 8}", block(i), parent=parent)
            written += BLOCK
        except kachedb.OutOfMemory:
            refused += 1
        if i % 4 == 3:
            v = kc.get_many([f"{tenant}-{chain}-{i % 8}"])[0]
            assert v is None or int(np.asarray(v)[0]) == i % 251
            del v
            assert kc.get_many([f"{tenant}-never-{i}"]) == [None]  # a miss
        i += 1
    intact = int(np.asarray(pinned).min()) == 7 == int(np.asarray(pinned).max())
    del pinned
    out.put((tenant, written, refused, intact))
    kc.close()


def by_tenant(samples, name, **labels):
    """{tenant: value} of the series ``name`` with ``labels`` besides ``tenant``."""
    out = {}
    for (n, ls), v in samples.items():
        d = dict(ls)
        if n == name and "tenant" in d and all(d.get(k) == x for k, x in labels.items()):
            out[d["tenant"]] = v
    return out


def val(samples, name, **labels):
    return samples[(name, tuple(sorted(labels.items())))]


def test_two_tenants_stay_within_their_limits_and_add_up():
    port = free_port()
    d = Daemon("4GiB", "--tenant-limit", "a=1GiB", "--tenant-limit", "b=3GiB", "--metrics-addr", f"127.0.0.1:{port}")
    try:
        ctx = mp.get_context("spawn")
        go, out = ctx.Event(), ctx.Queue()
        readies = [ctx.Event(), ctx.Event()]
        procs = [
            ctx.Process(target=writer, args=(d.socket, "a", 3 * GIB, readies[0], go, out)),
            ctx.Process(target=writer, args=(d.socket, "b", 6 * GIB, readies[1], go, out)),
        ]
        for p in procs:
            p.start()
        for r in readies:
            assert r.wait(60)
        go.set()
        kc = kachedb.connect(d.socket)  # the default tenant's: reads stats only
        highest = {"a": 0, "b": 0}
        while any(p.is_alive() for p in procs):
            for t in kc.stats()["tenants"]:
                if t["name"] in highest:
                    highest[t["name"]] = max(highest[t["name"]], t["bytes"])
            time.sleep(0.05)
        for p in procs:
            p.join(60)
            assert p.exitcode == 0
        results = {t: (w, r, intact) for t, w, r, intact in (out.get(timeout=5) for _ in procs)}
        # Each wrote past its limit, and its pinned block came through untouched.
        assert results["a"][0] >= 3 * GIB and results["b"][0] >= 6 * GIB, results
        assert results["a"][2] and results["b"][2], results
        assert highest["a"] <= GIB and highest["b"] <= 3 * GIB, highest

        st = kc.stats()
        rows = {t["name"]: t for t in st["tenants"]}
        assert rows["a"]["limit_bytes"] == GIB and rows["b"]["limit_bytes"] == 3 * GIB
        assert rows["a"]["evictions"] > 0 and rows["b"]["evictions"] > 0
        assert rows["a"]["bytes"] <= GIB and rows["b"]["bytes"] <= 3 * GIB
        for field, total in [
            ("bytes", "bytes_used"),
            ("blocks", "blocks"),
            ("evictions", "evictions"),
            ("evicted_bytes", "evicted_bytes"),
            ("get_hits", "get_hits"),
            ("lookup_hits", "lookup_hits"),
            ("reachable_bytes", "reachable_bytes"),
            ("orphaned_bytes", "orphaned_bytes"),
        ]:
            assert sum(t[field] for t in rows.values()) == st[total], field
        assert sum(t["get_misses"] for t in rows.values()) == st["gets"] - st["get_hits"]
        assert st["window_key_requests"] == sum(t["window_key_requests"] for t in rows.values()) > 0

        s = metric_samples(port)
        for name, total in [
            ("kachedb_tenant_bytes", "kachedb_bytes_used"),
            ("kachedb_tenant_blocks", "kachedb_blocks"),
            ("kachedb_tenant_evictions_total", "kachedb_evictions_total"),
            ("kachedb_tenant_evicted_bytes_total", "kachedb_evicted_bytes_total"),
            ("kachedb_tenant_reachable_bytes", "kachedb_reachable_bytes"),
            ("kachedb_tenant_orphaned_bytes", "kachedb_orphaned_bytes"),
            ("kachedb_tenant_window_key_requests", "kachedb_window_key_requests"),
        ]:
            per = by_tenant(s, name)
            assert set(per) >= {"a", "b", "default", "_other"}, (name, per)
            assert sum(per.values()) == val(s, total), name
        for kind in ("hit", "miss"):
            for op in ("get", "lookup"):
                per = by_tenant(s, f"kachedb_tenant_{kind}_blocks_total", op=op)
                assert sum(per.values()) == val(s, f"kachedb_{kind}_blocks_total", op=op), (kind, op)
        limits = by_tenant(s, "kachedb_tenant_limit_bytes")
        assert limits == {"a": GIB, "b": 3 * GIB}
        assert by_tenant(s, "kachedb_tenant_bytes")["a"] <= GIB
        assert by_tenant(s, "kachedb_tenant_clients")["default"] == 1
        kc.close()
    finally:
        d.stop()


def test_a_put_that_cannot_fit_within_the_tenant_limit_is_refused_and_changes_nothing():
    d = Daemon("64MiB", "--tenant-limit", "small=8MiB")
    try:
        kc = kachedb.connect(d.socket, tenant="small")
        kc.put("x", np.zeros(4 * MIB, dtype=np.uint8))
        held = kc.get("x")
        before = kc.stats()
        with pytest.raises(kachedb.OutOfMemory, match="tenant limit of 8388608 bytes"):
            kc.put("too-big", np.zeros(5 * MIB, dtype=np.uint8))
        after = kc.stats()
        assert (after["blocks"], after["evictions"], after["bytes_used"]) == (
            before["blocks"],
            before["evictions"],
            before["bytes_used"],
        )
        assert after["tenant_limit_hits"] == 1
        assert "x" in kc
        del held
        # A client of another tenant (or none) is not bound by it.
        other = kachedb.connect(d.socket)
        other.put("big", np.zeros(16 * MIB, dtype=np.uint8))
        assert {t["name"]: t["blocks"] for t in other.stats()["tenants"]}["default"] == 1
        other.close()
        kc.close()
    finally:
        d.stop()


def test_a_bad_tenant_name_is_refused_with_the_rule():
    d = Daemon("64MiB")
    try:
        with pytest.raises(kachedb.InvalidArgument, match="letters, digits"):
            kachedb.connect(d.socket, tenant="no spaces")
        # A hello that skips the client's check is refused by the daemon, saying why.
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(10)
            s.connect(d.socket)
            s.sendall(b'{"op":"hello","version":1,"pid":%d,"tenant":"_other"}\n' % os.getpid())
            answer = s.recv(4096)
        assert b'"ok":false' in answer and b"letters, digits" in answer, answer
    finally:
        d.stop()
