"""Processes and threads against a real daemon: spawn children read what the
parent wrote and the other way round; a forked child cannot use (nor corrupt)
an inherited client; a child's pins die with it however it dies; one client is
shared by several threads."""

from __future__ import annotations

import faulthandler
import gc
import json
import multiprocessing as mp
import os
import random
import signal
import threading
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest
import torch

import kachedb
import kdb_support
from kdb_support import pattern_for, poll_until

DAEMON_SIZE = "64MiB"

SPAWN = mp.get_context("spawn")

#: Spawned children import torch: slow on a loaded machine.
pytestmark = pytest.mark.timeout(300, method="thread")


@pytest.fixture(scope="module")
def pool():
    """One spawned worker process for the module (torch is imported once)."""
    with ProcessPoolExecutor(max_workers=1, mp_context=SPAWN) as ex:
        yield ex


def tensor_of(dtype: torch.dtype, shape: tuple, seed: int) -> torch.Tensor:
    n = dtype.itemsize
    for d in shape:
        n *= d
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(np.frombuffer(pattern_for(str(dtype), n, seed), np.uint8).copy()).view(dtype).reshape(shape)


CASES = [
    (torch.bfloat16, (2, 16, 8, 64)),
    (torch.float8_e4m3fn, (3, 5, 7)),
    (torch.float32, (1000,)),
    (torch.int64, (4, 0, 3)),
    (torch.bool, ()),
    (torch.float16, (2, 2, 2, 2, 2, 2)),
]


@pytest.mark.parametrize("use_reserve", [False, True], ids=["put", "reserve"])
def test_spawn_child_gets_what_the_parent_put(kc, pool, use_reserve):
    for i, (dtype, shape) in enumerate(CASES):
        src = tensor_of(dtype, shape, seed=i)
        key = f"p2c/{use_reserve}/{i}"
        if use_reserve:
            with kc.reserve(key, shape, dtype) as out:
                out.copy_(src)
        else:
            kc.put(key, src)
        nbytes = src.numel() * src.element_size()
        got = pool.submit(kdb_support.child_get_and_check, kc.socket, key, str(dtype), shape, i, nbytes).result(180)
        assert got == "ok", (dtype, shape, got)


@pytest.mark.parametrize("use_reserve", [False, True], ids=["put", "reserve"])
def test_parent_gets_what_a_spawn_child_put(kc, pool, use_reserve):
    for i, (dtype, shape) in enumerate(CASES):
        key = f"c2p/{use_reserve}/{i}"
        name = str(dtype).split(".")[1]
        assert pool.submit(kdb_support.child_put, kc.socket, key, name, shape, 100 + i, use_reserve).result(180) == "ok"
        got = kc.get(key)
        want = tensor_of(dtype, shape, 100 + i)
        assert got.dtype == dtype and tuple(got.shape) == shape
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))


def test_a_reservation_is_visible_to_other_processes_only_once_committed(kc, pool):
    r = kc.reserve("cross/reserve", (64, 64), torch.float16)
    r.out.fill_(2.0)
    assert pool.submit(kdb_support.child_lookup, kc.socket, "cross/reserve").result(180) == 0
    r.commit()
    assert pool.submit(kdb_support.child_lookup, kc.socket, "cross/reserve").result(180) == 1
    seed = 5
    src = tensor_of(torch.float16, (64, 64), seed)
    with kc.reserve("cross/reserve", (64, 64), torch.float16) as out:
        out.copy_(src)
    got = pool.submit(kdb_support.child_get_and_check, kc.socket, "cross/reserve", "torch.float16", (64, 64), seed, src.numel() * 2).result(180)
    assert got == "ok"


def test_forked_child_gets_disconnected_and_parent_keeps_working(kc):
    fork = mp.get_context("fork")
    src = np.arange(4096, dtype=np.int64)
    kc.put("fork/key", src)
    view = kc.get_numpy("fork/key")
    tview = kc.get("fork/key")
    assert kc.stats()["pins"] == 2
    parent_end, child_end = fork.Pipe()
    p = fork.Process(target=kdb_support.child_forked_uses_inherited, args=(kc, "fork/key", view, child_end))
    p.start()
    assert parent_end.poll(180), "the forked child did not answer"
    results = json.loads(parent_end.recv())
    p.join(30)
    assert p.exitcode == 0
    for op in ("get", "put", "lookup", "stats", "native_get", "ping"):
        assert results[op].startswith("Disconnected: ") and "fork" in results[op], (op, results[op])
    assert results["fresh"] == "hello from the child"  # and a new connection works there
    # The child's dropping the inherited views released nothing of the parent's.
    assert kc.stats()["pins"] == 2
    assert np.array_equal(view, src) and tview.sum().item() == int(src.sum())
    # The parent's client (rings, request ids, socket) is intact.
    for i in range(200):
        kc.put(f"fork/after/{i % 7}", torch.full((100,), i))
        assert kc.get(f"fork/after/{i % 7}")[0].item() == i
    assert kc.lookup(["fork/key", "fork/after/0"]) == 2
    assert kc.get_numpy("forked-child").tobytes() == b"hello from the child"
    del view, tview
    gc.collect()
    assert kc.stats()["pins"] == 0


def test_forked_child_via_os_fork_gets_disconnected(kc):
    kc.put("osfork", torch.ones(3))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 1
        try:
            kc.get("osfork")
        except kachedb.Disconnected:
            code = 0
        except BaseException:
            code = 2
        os.write(w, bytes([code]))
        os._exit(0)
    os.close(w)
    got = os.read(r, 1)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert got == b"\x00", f"child code {got!r}"
    assert kc.get("osfork").tolist() == [1.0, 1.0, 1.0]


def _fork_and_wait(child) -> int:
    """Runs ``child()`` in an ``os.fork()`` child (exit 0 if it returns, 3 if
    it raises); the child's wait status."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 3
        faulthandler.disable()  # an expected SIGSEGV: no traceback on the test's stderr
        try:
            child()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return status


def test_forked_child_reading_an_inherited_view_fails_loudly(kc):
    """A forked child holds none of the parent's pins, so an inherited view
    could change under it: reading one (a view, a tensor derived from it, a
    numpy view) kills the child with SIGSEGV instead of reading what may be
    another block by then. The parent's views are untouched."""
    src = torch.arange(4096, dtype=torch.int32)
    kc.put("fork/loud", src)
    view = kc.get("fork/loud")
    derived = view[10:20]
    arr = kc.get_numpy("fork/loud")
    for name, t in [("view", view), ("derived", derived), ("numpy", arr)]:
        status = _fork_and_wait(lambda: int(t.sum()))
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGSEGV, (
            f"a forked child read an inherited {name}: wait status {status:#x}"
        )
    # A child that does not touch them runs on, and can connect again.
    def fresh_child():
        with kachedb.connect(kc.socket) as fresh:
            assert fresh.get("fork/loud").sum().item() == int(src.sum())

    status = _fork_and_wait(fresh_child)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"wait status {status:#x}"
    assert torch.equal(view, src) and int(derived.sum()) == int(src[10:20].sum()) and arr.sum() == int(src.sum())
    assert kc.stats()["pins"] == 2
    del view, derived, arr, t
    gc.collect()
    assert kc.stats()["pins"] == 0


def test_forked_child_dropping_views_of_a_collected_client_releases_nothing(daemon):
    """Views whose ``Client`` object is gone (so the Python at-fork handler
    does not know their connection): a forked child that drops them sends
    nothing on the parent's rings; the parent's pin stays."""
    c = daemon.connect()
    c.put("fork/orphan", torch.ones(8))
    view = c.get("fork/orphan")
    del c
    gc.collect()
    assert daemon.stats()["pins"] == 1

    def drop_it():
        nonlocal view
        view = None
        gc.collect()

    status = _fork_and_wait(drop_it)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"wait status {status:#x}"
    assert daemon.stats()["pins"] == 1, "the child released the parent's pin"
    assert view.sum().item() == 8
    view = None
    gc.collect()
    poll_until(lambda: daemon.stats()["pins"] == 0, 10, "the parent's release")


@pytest.mark.parametrize("how", ["return", "os_exit", "sigkill"])
def test_a_childs_pins_die_with_it(kc, how):
    kc.put("held-by-child", np.arange(10, dtype=np.int32))
    base = kc.stats()
    parent_end, child_end = SPAWN.Pipe()
    p = SPAWN.Process(target=kdb_support.child_hold_pin, args=(kc.socket, "held-by-child", child_end, "wait" if how == "sigkill" else how))
    p.start()
    try:
        assert parent_end.poll(180), "the child did not pin the block"
        assert parent_end.recv() == ("pinned", 45)
        if how == "sigkill":
            s = kc.stats()
            assert s["pins"] == base["pins"] + 1
            assert s["clients_connected"] == base["clients_connected"] + 1
            os.kill(p.pid, signal.SIGKILL)
        p.join(60)
    finally:
        if p.is_alive():
            p.kill()
            p.join()
    assert p.exitcode == (-signal.SIGKILL if how == "sigkill" else 0)
    poll_until(lambda: kc.stats()["pins"] == base["pins"], 15, "the child's pin to be released")
    poll_until(lambda: kc.stats()["clients_connected"] == base["clients_connected"], 15, "the child's channel to close")
    assert kc.stats()["invariants_ok"] is True


def test_one_client_from_four_threads(kc):
    n_threads, iters = 4, 150
    shared = torch.arange(4096, dtype=torch.int32)
    kc.put("threads/shared", shared)
    barrier = threading.Barrier(n_threads)
    errors = []
    counts = [0] * n_threads

    def work(t: int) -> None:
        rng = random.Random(t)
        try:
            barrier.wait()
            mine = {}
            for j in range(iters):
                op = rng.randrange(7)
                k = f"threads/{t}/{rng.randrange(8)}"
                if op == 0:
                    v = torch.full((rng.randrange(1, 3000),), t * 100000 + j, dtype=torch.int64)
                    kc.put(k, v)
                    mine[k] = v
                elif op == 1:
                    with kc.reserve(k, (16, 16), torch.float32) as out:
                        out.fill_(float(j))
                    mine[k] = torch.full((16, 16), float(j))
                elif op == 2 and mine:
                    k = rng.choice(sorted(mine))
                    assert torch.equal(kc.get(k), mine[k])
                elif op == 3:
                    keys = sorted(mine) + ["threads/shared", f"threads/{t}/missing"]
                    got = kc.get_many(keys)
                    assert got[-1] is None and torch.equal(got[-2], shared)
                    for kk, g in zip(keys, got):
                        if kk in mine:
                            assert torch.equal(g, mine[kk])
                elif op == 4:
                    assert kc.delete(k) == (k in mine)
                    mine.pop(k, None)
                elif op == 5:
                    present = sorted(mine)
                    assert kc.lookup(present + [f"threads/{t}/missing"]) == len(present)
                else:
                    a = kc.get_numpy("threads/shared")
                    assert int(a[-1]) == 4095
                counts[t] += 1
        except BaseException as e:  # noqa: BLE001
            errors.append((t, repr(e)))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(90)
    assert not any(th.is_alive() for th in threads), "a thread hung"
    assert errors == []
    assert counts == [iters] * n_threads
    s = kc.stats()
    assert s["invariants_ok"] is True and s["rejected_frames"] == 0 and s["bad_handle"] == 0


def test_the_gil_is_released_while_waiting_on_the_daemon(make_daemon):
    """With the daemon frozen (SIGSTOP), a get blocks in the ring wait; other
    Python threads must keep running meanwhile, and the get completes once the
    daemon resumes."""
    import subprocess
    import sys
    import time

    d = make_daemon("8MiB")
    kc = d.connect()
    kc.put("gil", torch.arange(4))
    # Safety net: resume the daemon in 10 s even if this thread never runs again.
    os.kill(d.proc.pid, signal.SIGSTOP)
    resumer = subprocess.Popen([sys.executable, "-c", f"import os, signal, time; time.sleep(10); os.kill({d.proc.pid}, signal.SIGCONT)"])
    try:
        result = {}
        t = threading.Thread(target=lambda: result.setdefault("v", kc.get("gil").tolist()))
        t.start()
        time.sleep(0.05)  # let the get reach its wait
        n, end = 0, time.monotonic() + 0.3
        while time.monotonic() < end:
            n += 1
        assert t.is_alive(), "the get did not wait for the frozen daemon"
        assert n > 10_000, f"this thread ran only {n} loops while the other waited: the GIL was held"
        os.kill(d.proc.pid, signal.SIGCONT)
        t.join(30)
        assert not t.is_alive()
        assert result["v"] == [0, 1, 2, 3]
    finally:
        os.kill(d.proc.pid, signal.SIGCONT)
        resumer.kill()
        resumer.wait()
    kc.close()
