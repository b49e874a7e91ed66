"""The metrics endpoint (``kachedb serve --metrics-addr``), ``--log-format json`` and
``kachedb stats --watch``, against real daemons: real clients work, a real HTTP client
scrapes, and a real Prometheus parser (``prometheus_client.parser``) reads the text.
Nothing here asserts on timings."""

from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

import kachedb
from kdb_support import Daemon, poll_until


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mdaemon():
    """A daemon serving metrics on a free local port."""
    port = free_port()
    d = Daemon("64MiB", "--metrics-addr", f"127.0.0.1:{port}")
    d.metrics_port = port
    try:
        yield d
    finally:
        d.stop()


def http_get(d, path: str, method: str = "GET"):
    """(status, body) of one request with urllib."""
    req = urllib.request.Request(f"http://127.0.0.1:{d.metrics_port}{path}", method=method)
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return r.status, r.read().decode(), r.headers
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), e.headers


def scrape(d):
    """{(sample name, sorted labels): value} and the families, from a real parse."""
    status, text, headers = http_get(d, "/metrics")
    assert status == 200, text
    assert headers["Content-Type"].startswith("text/plain; version=0.0.4")
    families = list(text_string_to_metric_families(text))
    samples = {}
    for fam in families:
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples, families


def val(samples, name, **labels):
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def raw_request(port: int, data: bytes, timeout: float = 20.0) -> bytes:
    """Sends ``data`` on a fresh connection and reads until the server closes; a
    reset or broken pipe (the server closed first) reads as what came before it."""
    got = b""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            s.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                got += chunk
        except (ConnectionResetError, socket.timeout):
            pass
    return got


def test_counters_move_by_exactly_what_the_clients_did(mdaemon):
    N, M, K, L = 24, 17, 9, 6
    payload = b"\x07" * 5000
    kc = mdaemon.connect()
    try:
        kc.stats()  # every frame published so far is served
        before, _ = scrape(mdaemon)
        for i in range(N):
            kc.put(f"metrics-{i}", payload)
        for i in range(M):
            view = kc.get_numpy(f"metrics-{i}")
            assert view.nbytes == len(payload)
            del view
        for i in range(K):
            with pytest.raises(kachedb.NotFound):
                kc.get_numpy(f"metrics-missing-{i}")
        for i in range(L):
            assert kc.lookup([f"metrics-{i}"]) == 1
            assert kc.lookup([f"metrics-absent-{i}"]) == 0
        gc.collect()
        stats = kc.stats()  # answered after the fire-and-forget RELEASEs are served
        after, families = scrape(mdaemon)
    finally:
        kc.close()

    def delta(name, **labels):
        return val(after, name, **labels) - val(before, name, **labels)

    assert delta("kachedb_ops_total", op="reserve", status="ok") == N
    assert delta("kachedb_ops_total", op="commit", status="ok") == N
    assert delta("kachedb_ops_total", op="get", status="ok") == M
    assert delta("kachedb_ops_total", op="get", status="not_found") == K
    assert delta("kachedb_ops_total", op="release", status="ok") == M
    assert delta("kachedb_ops_total", op="lookup", status="ok") == L
    assert delta("kachedb_ops_total", op="lookup", status="not_found") == L
    assert delta("kachedb_hit_blocks_total", op="get") == M
    assert delta("kachedb_miss_blocks_total", op="get") == K
    assert delta("kachedb_hit_blocks_total", op="lookup") == L
    assert delta("kachedb_miss_blocks_total", op="lookup") == L
    assert delta("kachedb_stored_bytes_total") == N * len(payload)
    assert delta("kachedb_served_bytes_total") == M * len(payload)
    assert delta("kachedb_hit_bytes_total", op="get") == M * len(payload)
    assert delta("kachedb_hit_bytes_total", op="lookup") == L * len(payload)
    assert delta("kachedb_rejected_frames_total") == 0
    # Gauges agree with the control socket's full stats.
    assert val(after, "kachedb_blocks") == stats["blocks"] >= N
    assert val(after, "kachedb_bytes_used") == stats["bytes_used"]
    assert val(after, "kachedb_bytes_free") == stats["bytes_free"]
    assert val(after, "kachedb_bytes_capacity") == stats["bytes_total"] == 64 << 20
    assert val(after, "kachedb_pins") == stats["pins"] == 0
    assert val(after, "kachedb_reservations") == stats["reserved"] == 0
    assert val(after, "kachedb_clients_connected") == stats["clients_connected"]
    # Histograms: every batch counted; timed frames are a sample of the frames.
    batches = delta("kachedb_batch_size_frames_count")
    assert 0 < batches and delta("kachedb_batch_size_frames_sum") >= batches
    timed = sum(v for (n, _), v in after.items() if n == "kachedb_op_duration_seconds_count")
    assert timed > 0
    # Every family is ours, documented, and of a known type.
    for fam in families:
        assert fam.name.startswith("kachedb_"), fam.name
        assert fam.documentation, fam.name
        assert fam.type in ("counter", "gauge", "histogram"), (fam.name, fam.type)
    names = {f.name for f in families}
    for want in ("kachedb_ops", "kachedb_op_duration_seconds", "kachedb_batch_size_frames", "kachedb_evictions",
                 "kachedb_evicted_bytes", "kachedb_clients_kicked", "kachedb_clients_refused",
                 "kachedb_serve_parks", "kachedb_client_wakeups", "kachedb_bytes_used", "kachedb_bytes_free"):
        assert want in names, want


def test_evictions_and_refusals_are_counted(make_daemon):
    port = free_port()
    d = make_daemon("8MiB", "--metrics-addr", f"127.0.0.1:{port}", "--channels", "2")
    d.metrics_port = port
    # The start-up probe's client has gone once no client is connected.
    poll_until(lambda: val(scrape(d)[0], "kachedb_clients_connected") == 0, 20, "no clients")
    before, _ = scrape(d)
    with d.connect() as kc:
        for i in range(12):  # 12 x 1 MiB into 8 MiB: the oldest go
            kc.put(f"evict-{i}", b"\x01" * (1 << 20))
        stats = kc.stats()
        with d.connect():
            # Both channels taken.
            with pytest.raises(kachedb.KacheDBError, match="channels are in use"):
                d.connect()
    after, _ = scrape(d)
    assert stats["evictions"] > 0
    assert val(after, "kachedb_evictions_total") - val(before, "kachedb_evictions_total") == stats["evictions"]
    assert val(after, "kachedb_evicted_bytes_total") == stats["evicted_bytes"]
    assert val(after, "kachedb_clients_refused_total", reason="channels_full") == 1


def test_healthz_and_bad_requests_get_clear_answers(mdaemon):
    status, body, _ = http_get(mdaemon, "/healthz")
    assert (status, body) == (200, "ok\n")
    assert http_get(mdaemon, "/no-such-page")[0] == 404
    status, _, headers = http_get(mdaemon, "/metrics", method="POST")
    assert status == 405 and headers["Allow"] == "GET, HEAD"
    assert raw_request(mdaemon.metrics_port, b"NONSENSE\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    # Huge headers: 431 (or 400), or a closed connection; never a hang.
    huge = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n"
    got = raw_request(mdaemon.metrics_port, huge)
    assert got == b"" or got.startswith((b"HTTP/1.1 431 ", b"HTTP/1.1 400 ")), got[:200]
    # The daemon is unaffected.
    with mdaemon.connect() as kc:
        kc.put("after-bad-requests", b"fine")
        assert bytes(kc.get_numpy("after-bad-requests").tobytes()) == b"fine"
    assert http_get(mdaemon, "/healthz")[0] == 200


def test_slowloris_is_cut_off_while_scrapes_and_gets_go_on(mdaemon):
    """Two clients trickle a request head a byte at a time; the server's head deadline
    closes them, and meanwhile scrapes and GETs are answered."""
    outcome = {}

    def trickle(name):
        s = socket.create_connection(("127.0.0.1", mdaemon.metrics_port), timeout=20)
        s.settimeout(0.25)
        got = b""
        try:
            s.sendall(b"GET /metrics HTTP/1.1\r\n")
            for _ in range(240):  # a byte each ~0.25 s, for at most ~60 s: never a full head
                try:
                    s.sendall(b"X")
                except (BrokenPipeError, ConnectionResetError):
                    outcome[name] = ("closed", got)
                    return
                try:
                    chunk = s.recv(4096)
                except socket.timeout:
                    continue
                except ConnectionResetError:
                    outcome[name] = ("closed", got)
                    return
                if not chunk:
                    outcome[name] = ("closed", got)
                    return
                got += chunk
            outcome[name] = ("still open", got)
        finally:
            s.close()

    threads = [threading.Thread(target=trickle, args=(f"slow{i}",)) for i in range(2)]
    for t in threads:
        t.start()
    with mdaemon.connect() as kc:
        kc.put("slowloris-key", b"v" * 1000)
        while any(t.is_alive() for t in threads):
            samples, _ = scrape(mdaemon)  # served while the slow clients hold their connections
            assert val(samples, "kachedb_blocks") >= 1
            view = kc.get_numpy("slowloris-key")
            assert view.nbytes == 1000
            del view
            time.sleep(0.2)
    for t in threads:
        t.join()
    for name in ("slow0", "slow1"):
        state, got = outcome[name]
        assert state == "closed", (name, state, got[:200])
        assert got == b"" or got.startswith(b"HTTP/1.1 408 "), got[:200]


def test_metrics_addr_on_a_busy_port_is_a_clear_error_at_start():
    d = tempfile.mkdtemp(prefix="kdbpy-m-", dir="/tmp")
    busy = socket.socket()
    try:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        addr = "127.0.0.1:%d" % busy.getsockname()[1]
        sock = os.path.join(d, "d.sock")
        r = subprocess.run(
            [sys.executable, "-m", "kachedb", "serve", "--socket", sock, "--size", "16MiB", "--metrics-addr", addr],
            capture_output=True, text=True, timeout=60,
        )
        assert r.returncode != 0
        assert f"cannot serve metrics on {addr}" in r.stderr and "--metrics-addr" in r.stderr, r.stderr
        assert not os.path.exists(sock)
    finally:
        busy.close()
        shutil.rmtree(d, ignore_errors=True)


def test_log_format_json_has_client_events_with_pid_and_uid():
    d = tempfile.mkdtemp(prefix="kdbpy-j-", dir="/tmp")
    sock = os.path.join(d, "d.sock")
    err_path = os.path.join(d, "stderr")
    with open(err_path, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kachedb", "serve", "--socket", sock, "--size", "16MiB", "--log-format", "json"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
        )
    try:
        poll_until(lambda: os.path.exists(sock) or proc.poll() is not None, 30, "the daemon's socket")
        assert proc.poll() is None, open(err_path).read()
        kc = None
        for _ in range(500):
            try:
                kc = kachedb.connect(sock)
                break
            except kachedb.Disconnected:
                time.sleep(0.02)
        assert kc is not None
        kc.put("json-log", b"x")
        kc.close()
        del kc
        gc.collect()
        # The control thread logs the close when it sees it (at shutdown it drains
        # connections without logging them).
        poll_until(lambda: "client_disconnected" in open(err_path).read(), 30, "the close to be logged")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    lines = [ln for ln in open(err_path).read().splitlines() if ln.strip()]
    shutil.rmtree(d, ignore_errors=True)
    events = [json.loads(ln) for ln in lines]  # every stderr line is a JSON object
    assert proc.returncode == 0, lines
    for ev in events:
        assert {"timestamp", "level", "message"} <= ev.keys(), ev
    mine = [e for e in events if e.get("pid") == os.getpid()]
    kinds = [e.get("event") for e in mine]
    assert "client_connected" in kinds and "client_disconnected" in kinds, events
    for e in mine:
        if e.get("event") in ("client_connected", "client_disconnected"):
            assert e["uid"] == os.getuid() and isinstance(e["channel"], int), e


def test_stats_watch_draws_frames_that_fit_80_columns(mdaemon):
    with mdaemon.connect() as kc:
        kc.put("watch-me", b"w" * 4096)
        proc = subprocess.Popen(
            [sys.executable, "-m", "kachedb", "stats", "--socket", mdaemon.socket, "--watch", "0.2"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        try:
            for _ in range(30):  # a few frames' worth of work
                view = kc.get_numpy("watch-me")
                del view
                time.sleep(0.05)
            # Two whole frames at least (each ends with its "Ctrl-C to quit" line),
            # however slowly the watcher started.
            lines, ends = [], 0
            watchdog = threading.Timer(60, proc.kill)
            watchdog.start()
            try:
                for line in proc.stdout:
                    lines.append(line)
                    ends += line.startswith("Ctrl-C to quit")
                    if ends == 2:
                        break
            finally:
                watchdog.cancel()
        finally:
            proc.send_signal(signal.SIGTERM)
            rest, err = proc.communicate(timeout=30)
    out = "".join(lines) + rest
    assert proc.returncode == 0, err
    frames = out.split("kachedb  pid ")[1:]  # each frame starts with its title line
    assert len(frames) >= 2, out
    assert all(len(line) <= 80 for line in out.splitlines()), out
    last = frames[-1]
    for word in ("memory", "GET", "LOOKUP", "PUT (commit)", "per second", "blocks"):
        assert word in last, last
    # json mode is one object per line
    r = subprocess.run([sys.executable, "-m", "kachedb", "stats", "--socket", mdaemon.socket, "--json"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and json.loads(r.stdout)["blocks"] >= 1


def test_the_grafana_dashboard_uses_only_exported_names(tmp_path):
    """Every name the board queries is one a daemon with a disk tier and a
    tenant limit exports (the disk row's names exist only with --disk, a
    tenant's limit only with --tenant-limit)."""
    path = os.path.join(os.path.dirname(__file__), "..", "..", "..", "docs", "grafana-dashboard.json")
    if not os.path.exists(path):
        pytest.skip("not run from a KacheDB checkout")
    import re

    dash = json.load(open(path))
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    used = {n for e in exprs for n in re.findall(r"\bkachedb_[a-z_]+", e)}
    used |= set(re.findall(r"\bkachedb_[a-z_]+", json.dumps(dash["templating"])))
    assert any(n.startswith("kachedb_disk_") for n in used), "the board has no disk tier row"
    assert any(n.startswith("kachedb_tenant_") for n in used), "the board has no tenant row"
    port = free_port()
    # A tenant limit: kachedb_tenant_limit_bytes exists only for a tenant with one.
    d = Daemon("64MiB", "--metrics-addr", f"127.0.0.1:{port}", "--disk", str(tmp_path / "disk"), "--disk-size", "64MiB",
               "--tenant-limit", "default=48MiB")
    d.metrics_port = port
    try:
        with d.connect() as kc:  # per-op series appear once an op was served
            kc.put("board", b"b" * 4096)
            view = kc.get("board")
            del view
        samples, _ = scrape(d)
    finally:
        d.stop()
    exported = {name for name, _ in samples}
    assert used and used <= exported, sorted(used - exported)


def test_disk_fills_have_their_own_histogram_and_deletes_and_timeouts_are_counted(tmp_path):
    """With a disk tier (and no remote one): a block filled from disk is
    counted in ``kachedb_disk_fill_duration_seconds``, not in the remote
    tier's histogram (which is not exported at all without --remote); a
    DELETE of a block on disk counts in ``kachedb_disk_deletes_total``. Real
    daemons, a real HTTP client, a real Prometheus parser."""
    disk = str(tmp_path / "disk")
    port = free_port()
    a = Daemon("64MiB", "--disk", disk, "--disk-size", "64MiB")
    try:
        with a.connect() as kc:
            kc.put("fill-me", b"f" * 100_000)
            kc.put("delete-me", b"d" * 100_000)
        poll_until(lambda: a.stats()["disk_writes"] == 2 and a.stats()["disk_queue_blocks"] == 0, 60, "disk writes")
    finally:
        a.stop()
    b = Daemon("64MiB", "--metrics-addr", f"127.0.0.1:{port}", "--disk", disk, "--disk-size", "64MiB")
    b.metrics_port = port
    try:
        poll_until(lambda: b.stats()["disk_indexed"], 60, "the disk index")
        samples, families = scrape(b)
        assert val(samples, "kachedb_disk_fill_duration_seconds_count") == 0
        with b.connect() as kc:
            got = kc.get_numpy("fill-me")
            assert got.tobytes() == b"f" * 100_000
            del got
            kc.delete("delete-me")  # only on disk: nothing local, the disk copy goes
            with pytest.raises(kachedb.NotFound):
                kc.get("delete-me")
        poll_until(lambda: val(scrape(b)[0], "kachedb_disk_deletes_total") == 1, 60, "the disk delete")
        samples, families = scrape(b)
        names = {f.name for f in families}
        assert val(samples, "kachedb_disk_fill_duration_seconds_count") == 1
        assert val(samples, "kachedb_disk_fills_total") == 1
        assert "kachedb_remote_fill_duration_seconds" not in names
        assert val(samples, "kachedb_disk_fetches_timed_out_total") == 0
    finally:
        b.stop()
