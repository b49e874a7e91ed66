"""`python -m kachedb` / the `kachedb` console script: the config commands in
Python, everything else the native binary shipped in the package."""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

import kachedb
import kachedb.__main__ as cli
from kachedb import _daemon_bin


def run_cli(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "kachedb", *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_the_package_ships_the_binary():
    assert os.access(_daemon_bin.PACKAGED, os.X_OK), _daemon_bin.PACKAGED
    assert _daemon_bin.daemon_binary() in (_daemon_bin.PACKAGED, os.environ.get("KACHEDB_BIN"))


def test_help_names_every_command():
    out = run_cli("--help")
    assert out.returncode == 0, out.stderr
    for word in ("serve", "stats", "vllm-config", "lmcache-config", "sglang-config"):
        assert word in out.stdout, (word, out.stdout)


def test_config_commands_run_in_python(capsys, tmp_path):
    sock = str(tmp_path / "none.sock")
    assert cli.main(["sglang-config", "--socket", sock]) == 0
    captured = capsys.readouterr()
    assert f'"socket": "{sock}"' in captured.out
    # No daemon there: the config is printed all the same, with a warning saying how to start one.
    assert "no KacheDB daemon listens on" in captured.err and f"kachedb serve --socket {sock}" in captured.err


def test_config_command_is_quiet_when_a_daemon_listens(daemon):
    out = run_cli("lmcache-config", "--socket", daemon.socket)
    assert out.returncode == 0, out.stderr
    assert daemon.socket in out.stdout
    assert "warning" not in out.stderr, out.stderr


def test_vllm_config_without_vllm_says_what_to_install():
    out = run_cli("vllm-config", env={**os.environ, "PYTHONPATH": ""})
    assert out.returncode == 2
    assert out.stderr.startswith("kachedb vllm-config: kachedb.vllm needs vLLM"), out.stderr
    assert 'pip install "kachedb-shm[vllm]"' in out.stderr and "Traceback" not in out.stderr


def test_without_the_binary_says_what_to_do(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("KACHEDB_BIN", str(tmp_path / "nope"))
    assert cli.main(["stats"]) == 2
    assert "KACHEDB_BIN" in capsys.readouterr().err
    monkeypatch.delenv("KACHEDB_BIN")
    monkeypatch.setattr(_daemon_bin, "PACKAGED", str(tmp_path / "missing"))
    assert cli.main(["stats"]) == 2
    err = capsys.readouterr().err
    assert "pip install --force-reinstall kachedb-shm" in err
    with pytest.raises(kachedb.KacheDBError, match="cannot start a daemon"):
        kachedb.connect(str(tmp_path / "d.sock"), start=True)


def test_binary_alone_points_at_the_package_for_config_commands():
    out = subprocess.run([_daemon_bin.daemon_binary(), "vllm-config", "--socket", "/x"], capture_output=True, text=True)
    assert out.returncode == 2
    assert "python -m kachedb vllm-config" in out.stderr


def test_serve_execs_the_binary_in_place():
    """`python -m kachedb serve` becomes the daemon (execv): same pid, signals reach it,
    and its text log has no colour codes when it goes to a file."""
    d = tempfile.mkdtemp(prefix="kdbpy-exec-", dir="/tmp")
    sock = os.path.join(d, "d.sock")
    log = os.path.join(d, "log")
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "kachedb", "serve", "--socket", sock, "--size", "16MiB"],
                                stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "RUST_LOG": "info"})
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(sock):
            assert proc.poll() is None and time.monotonic() < deadline, open(log).read()
            time.sleep(0.02)
        with kachedb.connect(sock) as kc:
            assert kc.stats()["daemon_pid"] == proc.pid
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        text = open(log, "rb").read()
        assert b"serving instance" in text
        assert b"\x1b[" not in text, text[-500:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(d, ignore_errors=True)
