"""Tenants bound to a uid (``kachedb serve --tenant-uid``; docs/tenants.md)
from Python: a real daemon, and client processes that drop to other uids
before they connect. Another uid is refused at ``connect`` when it names the
bound tenant; it may read the tenant's block but ``delete``, ``put`` and a
reservation's ``commit`` of that key raise ``kachedb.Denied`` and change
nothing, and no reservation is left behind (one whose tensor still lives
stays reserved until the tensor goes, then is aborted). Needs root."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import time

import numpy as np
import pytest

import kachedb
from kdb_support import Daemon

GID = 64_100  # the group --allow-gid admits
UID_A = 64_001  # team-a's user
UID_B = 64_002  # another admitted user
MIB = 1 << 20

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run clients as other uids"), pytest.mark.privileged]


def become(uid: int) -> None:
    os.setgroups([])
    os.setgid(GID)
    os.setuid(uid)


def owner(sock: str, out) -> None:
    """Team a's client: stores ``kv`` (bytes 7) and leaves."""
    become(UID_A)
    with kachedb.connect(sock, tenant="team-a") as kc:
        kc.put("kv", np.full(MIB, 7, dtype=np.uint8))
    out.put(("owner", "stored"))


def reserved(kc) -> int:
    return kc.stats()["reserved"]


def other(sock: str, out) -> None:
    """Another uid: tries to act as team-a, then to change its block."""
    become(UID_B)
    r = {}
    try:
        kachedb.connect(sock, tenant="team-a").close()
        r["connect as team-a"] = "admitted"
    except kachedb.KacheDBError as e:
        r["connect as team-a"] = f"{type(e).__name__}: {e}"
    kc = kachedb.connect(sock)
    v = kc.get_numpy("kv")
    r["read"] = (int(v.min()), int(v.max()), v.size)
    del v
    for what, call in [
        ("delete", lambda: kc.delete("kv")),
        ("put", lambda: kc.put("kv", np.full(MIB, 9, dtype=np.uint8))),
        ("put_many", lambda: kc.put_many(["kv"], [np.full(MIB, 9, dtype=np.uint8)])),
    ]:
        try:
            call()
            r[what] = "done"
        except kachedb.Denied as e:
            r[what] = f"Denied: {e}"
    r["reserved after the refused puts"] = reserved(kc)
    # A reservation whose tensor lives past the refused commit stays reserved
    # (its memory is never reused under the tensor) until the tensor goes.
    res = kc.reserve("kv", (MIB,), np.uint8)
    t = res.out
    t[:] = 9
    try:
        res.commit()
        r["commit"] = "done"
    except kachedb.Denied:
        r["commit"] = "Denied"
    r["reserved while its tensor lives"] = reserved(kc)
    del t, res
    gc.collect()
    deadline = time.monotonic() + 10
    while reserved(kc) and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.02)
    r["reserved once it is gone"] = reserved(kc)
    v = kc.get_numpy("kv")
    r["read again"] = (int(v.min()), int(v.max()), v.size)
    del v
    r["denied"] = kc.stats()["denied"]
    kc.close()
    out.put(("other", r))


def test_another_uid_cannot_act_as_a_bound_tenant_nor_change_its_block():
    d = Daemon("64MiB", "--allow-gid", str(GID), "--tenant-uid", f"team-a={UID_A}")
    try:
        os.chmod(d.dir, 0o711)
        os.chown(d.socket, -1, GID)
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        for fn in (owner, other):
            p = ctx.Process(target=fn, args=(d.socket, out))
            p.start()
            tag, result = out.get(timeout=60)
            p.join(60)
            assert p.exitcode == 0, (tag, p.exitcode)
        assert tag == "other"
        assert result["connect as team-a"].startswith("Disconnected: ") and 'tenant "team-a" is bound' in result[
            "connect as team-a"
        ], result
        assert result["read"] == (7, 7, MIB) == result["read again"], result
        for what in ("delete", "put", "put_many"):
            assert result[what].startswith("Denied: ") and "--tenant-uid" in result[what], result
        assert result["commit"] == "Denied", result
        assert result["reserved after the refused puts"] == 0, result
        assert result["reserved while its tensor lives"] == 1, result
        assert result["reserved once it is gone"] == 0, result
        assert result["denied"] == 4, result
        with kachedb.connect(d.socket) as kc:  # the daemon's uid: the default tenant's
            s = kc.stats()
            assert s["reserved"] == 0 and s["invariants_ok"], s
            team_a = {t["name"]: t for t in s["tenants"]}["team-a"]
            assert team_a["blocks"] == 1 and team_a["clients"] == 0, team_a
    finally:
        d.stop()
