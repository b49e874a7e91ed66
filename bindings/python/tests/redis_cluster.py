"""Test support: a real Redis Cluster of several ``redis-server`` processes on
127.0.0.1, started and stopped by the tests (``cluster-require-full-coverage
no``, so that one dead master leaves the others serving). Every server runs
with ``PR_SET_PDEATHSIG``, so none outlives a test process that dies."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from typing import Dict, List, Optional

from kdb_support import _die_with_parent


def _free_ports(n: int) -> List[int]:
    """``n`` ports free now whose cluster bus ports (+10000) are free too."""
    ports: List[int] = []
    while len(ports) < n:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p + 10000 > 65535 or p in ports:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 10000))
            except OSError:
                continue
        ports.append(p)
    return ports


def _cli(port: int, *args: str, timeout: float = 10.0) -> str:
    out = subprocess.run(
        ["redis-cli", "-h", "127.0.0.1", "-p", str(port), *args],
        capture_output=True,
        timeout=timeout,
        check=False,
    )
    return out.stdout.decode(errors="replace")


class RedisCluster:
    """``masters`` redis-server processes in cluster mode, joined with
    ``redis-cli --cluster create``."""

    def __init__(self, masters: int = 3) -> None:
        if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
            raise RuntimeError("redis-server and redis-cli are needed (Debian: apt-get install redis-server)")
        self.dir = tempfile.mkdtemp(prefix="kdbredis-", dir="/tmp")
        self.ports = _free_ports(masters)
        self.procs: Dict[int, subprocess.Popen] = {}
        try:
            for p in self.ports:
                self.start_node(p)
            for p in self.ports:
                self._wait_ping(p, 15.0)
            out = subprocess.run(
                ["redis-cli", "--cluster", "create", *[f"127.0.0.1:{p}" for p in self.ports],
                 "--cluster-replicas", "0", "--cluster-yes"],
                capture_output=True,
                timeout=60,
                check=False,
            )
            if out.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: {out.stdout!r} {out.stderr!r}")
            self.wait_ok(30.0)
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}"

    def start_node(self, port: int) -> None:
        """Starts (or restarts, with its saved cluster config) the node on ``port``."""
        log = open(os.path.join(self.dir, f"{port}.log"), "ab")
        try:
            self.procs[port] = subprocess.Popen(
                ["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                 "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
                 "--cluster-require-full-coverage", "no", "--cluster-node-timeout", "2000",
                 "--save", "", "--appendonly", "no", "--daemonize", "no",
                 "--protected-mode", "no", "--dir", self.dir],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        finally:
            log.close()

    def kill_node(self, port: int) -> None:
        """SIGKILLs the node on ``port`` (its data is gone: no persistence)."""
        proc = self.procs.pop(port)
        proc.kill()
        proc.wait(10)

    def pause_node(self, port: int, paused: bool) -> None:
        """SIGSTOPs (a node that accepts requests and never answers) or SIGCONTs the node on ``port``."""
        self.procs[port].send_signal(signal.SIGSTOP if paused else signal.SIGCONT)

    def _wait_ping(self, port: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if "PONG" in _cli(port, "ping", timeout=2):
                return
            time.sleep(0.05)
        raise RuntimeError(f"redis-server on {port} did not answer PING within {timeout} s")

    def wait_ok(self, timeout: float, ports: Optional[List[int]] = None) -> None:
        """Waits until every node of ``ports`` (default: all) reports cluster_state:ok."""
        deadline = time.monotonic() + timeout
        for p in ports or self.ports:
            while "cluster_state:ok" not in _cli(p, "cluster", "info", timeout=2):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the cluster did not reach cluster_state:ok within {timeout} s")
                time.sleep(0.1)

    def restart_node(self, port: int) -> None:
        self.start_node(port)
        self._wait_ping(port, 15.0)
        self.wait_ok(30.0)

    def port_of_key(self, key: str) -> int:
        """The port of the master serving ``key``'s slot."""
        slot = int(_cli(self.ports[0], "cluster", "keyslot", key).strip())
        for line in _cli(self.ports[0], "cluster", "nodes").splitlines():
            parts = line.split()
            if "master" not in parts[2]:
                continue
            port = int(parts[1].split("@")[0].rsplit(":", 1)[1])
            for r in parts[8:]:
                lo, _, hi = r.partition("-")
                if lo.isdigit() and int(lo) <= slot <= int(hi or lo):
                    return port
        raise RuntimeError(f"no master serves slot {slot}")

    def client(self):
        """A redis-py cluster client (for tests that reach into the store)."""
        from redis.cluster import RedisCluster as PyCluster

        return PyCluster(host="127.0.0.1", port=self.ports[0])

    def stop(self) -> None:
        for p, proc in list(self.procs.items()):
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.procs.clear()
        shutil.rmtree(self.dir, ignore_errors=True)
