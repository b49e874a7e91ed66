"""Helpers of the SGLang integration tests: the daemon binary and pool processes."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def daemon_bin() -> str:
    b = os.environ.get("KACHEDB_BIN") or str(ROOT / "target" / "release" / "kachedb")
    if not os.path.exists(b):
        pytest.fail(f"the daemon binary {b} is missing: run `cargo build --release -p kachedb-cli` (or `make build`)")
    return b


class Daemon:
    """The real daemon binary on its own socket; stopped by its PID."""

    def __init__(self, socket: str, size: str = "256MiB") -> None:
        self.socket = socket
        self.size = size
        self.proc = None

    def start(self) -> "Daemon":
        if os.path.exists(self.socket):
            os.unlink(self.socket)
        self.log = self.socket + ".log"
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [daemon_bin(), "serve", "--socket", self.socket, "--size", self.size],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
            )
        deadline = time.monotonic() + 30
        while not os.path.exists(self.socket):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"daemon did not start: {open(self.log).read()[-2000:]}")
            time.sleep(0.05)
        return self

    def stats(self) -> dict:
        import kachedb

        with kachedb.connect(self.socket) as kc:
            return kc.stats()

    def kill(self) -> None:
        """SIGKILL: the daemon dies without a goodbye."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


def sglang_env() -> dict:
    """The environment of a child process: ninja (for SGLang's page-hash
    extension) on PATH."""
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    return env


def run_pools(workdir: Path, name: str, spec: dict, timeout: float = 900) -> dict:
    """Runs pool_proc.py in a fresh process; returns its JSON result."""
    spec = dict(spec, out=str(workdir / f"{name}.json"))
    spec_path = workdir / f"{name}.spec.json"
    spec_path.write_text(json.dumps(spec))
    log_path = workdir / f"{name}.log"
    with open(log_path, "wb") as log:
        p = subprocess.Popen([sys.executable, str(HERE / "pool_proc.py"), str(spec_path)], stdout=log,
                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=sglang_env(), cwd=str(workdir))
        try:
            rc = p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            raise AssertionError(f"{name} did not finish in {timeout} s; log: {log_path.read_text()[-3000:]}")
    log_text = log_path.read_text(errors="replace")
    assert rc == 0, f"{name} exited with {rc}:\n{log_text[-4000:]}"
    result = json.loads(Path(spec["out"]).read_text())
    result["log"] = log_text
    result["tracebacks"] = len(re.findall(r"^Traceback", log_text, re.M))
    return result
