"""Helpers of the vLLM integration tests: the daemon binary and engine processes."""

import json
import os
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

    def __init__(self, socket: str, size: str = "512MiB") -> None:
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

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


def run_engine(workdir: Path, name: str, spec: dict, timeout: float = 600, background: bool = False):
    """Runs tests/vllm/engine.py in a fresh process; returns its JSON result (or the
    Popen and a collector when ``background``)."""
    spec = dict(spec, out=str(workdir / f"{name}.json"))
    spec_path = workdir / f"{name}.spec.json"
    spec_path.write_text(json.dumps(spec))
    log_path = workdir / f"{name}.log"
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env.setdefault("PYTHONHASHSEED", "0")
    log = open(log_path, "wb")
    p = subprocess.Popen([sys.executable, str(HERE / "engine.py"), str(spec_path)], stdout=log, stderr=subprocess.STDOUT,
                         stdin=subprocess.DEVNULL, env=env, cwd=str(workdir))

    def collect():
        try:
            rc = p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            rc = "timeout"
        log.close()
        text = log_path.read_text(errors="replace")
        if rc != 0:
            raise AssertionError(f"engine {name} exited with {rc}; log tail:\n{text[-6000:]}")
        out = json.loads(Path(spec["out"]).read_text())
        out["log"] = text
        return out

    if background:
        return p, collect
    return collect()


