"""Hot takeover (`kachedb serve --takeover`, docs/takeover.md) with real daemon
processes and real client processes: the cache, pins, reservations, parked
WAITs and connections survive; every failure leaves one working daemon or a
clean error."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

import kachedb
from kdb_support import Daemon, _die_with_parent, poll_until, takeover_worker, wait_for_in_child

TAKEOVERS = 20


def start_takeover(d: Daemon, n: int, *extra: str) -> tuple:
    """Starts `serve --takeover` on `d`'s socket; (process, log path)."""
    log_path = os.path.join(d.dir, f"takeover-{n}.log")
    with open(log_path, "wb") as log:
        p = subprocess.Popen(
            [sys.executable, "-m", "kachedb", "serve", "--socket", d.socket, "--takeover", *extra],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
    return p, log_path


def sockets_on(path: str) -> int:
    """How many Unix sockets carry ``path`` (/proc/net/unix): the listener, the
    connections it accepted and those waiting in its queue."""
    with open("/proc/net/unix") as f:
        return sum(1 for line in f if line.rstrip().endswith(" " + path))


def read(path: str) -> str:
    with open(path, "rb") as f:
        return f.read().decode(errors="replace")


def take_over(d: Daemon, n: int, *extra: str) -> None:
    """A new daemon takes over from `d`'s; `d` then stands for the new one.
    The old process must exit 0 and the new one must say it took over."""
    old = d.proc
    new, log_path = start_takeover(d, n, *extra)
    try:
        assert old.wait(30) == 0, f"the old daemon exited with {old.returncode}:\n{d.log()}"
        poll_until(lambda: "took over" in read(log_path) or new.poll() is not None, 30, "the takeover")
    except BaseException:
        new.kill()
        raise
    assert new.poll() is None, f"the new daemon exited with {new.returncode}:\n{read(log_path)}"
    assert "handed over" in d.log(), d.log()
    d.proc, d.log_path = new, log_path


def test_twenty_takeovers_under_four_busy_client_processes(tmp_path):
    d = Daemon("64MiB")
    workers = []
    try:
        kc = d.connect()
        kc.put("pinned", torch.arange(4096, dtype=torch.int32))
        view = kc.get("pinned")
        reservation = kc.reserve("reserved-before", (1024,), torch.float32)
        ctx = mp.get_context("spawn")
        stop = str(tmp_path / "stop")
        for w in range(4):
            ready, result = str(tmp_path / f"ready{w}"), str(tmp_path / f"result{w}.json")
            p = ctx.Process(target=takeover_worker, args=(d.socket, w, stop, ready, result))
            p.start()
            workers.append((p, ready, result))
        poll_until(lambda: all(os.path.exists(r) for _, r, _ in workers), 60, "the workers to start")
        before = d.stats()
        pids = {before["daemon_pid"]}
        for n in range(TAKEOVERS):
            take_over(d, n)
            s = kc.stats()
            pids.add(s["daemon_pid"])
            assert s["invariants_ok"], s
            assert s["clients_connected"] == before["clients_connected"], (n, s)
            # Every worker keeps going between takeovers.
            time.sleep(0.05)
        open(stop, "w").close()
        results = []
        for p, _, result in workers:
            p.join(60)
            assert p.exitcode == 0
            with open(result) as f:
                results.append(json.load(f))
        assert len(pids) == TAKEOVERS + 1
        assert [r["errors"] for r in results] == [[]] * 4
        assert all(r["final_bad"] == 0 and r["blocks"] == 64 for r in results), results
        longest_ms = max(r["longest_s"] for r in results) * 1e3
        ops = sum(r["ops"] for r in results)
        print(f"\n{TAKEOVERS} takeovers under 4 clients: {ops} verified operations, 0 errors, longest client operation {longest_ms:.1f} ms")
        # The pin and the reservation made before the first takeover.
        assert torch.equal(view, torch.arange(4096, dtype=torch.int32))
        reservation.out.copy_(torch.full((1024,), 2.5))
        reservation.commit()
        reservation = None
        assert torch.equal(kc.get("reserved-before"), torch.full((1024,), 2.5))
        del view
        poll_until(lambda: kc.stats()["pins"] == 0, 10, "the pins to go")
        s = kc.stats()
        assert s["reserved"] == 0 and s["evictions"] == 0 and s["invariants_ok"], s
        kc.close()
    finally:
        for p, _, _ in workers:
            if p.is_alive():
                p.kill()
        d.stop()


def test_a_wait_parked_in_the_old_daemon_is_answered_by_the_new_one():
    d = Daemon("32MiB")
    try:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        p = ctx.Process(target=wait_for_in_child, args=(d.socket, "later", child))
        p.start()
        assert parent.recv() == "waiting"
        time.sleep(0.5)  # lets the WAIT reach the old daemon and park there
        take_over(d, 0)
        with d.connect() as kc:
            kc.put("later", torch.full((8,), 41, dtype=torch.int64))
        assert parent.poll(30)
        assert parent.recv() == 41
        p.join(10)
    finally:
        d.stop()


def raw_takeover_request(sock_path: str, versions: list) -> tuple:
    """Sends a takeover request as a new daemon would, and the go the daemon
    asks for; (socket, the offer or the refusal line, fds)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(sock_path)
    s.settimeout(30)
    s.sendall(json.dumps({"op": "takeover", "state_versions": versions}).encode() + b"\n")
    data, fds = b"", []

    def line() -> bytes:
        nonlocal data, fds
        while b"\n" not in data:
            chunk, got, _, _ = socket.recv_fds(s, 65536, 16)
            if not chunk:
                break
            data += chunk
            fds += got
        first, _, data = data.partition(b"\n")
        return first

    first = line()
    if b'"pause_ms"' in first:
        s.sendall(json.dumps({"op": "takeover_go"}).encode() + b"\n")
        first = line()
    return s, first, fds


def check_serving_as_before(d: Daemon, pid: int) -> None:
    with d.connect() as kc:
        assert torch.equal(kc.get("kept"), torch.arange(100))
        kc.put("more", torch.ones(3))
        s = kc.stats()
        assert s["daemon_pid"] == pid and s["invariants_ok"], s


def test_a_state_format_the_new_daemon_does_not_read_is_refused_and_the_old_one_serves_on():
    d = Daemon("32MiB")
    try:
        with d.connect() as kc:
            kc.put("kept", torch.arange(100))
            pid = kc.stats()["daemon_pid"]
        s, line, fds = raw_takeover_request(d.socket, [999])
        reply = json.loads(line)
        assert reply["ok"] is False and "state format" in reply["error"], reply
        assert fds == []
        s.close()
        check_serving_as_before(d, pid)
    finally:
        d.stop()


@pytest.mark.parametrize("how", ["dies", "refuses"])
def test_a_new_daemon_that_dies_or_refuses_mid_handover_leaves_the_old_one_serving(how):
    d = Daemon("32MiB")
    try:
        kc = d.connect()
        kc.put("kept", torch.arange(100))
        view = kc.get("kept")
        pid = kc.stats()["daemon_pid"]
        # Every version a build might write: the daemon picks its own.
        s, line, fds = raw_takeover_request(d.socket, list(range(1, 1000)))
        offer = json.loads(line)
        assert offer["ok"] is True and offer["daemon_pid"] == pid and offer["connections"] >= 1, offer
        assert len(fds) >= 3  # region, listener, lock (the rest may follow)
        for fd in fds:
            os.close(fd)
        if how == "refuses":
            s.sendall(json.dumps({"op": "refuse", "error": "test"}).encode() + b"\n")
        s.close()
        # The client connected before never noticed.
        assert torch.equal(kc.get("kept"), view)
        check_serving_as_before(d, pid)
        del view
        poll_until(lambda: kc.stats()["pins"] == 0, 10, "the pin to go")
        kc.close()
    finally:
        d.stop()


def test_an_old_daemon_killed_mid_handover_gives_the_new_one_a_clean_error(tmp_path):
    d = Daemon("32MiB")
    new = None
    try:
        os.kill(d.proc.pid, signal.SIGSTOP)
        before = sockets_on(d.socket)
        new, log_path = start_takeover(d, 0)
        # Its connection waits in the stopped daemon's queue (one socket more on the
        # path); its request follows at once, then it waits for the answer.
        poll_until(lambda: sockets_on(d.socket) > before or new.poll() is not None, 60, "the new daemon to connect")
        time.sleep(0.2)
        assert new.poll() is None, read(log_path)  # waiting for the stopped daemon's answer
        d.proc.kill()
        d.proc.wait(10)
        assert new.wait(30) != 0
        assert "died during the takeover" in read(log_path), read(log_path)
        # Nobody serves: a fresh daemon can start on the same socket.
        for leftover in (d.socket, d.socket + ".lock"):
            if os.path.exists(leftover):
                os.unlink(leftover)
        d2 = Daemon.__new__(Daemon)
        d2.dir, d2.socket, d2.size = d.dir, d.socket, "32MiB"
        fresh = subprocess.Popen(
            [sys.executable, "-m", "kachedb", "serve", "--socket", d.socket, "--size", "32MiB"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        try:
            poll_until(lambda: os.path.exists(d.socket), 30, "a fresh daemon")
            with kachedb.connect(d.socket) as kc:
                kc.put("x", torch.ones(2))
        finally:
            fresh.terminate()
            assert fresh.wait(15) == 0
    finally:
        if new is not None and new.poll() is None:
            new.kill()
        d.stop(check=False)


def test_takeover_without_a_running_daemon_is_a_clean_error(tmp_path):
    os.chmod(tmp_path, 0o700)
    r = subprocess.run(
        [sys.executable, "-m", "kachedb", "serve", "--socket", str(tmp_path / "none.sock"), "--takeover"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode != 0
    assert "no running daemon to take over" in r.stderr, r.stderr


def test_the_metrics_endpoint_moves_to_the_new_daemon():
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = Daemon("32MiB", "--metrics-addr", f"127.0.0.1:{port}")

    def blocks() -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=20) as r:
            text = r.read().decode()
        fam = {f.name: f for f in text_string_to_metric_families(text)}
        return fam["kachedb_blocks"].samples[0].value

    try:
        with d.connect() as kc:
            for i in range(5):
                kc.put(f"m{i}", torch.ones(10))
        assert blocks() == 5
        take_over(d, 0)
        assert blocks() == 5
        with d.connect() as kc:
            kc.put("m5", torch.ones(10))
        assert blocks() == 6
    finally:
        d.stop()
