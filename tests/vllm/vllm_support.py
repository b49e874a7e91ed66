"""Helpers of the vLLM integration tests: the daemon (``engine_support``) and engine processes."""

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import engine_support

HERE = Path(__file__).resolve().parent


class Daemon(engine_support.Daemon):
    """``engine_support.Daemon`` with the vLLM tests' region size by default."""

    def __init__(self, socket: Optional[str] = None, size: str = "512MiB") -> None:
        super().__init__(socket, size)


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


