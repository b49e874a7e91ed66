"""What the engine integration test folders (tests/vllm, tests/sglang,
tests/lmcache) share: whether their engine is installed, and the real daemon
binary run as a process of the test.

Each folder's conftest.py puts tests/ on ``sys.path`` and imports this module;
a script a test runs in a fresh process does the same. Only the standard
library is imported here (``kachedb`` when a daemon is started), so the main
environment, where no engine is installed, can load the conftests and collect
nothing from those folders.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, Optional

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def engine_installed(name: str) -> bool:
    """Whether the engine package ``name`` (``"vllm"``, ``"sglang"``,
    ``"lmcache"``) can be imported. The test folder tests/NAME is itself a
    namespace package of that name when tests/ is on ``sys.path``: it is not the
    engine."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return False
    here = str(TESTS / name)
    return bool(spec and spec.origin and spec.origin.endswith("__init__.py") and not spec.origin.startswith(here))


def daemon_bin() -> str:
    """The daemon binary: ``$KACHEDB_BIN``, else target/release/kachedb."""
    b = os.environ.get("KACHEDB_BIN") or str(ROOT / "target" / "release" / "kachedb")
    if not os.path.exists(b):
        raise FileNotFoundError(f"the daemon binary {b} is missing: run `cargo build --release -p kachedb-cli` (or `make build`)")
    return b


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except Exception:
        pass


class Daemon:
    """The real daemon binary serving ``socket`` (default: ``d.sock`` in a new
    private directory, removed by ``stop``) with a region of ``size``; stopped
    by its PID, and sent SIGTERM by the kernel if the process that started it
    dies first. Its output goes to ``log_path`` (the socket path + ``.log``)."""

    def __init__(self, socket: Optional[str] = None, size: str = "256MiB") -> None:
        self._own_dir: Optional[str] = None
        if socket is None:
            self._own_dir = tempfile.mkdtemp(prefix="kdb-test-", dir="/tmp")
            socket = os.path.join(self._own_dir, "d.sock")
        self.socket = socket
        self.size = size
        self.log_path = socket + ".log"
        self.proc: Optional[subprocess.Popen] = None
        self._observer: Any = None

    def start(self) -> "Daemon":
        """Starts the daemon and returns once a client connects to it."""
        import kachedb

        if os.path.exists(self.socket):
            os.unlink(self.socket)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [daemon_bin(), "serve", "--socket", self.socket, "--size", self.size],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        deadline = time.monotonic() + 30
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the daemon did not start:\n{self.log()}")
            if os.path.exists(self.socket):
                try:
                    self._observer = kachedb.connect(self.socket)
                    return self
                except kachedb.Disconnected:
                    pass
            time.sleep(0.02)

    def log(self) -> str:
        """The tail of the daemon's output."""
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-3000:].decode(errors="replace")
        except OSError:
            return "(no log)"

    def client(self) -> Any:
        """A client kept for observing the daemon (stats, lookups)."""
        return self._observer

    def stats(self) -> Dict[str, Any]:
        return self._observer.stats()

    def kill(self) -> None:
        """SIGKILL: the daemon dies without a goodbye."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> Optional[int]:
        """SIGTERM (SIGKILL after 15 s); returns the exit code (``None`` if it
        was never started)."""
        if self._observer is not None:
            try:
                self._observer.close()
            except Exception:
                pass
            self._observer = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._own_dir is not None:
            shutil.rmtree(self._own_dir, ignore_errors=True)
        return None if self.proc is None else self.proc.returncode
