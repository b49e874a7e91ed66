"""Dynamo's standalone KV indexer (``python -m dynamo.indexer``, ai-dynamo-runtime 1.6.1) as a
process of the test, subscribed to the daemon's KV events as one worker (docs/events.md,
"Pointing Dynamo's indexer at a node").

The indexer runs from its own virtual environment (``make dynamo-env``: .venv-dynamo), named by
``$KACHEDB_DYNAMO_PY``; tests/dynamo is collected only where that variable is set
(``make test-dynamo`` sets it). Its HTTP API (1.6.1):

* ``POST /register`` ``{instance_id, endpoint, replay_endpoint, model_name, block_size}``: one
  ZMQ listener per worker (dp rank 0), with vLLM's replay protocol on ``replay_endpoint``;
* ``POST /query`` ``{token_ids, model_name}``: the indexer hashes the tokens into blocks of its
  ``block_size`` (its own hash of each block's tokens) and answers, per worker, how many
  leading tokens it holds: ``scores`` counts the device (GPU) tier only; ``instances[W]``
  has ``longest_matched`` (every tier), ``gpu``, ``cpu`` and ``disk`` (each counting the tiers
  above it too). The daemon's blocks are host memory (medium ``CPU``), so a node shows up in
  ``instances[W]["cpu"]``;
* ``GET /dump``: the stored blocks as events (``block_hash``: the event's; ``tokens_hash``:
  the indexer's own hash of the tokens).
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from engine_support import _die_with_parent
from kv_events_support import free_port

#: The model name the tests register the node's worker under (the indexer's key, with the routing group).
MODEL = "kachedb-test"


def events_node(socket: Path, size: str) -> Tuple[Any, str, str, int]:
    """The real daemon on ``socket`` publishing its KV events (PUB and replay endpoints on free
    loopback ports) and its metrics (a free port), started: (daemon, PUB, replay, metrics port)."""
    from engine_support import daemon_bin
    from harness.daemon import Daemon

    pub, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    http = free_port()
    extra = ["--events-endpoint", pub, "--events-replay-endpoint", rep, "--metrics-addr", f"127.0.0.1:{http}"]
    return Daemon(str(socket), size=size, extra=extra, binary=daemon_bin()).start(), pub, rep, http


def wait_subscribers(http: int, n: int, indexer: "Indexer") -> None:
    """Waits until the node on metrics port ``http`` has ``n`` subscribers (a liveness bound)."""
    deadline = time.monotonic() + 60
    while metric(http, "kachedb_events_subscribers") < n and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric(http, "kachedb_events_subscribers") >= n, indexer.log()


def dynamo_python() -> Optional[str]:
    """The python of the Dynamo environment (``$KACHEDB_DYNAMO_PY``), or None."""
    py = os.environ.get("KACHEDB_DYNAMO_PY")
    return py if py and os.path.exists(py) else None


class Indexer:
    """``python -m dynamo.indexer --port PORT --threads 1``; output in ``log_path``."""

    def __init__(self, log_path: Path, python: Optional[str] = None) -> None:
        self.python = python or dynamo_python()
        assert self.python, "KACHEDB_DYNAMO_PY is not set (make dynamo-env; make test-dynamo sets it)"
        self.port = free_port()
        self.log_path = log_path
        self.proc: Optional[subprocess.Popen] = None

    def start(self, timeout_s: float = 60.0) -> "Indexer":
        env = dict(os.environ, DYN_LOG=os.environ.get("DYN_LOG", "info"))
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [self.python, "-m", "dynamo.indexer", "--port", str(self.port), "--threads", "1"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                start_new_session=True, preexec_fn=_die_with_parent,
            )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the indexer exited with {self.proc.returncode}:\n{self.log()}")
            try:
                self.http("GET", "/workers")
                return self
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the indexer did not answer within {timeout_s} s:\n{self.log()}")
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> "Indexer":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def log(self) -> str:
        try:
            return self.log_path.read_bytes()[-6000:].decode(errors="replace")
        except OSError:
            return "(no log)"

    def http(self, method: str, path: str, body: Any = None) -> Tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}", method=method, data=data, headers={"content-type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")

    def register(self, worker: int, endpoint: str, replay: Optional[str], block_size: int, model: str = MODEL) -> None:
        """The node as worker ``worker`` (dp rank 0) of ``model``, its KV events at ``endpoint``."""
        body: Dict[str, Any] = {"instance_id": worker, "endpoint": endpoint, "model_name": model, "block_size": block_size}
        if replay is not None:
            body["replay_endpoint"] = replay
        status, answer = self.http("POST", "/register", body)
        assert status == 201, (status, answer)

    def query(self, tokens: Sequence[int], model: str = MODEL) -> Dict[str, Any]:
        status, answer = self.http("POST", "/query", {"token_ids": list(tokens), "model_name": model})
        assert status == 200, (status, answer)
        return answer

    def matched(self, tokens: Sequence[int], worker: int, model: str = MODEL) -> Dict[str, int]:
        """Worker ``worker``'s overlap with ``tokens``, in tokens: ``longest_matched`` (every
        tier), ``gpu``, ``cpu``, ``disk`` (0 where the indexer holds none of it) and ``score``
        (the device-tier figure of ``scores``)."""
        answer = self.query(tokens, model)
        inst = answer.get("instances", {}).get(str(worker), {})
        out = {k: int(inst.get(k, 0)) for k in ("longest_matched", "gpu", "cpu", "disk")}
        out["score"] = int(answer.get("scores", {}).get(str(worker), {}).get("0", 0))
        return out

    def dump(self) -> Dict[str, Any]:
        status, answer = self.http("GET", "/dump")
        assert status == 200, (status, answer)
        return answer

    def wait_matched(
        self,
        tokens: Sequence[int],
        worker: int,
        want: int,
        timeout_s: float = 30.0,
        key: str = "longest_matched",
        model: str = MODEL,
    ) -> Tuple[int, float]:
        """Polls until worker ``worker``'s ``key`` overlap with ``tokens`` is ``want`` tokens;
        returns (the last figure, seconds waited). A liveness bound, not a timing assertion:
        the caller asserts the figure."""
        t0 = time.monotonic()
        got = -1
        while True:
            got = self.matched(tokens, worker, model)[key]
            if got == want or time.monotonic() - t0 > timeout_s:
                return got, time.monotonic() - t0
            time.sleep(0.002)


def metric(port: int, name: str) -> float:
    """The value of ``name`` on the daemon's ``/metrics`` (``--metrics-addr 127.0.0.1:PORT``)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} missing from /metrics")


def percentile(xs: List[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def evict_from_the_tail(
    kc: Any,
    sub: Any,
    indexer: Indexer,
    worker: int,
    tokens: Sequence[int],
    chain: Sequence[int],
    block_tokens: int,
    filler_bytes: int,
    first_filler: int,
    model: str = MODEL,
) -> Tuple[List[float], int]:
    """Puts blocks of ``filler_bytes`` (int keys from ``first_filler`` on, no parent) until the
    daemon has evicted every block of ``chain`` (the prompt's block hashes, first to last), and
    after each eviction of one of them waits for the indexer's overlap with ``tokens`` to be the
    leading blocks still held. What the daemon holds is read from ``sub`` (a
    ``kv_events_support.Subscriber`` of the same daemon: its index is the daemon's), not by a
    LOOKUP, which would make the chain the most recently used and the fillers evict each other.
    After each put, ``sub`` is waited for until it holds that filler: the stream is in order, so
    an eviction the put made is applied by then. Returns (for each eviction, the seconds from the
    return of the put that made it to the indexer's new answer; the next free filler key).
    Asserts each new answer."""

    def leading() -> int:
        with sub.changed:
            n = 0
            for h in chain:
                if h not in sub.index:
                    break
                n += 1
            return n

    assert sub.saw(chain[-1], 30.0), "the subscriber did not see the prompt stored"
    held = leading()
    assert held == len(chain), (held, len(chain))
    delays: List[float] = []
    key = first_filler
    # Page-aligned, so each filler takes the pages its bytes need and no more (one at the
    # end of a page would take one page more and could evict two pages at once).
    buf = bytearray(filler_bytes + 4096)
    start = -ctypes.addressof(ctypes.c_char.from_buffer(buf)) % 4096
    filler = memoryview(buf)[start : start + filler_bytes]
    while held > 0:
        kc.put(key, filler)
        t0 = time.monotonic()
        assert sub.saw(key, 30.0), "the subscriber did not see a block stored"
        key += 1
        now = leading()
        if now == held:
            continue
        got, _ = indexer.wait_matched(tokens, worker, now * block_tokens, model=model)
        delays.append(time.monotonic() - t0)
        assert got == now * block_tokens, (got, now, indexer.log())
        held = now
    return delays, key
