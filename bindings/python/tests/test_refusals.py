"""What a refusal, or another tenant, may cost a tenant (issue 41), against a
real daemon through the real Python client:

* a ``put_many`` that cannot fit is refused whole and changes nothing: no
  block of its own tenant, nor of another, is evicted (the client sends the
  batch as reservation units, which the daemon admits whole or not at all);
* another tenant's process pinning every block of a tenant at its limit does
  not make that tenant's puts fail (the pins are charged to the reader).

Nothing here asserts on timings."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest

import kachedb
from kdb_support import Daemon

BLOCK = 64 << 10  # 16 pages: a page-aligned block takes exactly this many bytes


def aligned_blocks(n: int, seed: int) -> list:
    """``n`` blocks of ``BLOCK`` bytes, each starting at a page boundary (so
    each one's extent in the megaslab is exactly ``BLOCK`` bytes), block ``i``
    filled with ``(seed + i) % 251``."""
    buf = np.empty(n * BLOCK + 4096, dtype=np.uint8)
    start = (-buf.ctypes.data) % 4096
    out = []
    for i in range(n):
        b = buf[start + i * BLOCK : start + (i + 1) * BLOCK]
        b[:] = (seed + i) % 251
        out.append(b)
    return out


def tenant_row(st: dict, name: str) -> dict:
    return next((t for t in st["tenants"] if t["name"] == name), {"blocks": 0})


def assert_intact(kc, keys, seed: int) -> None:
    for i, k in enumerate(keys):
        assert k in kc, f"block {i} of {len(keys)} is gone"
        a = np.asarray(kc.get_numpy(k))
        assert a.size == BLOCK and int(a.min()) == int(a.max()) == (seed + i) % 251, f"block {i} changed"
        del a


def test_a_batch_past_the_tenant_limit_costs_the_tenant_nothing():
    """A tenant at its limit of 16 blocks puts a batch of 17: refused whole;
    its 16 blocks stay (each RESERVE used to evict one of them first)."""
    d = Daemon("16MiB", "--tenant-limit", "a=1MiB")
    try:
        kc = kachedb.connect(d.socket, tenant="a")
        held = [f"held-{i}" for i in range(16)]
        kc.put_many(held, aligned_blocks(16, 1))
        with pytest.raises(kachedb.OutOfMemory, match="tenant limit of 1048576 bytes"):
            kc.put_many([f"more-{i}" for i in range(17)], aligned_blocks(17, 100))
        st = kc.stats()
        assert (tenant_row(st, "a")["blocks"], st["evictions"], st["reserved"]) == (16, 0, 0), st
        assert st["bytes_used"] == 16 * BLOCK
        assert_intact(kc, held, 1)
        # A batch that fits is admitted, evicting the tenant's own blocks.
        kc.put_many([f"fits-{i}" for i in range(16)], aligned_blocks(16, 50))
        st = kc.stats()
        assert (tenant_row(st, "a")["blocks"], st["evictions"]) == (16, 16), st
        kc.close()
    finally:
        d.stop()


def test_a_batch_larger_than_the_megaslab_costs_another_tenant_nothing():
    """No limits: tenant ``b`` fills the megaslab; a batch of tenant ``c``
    one block larger than it is refused whole and every one of ``b``'s
    blocks stays (they used to be evicted, leaving the store empty)."""
    d = Daemon("8MiB")
    try:
        b = kachedb.connect(d.socket, tenant="b")
        c = kachedb.connect(d.socket, tenant="c")
        n = b.stats()["bytes_total"] // BLOCK
        held = [f"b-{i}" for i in range(n)]
        b.put_many(held, aligned_blocks(n, 3), chain=True)
        with pytest.raises(kachedb.OutOfMemory):
            c.put_many([f"c-{i}" for i in range(n + 1)], aligned_blocks(n + 1, 7))
        st = b.stats()
        assert st["invariants_ok"], st
        assert (st["blocks"], st["evictions"], st["reserved"]) == (n, 0, 0), st
        assert (tenant_row(st, "b")["blocks"], tenant_row(st, "c")["blocks"]) == (n, 0), st
        assert_intact(b, held, 3)
        b.close()
        c.close()
    finally:
        d.stop()


def pin_all(sock: str, keys: list, pinned, done) -> None:
    """Child process of tenant ``x``: pins every key, says so, holds the pins
    until told it is done."""
    kc = kachedb.connect(sock, tenant="x")
    views = [kc.get_numpy(k) for k in keys]
    pinned.put(sum(v is not None for v in views))
    done.wait(120)
    del views
    kc.close()


def test_pins_of_another_tenant_cannot_refuse_a_tenant():
    """Tenant ``v`` at its limit of 16 blocks; another process, of tenant
    ``x``, pins all of them. ``v`` stores on: the pins are charged to ``x``."""
    d = Daemon("16MiB", "--tenant-limit", "v=1MiB", "--tenant-limit", "x=2MiB")
    try:
        kc = kachedb.connect(d.socket, tenant="v")
        held = [f"v-{i}" for i in range(16)]
        kc.put_many(held, aligned_blocks(16, 9), chain=True)
        ctx = mp.get_context("spawn")
        pinned, done = ctx.Queue(), ctx.Event()
        p = ctx.Process(target=pin_all, args=(d.socket, held, pinned, done))
        p.start()
        try:
            assert pinned.get(timeout=60) == 16
            for i in range(32):
                kc.put(f"v-new-{i}", aligned_blocks(1, i)[0])
            st = kc.stats()
            assert st["invariants_ok"], st
            assert tenant_row(st, "v")["evictions"] >= 16, st
            assert_intact(kc, held, 9)
        finally:
            done.set()
            p.join(60)
        assert p.exitcode == 0
        kc.close()
    finally:
        d.stop()
