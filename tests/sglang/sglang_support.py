"""Helpers of the SGLang integration tests: pool processes (the daemon is ``engine_support.Daemon``)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def sglang_env() -> dict:
    """The environment of a child process: ninja (for SGLang's page-hash
    extension) on PATH."""
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    return env


def run_pools(workdir: Path, name: str, spec: dict, timeout: float = 900, script: str = "pool_proc.py") -> dict:
    """Runs ``script`` (pool_proc.py by default) in a fresh process; returns its JSON result."""
    spec = dict(spec, out=str(workdir / f"{name}.json"))
    spec_path = workdir / f"{name}.spec.json"
    spec_path.write_text(json.dumps(spec))
    log_path = workdir / f"{name}.log"
    with open(log_path, "wb") as log:
        p = subprocess.Popen([sys.executable, str(HERE / script), str(spec_path)], stdout=log,
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
