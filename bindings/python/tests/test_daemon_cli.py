"""``connect(start=True)``, the command line against a real daemon, and the
Python benchmark's smoke run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch

import kachedb
import kachedb.__main__ as cli
from kachedb import _kachedb_rust as rust

DAEMON_SIZE = "16MiB"


def run_cli(*args, timeout=120, env=None):
    return subprocess.run([sys.executable, "-m", "kachedb", *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture
def tmp_socket_dir():
    d = tempfile.mkdtemp(prefix="kdbpy-s-", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_connect_start_spawns_a_daemon_and_reuses_it(tmp_socket_dir):
    sock = os.path.join(tmp_socket_dir, "sub", "d.sock")  # the directory is created too
    with pytest.raises(kachedb.Disconnected):
        kachedb.connect(sock)
    kc = kachedb.connect(start=True, socket=sock, size="256MiB")
    try:
        assert kc.started_daemon
        assert kc.socket == sock and os.path.exists(sock)
        assert kc.stats()["bytes_total"] == 256 << 20
        kc.put("start", torch.arange(10))
        # A second connect(start=True) finds the running daemon and starts none.
        with kachedb.connect(start=True, socket=sock, size="8MiB") as again:
            assert not again.started_daemon
            assert again.get("start").tolist() == list(range(10))
            assert again.stats()["bytes_total"] == 256 << 20  # not the 8 MiB asked for
            with pytest.raises(kachedb.KacheDBError, match="did not start"):
                again.stop_daemon()
        # the daemon logs next to its socket
        assert os.path.exists(os.path.join(os.path.dirname(sock), "kachedb_0.log"))
    finally:
        kc.stop_daemon()
    assert not os.path.exists(sock), "the stopped daemon left its socket"
    # A client of a stopped daemon fails with Disconnected, it does not hang.
    with pytest.raises(kachedb.Disconnected):
        kc.get("start")
    with pytest.raises(kachedb.Disconnected, match="kachedb serve"):
        kachedb.connect(sock)


def test_connect_start_reports_a_daemon_that_cannot_start(tmp_socket_dir):
    sock = os.path.join(tmp_socket_dir, "d.sock")
    with pytest.raises(kachedb.KacheDBError, match="exited"):
        kachedb.connect(start=True, socket=sock, size="not-a-size", timeout=60)
    with pytest.raises(kachedb.InvalidArgument):
        kachedb.connect(start=True, socket=sock, size=0)
    with pytest.raises(TypeError):
        kachedb.connect(start=True, socket=sock, size=1.5)
    assert not os.path.exists(sock)


def test_default_socket_path_honours_the_environment(monkeypatch):
    monkeypatch.setenv("KACHEDB_SOCKET", "/tmp/somewhere/k.sock")
    assert kachedb.default_socket_path() == "/tmp/somewhere/k.sock"
    assert rust.default_socket_path(0) == "/tmp/somewhere/k.sock"
    other = kachedb.default_socket_path(3)
    assert other.endswith("kachedb_3.sock") and other != "/tmp/somewhere/k.sock"


def test_help():
    out = run_cli("--help")
    assert out.returncode == 0, out.stderr
    for word in ("serve", "stats", "bench"):
        assert word in out.stdout
    out = run_cli("serve", "--help")
    assert out.returncode == 0, out.stderr
    for opt in ("--size", "--socket", "--instance", "--channels"):
        assert opt in out.stdout
    out = run_cli("bench", "--help")
    assert out.returncode == 0, out.stderr
    assert "ring" in out.stdout and "ops" in out.stdout and "bench py" in out.stdout
    out = run_cli("bench", "py", "--help")
    assert out.returncode == 0, out.stderr
    assert "--quick" in out.stdout and "--json" in out.stdout


def test_stats_json_of_a_running_daemon(daemon):
    with daemon.connect() as kc:
        kc.put("cli", torch.zeros(10))
        out = run_cli("stats", "--json", "--socket", daemon.socket)
        assert out.returncode == 0, out.stderr
        s = json.loads(out.stdout)
        assert s["blocks"] >= 1 and s["bytes_total"] == 16 << 20 and s["clients_connected"] >= 1
        assert s["socket"] == daemon.socket
    out = run_cli("stats", "--socket", daemon.socket)
    assert out.returncode == 0, out.stderr
    assert "blocks" in out.stdout


def test_stats_without_a_daemon_fails_and_says_how_to_start_one(tmp_socket_dir):
    out = run_cli("stats", "--json", "--socket", os.path.join(tmp_socket_dir, "none.sock"))
    assert out.returncode != 0
    assert "kachedb serve" in out.stderr


def test_bench_dispatch(monkeypatch):
    """`bench` with no subcommand (options only) and `bench py` run the Python
    benchmark; `bench ring|ops|…` and `bench --help` go to the Rust CLI."""
    import types

    import kachedb._bench as bench

    seen = []
    monkeypatch.setattr(bench, "main", lambda argv: seen.append(("py", list(argv))) or 0)
    monkeypatch.setattr(rust, "cli_main", lambda argv: seen.append(("rust", list(argv))) or 0, raising=False)
    fake_compare = types.ModuleType("kachedb._compare")
    fake_compare.main = lambda argv, prog: seen.append(("compare", list(argv), prog)) or 0
    monkeypatch.setitem(sys.modules, "kachedb._compare", fake_compare)
    for argv in (
        ["bench"],
        ["bench", "--json"],
        ["bench", "--quick", "--json", "--socket", "/x.sock"],
        ["bench", "py", "--quick"],
        ["bench", "ring", "--json"],
        ["bench", "ops", "--quick"],
        ["bench", "compare", "--quick"],
        ["bench", "--help"],
        ["stats", "--json"],
    ):
        assert cli.main(argv) == 0
    assert seen == [
        ("py", []),
        ("py", ["--json"]),
        ("py", ["--quick", "--json", "--socket", "/x.sock"]),
        ("py", ["--quick"]),
        ("rust", ["kachedb", "bench", "ring", "--json"]),
        ("rust", ["kachedb", "bench", "ops", "--quick"]),
        ("compare", ["--quick"], "kachedb bench compare"),
        ("rust", ["kachedb", "bench", "--help"]),
        ("rust", ["kachedb", "stats", "--json"]),
    ]


@pytest.mark.timeout(300, method="thread")
def test_bench_quick_json_smoke():
    out = run_cli("bench", "--quick", "--json", timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    by = {}
    for rec in lines:
        by.setdefault(rec["bench"], []).append(rec)
    for name in ("py_ping_rtt", "py_get_rtt_native", "py_get_rtt"):
        (rec,) = by[name]
        assert rec["p50_ns"] > 0 and rec["p99_ns"] >= rec["p50_ns"]
    assert by["py_get_rtt_native"][0]["call"] == "NativeClient.get"
    assert by["py_get_overhead"][0]["mean_ns"] > 0
    views = by["py_get_view"]
    assert [v["bytes"] for v in views] == [1 << 20, 64 << 20]
    for v in views:
        assert "skipped" in v or v["p50_ns"] > 0
    (put,) = by["py_put"]
    assert put["bytes"] == 64 << 20
    if "skipped" not in put:
        assert put["gbps"] > 0 and put["torch_copy_gbps"] > 0
        assert put["ratio"] == pytest.approx(put["gbps"] / put["torch_copy_gbps"])
    (many,) = by["py_get_many"]
    assert many["batch"] == 64 and many["ops_per_s"] > 0 and many["ops_per_s_with_release"] > 0


def test_bench_against_a_given_socket_and_table_output(daemon):
    out = run_cli("bench", "py", "--quick", "--socket", daemon.socket, timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "GET-hit round trip" in out.stdout and "target" in out.stdout
    # the 16 MiB daemon cannot hold the 64 MiB block nor the 64 MiB put: said, not crashed
    assert "64 MiB as a torch view      skipped: larger than the daemon's 16 MiB megaslab" in out.stdout
    assert "1 MiB as a torch view      p50" in out.stdout  # but the 1 MiB one fits
    assert "PUT 64 MiB  skipped" in out.stdout
    with daemon.connect() as kc:
        assert kc.stats()["pins"] == 0


def test_bench_compare_goes_to_the_rust_cli_without_a_python_module(monkeypatch):
    seen = []
    monkeypatch.setattr(rust, "cli_main", lambda argv: seen.append(list(argv)) or 7, raising=False)
    monkeypatch.setitem(sys.modules, "kachedb._compare", None)  # makes the import fail
    assert cli.main(["bench", "compare"]) == 7
    assert seen == [["kachedb", "bench", "compare"]]
