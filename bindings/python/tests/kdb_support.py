"""Test support: private daemons on temporary sockets, stats polling, and the
functions that child processes run (they must be importable by name, so that
``multiprocessing``'s ``spawn`` context can find them; keep this module light:
torch is imported only inside the functions that need it)."""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, List

import kachedb

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root: harness/
from harness import daemon as _harness  # noqa: E402

_die_with_parent = _harness._die_with_parent


class Daemon(_harness.Daemon):
    """``python -m kachedb serve`` (the installed package; ``$KACHEDB_BIN`` when
    set) on a private temporary socket, started at once; ``stop()`` checks that
    it stopped cleanly unless told otherwise."""

    def __init__(self, size: str = "64MiB", *extra: str) -> None:
        super().__init__(size=size, extra=extra)
        self.dir = self._own_dir
        self.start()

    def stop(self, check: bool = True) -> None:
        super().stop(check=check)


def poll_until(pred: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """Waits until ``pred()`` (running a full gc between polls) or fails."""
    deadline = time.monotonic() + timeout
    if pred():
        return
    while True:
        gc.collect()
        if pred():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


# --- what child processes run ------------------------------------------------------


def pattern(n: int, seed: int) -> bytes:
    """Deterministic bytes both sides can recompute."""
    import hashlib

    out = bytearray()
    i = 0
    while len(out) < n:
        out += hashlib.blake2b(f"{seed}/{i}".encode(), digest_size=64).digest()
        i += 1
    return bytes(out[:n])


def pattern_for(dtype: str, n: int, seed: int) -> bytes:
    """``pattern``, with bool bytes kept 0/1 (torch canonicalises other bool bytes
    when copying, as it may)."""
    b = pattern(n, seed)
    return bytes(x & 1 for x in b) if dtype in ("bool", "torch.bool") else b


def child_get_and_check(socket: str, key: str, expect_dtype: str, expect_shape: tuple, seed: int, nbytes: int) -> str:
    """Spawned child: gets ``key`` as a torch tensor; returns "ok" or what differed."""
    import torch

    with kachedb.connect(socket) as kc:
        t = kc.get(key)
        if str(t.dtype) != expect_dtype:
            return f"dtype {t.dtype} != {expect_dtype}"
        if tuple(t.shape) != tuple(expect_shape):
            return f"shape {tuple(t.shape)} != {expect_shape}"
        got = bytes(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        if got != pattern_for(expect_dtype, nbytes, seed):
            return "bytes differ"
        del t
    return "ok"


def child_put(socket: str, key: str, dtype: str, shape: tuple, seed: int, use_reserve: bool) -> str:
    """Spawned child: puts ``pattern`` bytes as a torch tensor of ``dtype``/``shape``."""
    import torch

    dt = getattr(torch, dtype)
    n = dt.itemsize
    for d in shape:
        n *= d
    import numpy as np

    if n == 0:
        src = torch.empty(shape, dtype=dt)
    else:
        raw = np.frombuffer(pattern_for(dtype, n, seed), np.uint8).copy()
        src = torch.from_numpy(raw).view(dt).reshape(shape)
    with kachedb.connect(socket) as kc:
        if use_reserve:
            with kc.reserve(key, shape, dt) as out:
                out.copy_(src)
        else:
            kc.put(key, src)
    return "ok"


def child_hold_pin(socket: str, key: str, conn: Any, how: str) -> None:
    """Spawned child: pins ``key`` (numpy view, no torch), tells the parent, then
    exits as told: "return" (normal exit), "os_exit" (os._exit), "wait" (until
    killed)."""
    kc = kachedb.connect(socket)
    a = kc.get_numpy(key)
    conn.send(("pinned", int(a.sum())))
    if how == "os_exit":
        os._exit(0)
    if how == "wait":
        conn.recv()  # never answered: the parent SIGKILLs us
    del a


def child_forked_uses_inherited(kc: kachedb.Client, key: str, view: Any, conn: Any) -> None:
    """Forked child: every op on the inherited client must raise Disconnected;
    dropping an inherited view (unread: reading it would fault, see
    ``test_forked_child_reading_an_inherited_view_fails_loudly``) must not touch
    the parent's rings."""
    results = {}
    for name, op in [
        ("get", lambda: kc.get(key)),
        ("put", lambda: kc.put("forked-child", b"x" * 10)),
        ("lookup", lambda: kc.lookup([key])),
        ("stats", lambda: kc.stats()),
        ("native_get", lambda: kc._native.get(key)),
        ("ping", lambda: kc.ping()),
    ]:
        try:
            op()
            results[name] = "no error"
        except kachedb.Disconnected as e:
            results[name] = "Disconnected: " + str(e)
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            results[name] = f"{type(e).__name__}: {e}"
    del view
    gc.collect()
    try:
        with kachedb.connect(kc.socket) as fresh:
            fresh.put("forked-child", b"hello from the child")
            results["fresh"] = bytes(fresh.get_numpy("forked-child").tobytes()).decode()
    except BaseException as e:  # noqa: BLE001
        results["fresh"] = f"{type(e).__name__}: {e}"
    conn.send(json.dumps(results))
    conn.close()


def child_lookup(socket: str, key: str) -> int:
    """Spawned child: ``lookup([key])`` (0 while a reservation is uncommitted)."""
    with kachedb.connect(socket) as kc:
        try:
            kc.get_numpy(key)
            found = 1
        except kachedb.NotFound:
            found = 0
        assert kc.lookup([key]) == found
        return found


def takeover_worker(socket: str, wid: int, stop_path: str, ready_path: str, result_path: str) -> None:
    """Puts and gets verified blocks as fast as it can until ``stop_path``
    exists, then reads every block it wrote once more; writes what it saw
    (errors, operations, the longest single operation) to ``result_path`` as
    JSON. Block ``slot`` of worker ``wid`` holds ``value(wid, n)`` for the
    last ``n`` written there, so every read can be checked."""
    import random

    import torch

    slots, elems = 64, 2048

    def value(n: int) -> Any:
        return torch.arange(elems, dtype=torch.int64) + (wid << 40) + (n << 12)

    def key(slot: int) -> str:
        return f"takeover/w{wid}/{slot}"

    errors: List[str] = []
    written: dict = {}
    ops = 0
    longest = 0.0
    rng = random.Random(wid)
    kc = kachedb.connect(socket)

    def timed(f: Callable[[], Any]) -> Any:
        nonlocal ops, longest
        t0 = time.perf_counter()
        try:
            return f()
        except Exception as e:  # every failure is counted and reported
            if len(errors) < 20:
                errors.append(repr(e))
            else:
                errors.append("…")
            return None
        finally:
            ops += 1
            longest = max(longest, time.perf_counter() - t0)

    def check(slot: int) -> None:
        got = kc.get(key(slot))
        if not torch.equal(got, value(written[slot])):
            raise AssertionError(f"worker {wid} slot {slot}: wrong bytes")

    n = 0
    while not os.path.exists(stop_path):
        n += 1
        slot = n % slots
        timed(lambda: kc.put(key(slot), value(n)))
        written[slot] = n
        timed(lambda: check(rng.choice(list(written))))
        if n == slots:
            open(ready_path, "w").close()
    final_bad = 0
    for slot in written:
        try:
            check(slot)
        except Exception as e:
            final_bad += 1
            errors.append(f"final read: {e!r}")
    kc.close()
    with open(result_path, "w") as f:
        json.dump({"errors": errors, "ops": ops, "longest_s": longest, "final_bad": final_bad, "blocks": len(written)}, f)


def wait_for_in_child(socket: str, key: str, conn: Any) -> None:
    """Waits (in the daemon) for ``key``; sends back its first element or the error."""
    import torch  # noqa: F401

    kc = kachedb.connect(socket)
    conn.send("waiting")
    try:
        t = kc.wait_for(key, timeout=60)
        conn.send(int(t[0]))
    except Exception as e:
        conn.send(repr(e))
    kc.close()


def live_buffers() -> int:
    """Test buffers whose memory is still allocated, after a full collection."""
    gc.collect()
    return kachedb._kachedb_rust._live_test_buffers()


def assert_no_pins(daemon, timeout=10.0):
    """Waits (collecting garbage) until the daemon holds no pins nor reservations."""
    last = {}

    def clean():
        last.update(daemon.stats())
        return last["pins"] == 0 and last["reserved"] == 0

    try:
        poll_until(clean, timeout, "pins and reservations to drop to 0")
    except AssertionError:
        raise AssertionError(f"pins={last.get('pins')} reserved={last.get('reserved')} after the test") from None


def metric_samples(port: int) -> dict:
    """Every sample of the daemon's ``/metrics`` on ``port``, read with a real
    HTTP client and parsed with prometheus_client's parser: ``{(name, sorted
    label pairs): value}``."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=20) as r:
        text = r.read().decode()
    samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples
