"""The real ``kachedb serve`` as a process of a test or a benchmark: started on a
private socket, ready once a client connects, observed through one client,
stopped by its PID (SIGTERM, SIGKILL after a grace period) and its folder
removed. The kernel sends it SIGTERM if the process that started it dies first,
so a crashed test leaves no daemon holding its region.

Which executable serves: ``binary`` when given; else ``$KACHEDB_BIN``; else
``python -m kachedb`` of the running interpreter (the installed package, which
execs the binary it ships).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

ROOT = Path(__file__).resolve().parent.parent

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except Exception:
        pass


def built_binary() -> str:
    """The daemon binary of this checkout: ``$KACHEDB_BIN``, else
    target/release/kachedb (``FileNotFoundError`` saying how to build it)."""
    b = os.environ.get("KACHEDB_BIN") or str(ROOT / "target" / "release" / "kachedb")
    if not os.path.exists(b):
        raise FileNotFoundError(f"the daemon binary {b} is missing: run `cargo build --release -p kachedb-cli` (or `make build`)")
    return b


def serve_command(binary: Optional[str] = None) -> List[str]:
    """The command line that runs ``kachedb`` (see the module's docstring)."""
    if binary is not None:
        return [binary]
    if os.environ.get("KACHEDB_BIN"):
        return [os.environ["KACHEDB_BIN"]]
    return [sys.executable, "-m", "kachedb"]


class Daemon:
    """``kachedb serve --socket SOCKET --size SIZE EXTRA...``.

    ``socket``: default ``d.sock`` in a new private folder (removed by ``stop``).
    Output goes to ``log_path`` (the socket path + ``.log``). ``start()``
    returns once a client can connect; ``stats()`` and ``client()`` use one
    observer client, connected on first use and kept.
    """

    def __init__(
        self,
        socket: Optional[str] = None,
        size: Union[str, int] = "256MiB",
        extra: Sequence[str] = (),
        *,
        binary: Optional[str] = None,
        ready_timeout_s: float = 30.0,
        stop_timeout_s: float = 15.0,
    ) -> None:
        self._own_dir: Optional[str] = None
        if socket is None:
            self._own_dir = tempfile.mkdtemp(prefix="kdb-", dir="/tmp")
            socket = os.path.join(self._own_dir, "d.sock")
        self.socket = socket
        self.size = str(size)
        self.extra = list(extra)
        self.command = serve_command(binary)
        self.log_path = socket + ".log"
        self.ready_timeout_s = ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.proc: Optional[subprocess.Popen] = None
        self._observer: Any = None

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return self.proc.pid

    def start(self) -> "Daemon":
        """Starts the daemon; returns once a client connects (``RuntimeError``
        with the log's tail if it exits or does not answer in time)."""
        import kachedb

        if os.path.exists(self.socket):
            os.unlink(self.socket)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [*self.command, "serve", "--socket", self.socket, "--size", self.size, *self.extra],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            if self.proc.poll() is not None:
                log = self.log()
                self.stop()
                raise RuntimeError(f"the daemon exited with code {self.proc.returncode}:\n{log}")
            if os.path.exists(self.socket):
                try:
                    # A probe that holds no channel afterwards (clients_connected
                    # counts only the test's own clients).
                    kachedb._kachedb_rust.NativeClient.connect(self.socket).close()
                    return self
                except kachedb.Disconnected:
                    pass
            if time.monotonic() > deadline:
                log = self.log()
                self.stop()
                raise RuntimeError(f"the daemon did not come up within {self.ready_timeout_s} s:\n{log}")
            time.sleep(0.01)

    def __enter__(self) -> "Daemon":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def log(self) -> str:
        """The tail of the daemon's output."""
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-4000:].decode(errors="replace")
        except OSError:
            return "(no log)"

    def connect(self) -> Any:
        """A new client of this daemon."""
        import kachedb

        return kachedb.connect(self.socket)

    def client(self) -> Any:
        """The observer client (stats, lookups)."""
        if self._observer is None:
            self._observer = self.connect()
        return self._observer

    def stats(self) -> Dict[str, Any]:
        return self.client().stats()

    def kill(self) -> None:
        """SIGKILL: the daemon dies without a goodbye (its folder stays until ``stop``)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self, check: bool = False) -> Optional[int]:
        """SIGTERM, SIGKILL after ``stop_timeout_s``; removes the private folder.
        Returns the exit code (``None`` if never started). With ``check``: the
        daemon must have been alive, stopped cleanly (exit 0) and removed its
        socket and lock file, else ``AssertionError`` with its log."""
        problems: List[str] = []
        if self._observer is not None:
            try:
                self._observer.close()
            except Exception:
                pass
            self._observer = None
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(self.stop_timeout_s)
                except subprocess.TimeoutExpired:
                    problems.append(f"the daemon ignored SIGTERM for {self.stop_timeout_s} s and was killed")
                    self.proc.kill()
                    self.proc.wait()
            elif check:
                problems.append(f"the daemon died during the test (exit code {self.proc.returncode})")
            if self.proc.returncode != 0 and not problems:
                problems.append(f"the daemon exited with code {self.proc.returncode} on SIGTERM")
            for leftover in (self.socket, self.socket + ".lock"):
                if os.path.exists(leftover):
                    problems.append(f"{leftover} was left behind")
        log = self.log()
        if self._own_dir is not None:
            shutil.rmtree(self._own_dir, ignore_errors=True)
        if check and problems:
            raise AssertionError("; ".join(problems) + "\n--- daemon log ---\n" + log)
        return None if self.proc is None else self.proc.returncode
