"""``connect(start=True)`` and the command line against a real daemon."""

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
    for word in ("serve", "stats"):
        assert word in out.stdout
    out = run_cli("serve", "--help")
    assert out.returncode == 0, out.stderr
    for opt in ("--size", "--socket", "--instance", "--channels"):
        assert opt in out.stdout


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


def test_bench_is_not_in_the_package():
    """`bench` and `demo` reach the binary like any argument; the binary the
    package ships has no benchmarks (no `kachedb-bench` beside it), and says
    where they are."""
    env = {k: v for k, v in os.environ.items() if k != "KACHEDB_BIN"}  # the packaged binary
    for args in (["bench"], ["bench", "--help"], ["bench", "ops", "--help"], ["demo"]):
        out = run_cli(*args, env=env)
        assert out.returncode == 2, (args, out.stdout, out.stderr)
        assert "benchmarks/python_ops.py" in out.stderr and "kachedb-bench ring|ops" in out.stderr
