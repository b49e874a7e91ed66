"""The namespace from a real SGLang server: ``python -m sglang.launch_server``
started on this CPU-only machine with HiCache and the KacheDB backend
(``--hicache-storage-backend dynamic`` and ``kachedb.sglang.hicache_config()``),
one server at a time, each in its own session, on one real daemon.

SGLang's launcher starts its real scheduler process; there
``run_scheduler_process`` loads SGLang's general plugins, publishes the
server arguments and builds the ``Scheduler``, whose cache controller creates
the KacheDB backend through SGLang's storage factory and registers its host
pool. A test plugin (``server_plugin.py``, found through an entry point on
``PYTHONPATH``; nothing installed) makes the two CUDA-only steps of HiCache
host memory work without CUDA, and probes the backend SGLang built once the
``Scheduler`` exists: its namespace fields, and a page round trip (lookup and
load of prompt P, then a store of P) through the server's own host pool.

Servers, in this order, on one model (a seeded random tiny Llama, safetensors):

* ``base``: ``--dtype bfloat16``;
* ``fp8``: ``--quantization fp8`` (FP8 weights; its forward needs a GPU, so
  it skips the startup warmup and serves no request);
* ``kv``: ``--kv-cache-dtype fp8_e5m2``;
* ``f32``: ``--dtype float32 --kv-cache-dtype bfloat16`` (the same host pool
  dtype and geometry as ``base``: only the server arguments differ);
* ``base-again``: ``base`` launched again.

Each server but ``fp8`` also serves a real request (a 600-token prompt,
greedy): SGLang's controller backs its pages up into KacheDB, and a later
server with the same namespace loads them from there instead of computing
them (``cached_tokens_details.storage``)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from engine_support import Daemon, _die_with_parent
from sglang_support import sglang_env

pytestmark = pytest.mark.timeout(5400)
HERE = Path(__file__).resolve().parent
STARTUP_TIMEOUT = 900
PAGE = 16
PROMPT = [(i * 37) % 500 + 3 for i in range(600)]  # 37 full pages and 8 tokens
PROMPT_PAGES = len(PROMPT) // PAGE
PROBE_PAGES = 4  # server_plugin.PROBE_PAGES

SERVERS = [
    ("base", ["--dtype", "bfloat16"], True),
    ("fp8", ["--dtype", "bfloat16", "--quantization", "fp8", "--skip-server-warmup"], False),
    ("kv", ["--dtype", "bfloat16", "--kv-cache-dtype", "fp8_e5m2"], True),
    ("f32", ["--dtype", "float32", "--kv-cache-dtype", "bfloat16"], True),
    ("base-again", ["--dtype", "bfloat16"], True),
]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(path: Path) -> str:
    """A seeded random tiny Llama (safetensors, bfloat16): real weights, so that
    the tokens it generates depend on the KV it attends to."""
    if (path / "model.safetensors").exists():
        return str(path)
    code = (
        "import sys, torch\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "torch.manual_seed(0)\n"
        "cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,\n"
        "                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,\n"
        "                  architectures=['LlamaForCausalLM'], torch_dtype='bfloat16')\n"
        "LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(sys.argv[1], safe_serialization=True)\n"
    )
    subprocess.run([sys.executable, "-c", code, str(path)], check=True, env=sglang_env())
    return str(path)


def _plugin(root: Path) -> Path:
    """The test plugin as SGLang discovers general plugins: a module and a
    ``*.dist-info/entry_points.txt`` in the ``sglang.srt.plugins`` group."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "kachedb_sglang_test_plugin.py").write_text((HERE / "server_plugin.py").read_text())
    info = root / "kachedb_sglang_test_plugin-0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kachedb-sglang-test-plugin\nVersion: 0\n")
    (info / "entry_points.txt").write_text(
        "[sglang.srt.plugins]\nkachedb_test = kachedb_sglang_test_plugin:register\n")
    return root


class Server:
    """``python -m sglang.launch_server`` in its own session (its scheduler and
    detokenizer processes with it); stopped by its PID, then its session."""

    def __init__(self, workdir, name, model, plugin, sock, args, seed):
        self.name = name
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / f"server-{name}.log"
        self.probe_path = workdir / f"server-{name}.probe.json"
        self.cmd = [
            sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--device", "cpu",
            "--model-impl", "transformers", "--skip-tokenizer-init", "--random-seed", "0",
            "--max-total-tokens", "2048", "--page-size", str(PAGE),
            "--enable-hierarchical-cache", "--hicache-ratio", "2",
            "--hicache-io-backend", "direct", "--hicache-mem-layout", "layer_first",
            "--hicache-storage-prefetch-policy", "wait_complete",
            "--hicache-storage-backend", "dynamic",
            "--hicache-storage-backend-extra-config", json.dumps(_hicache_config(sock)),
            "--host", "127.0.0.1", "--port", str(self.port), *args,
        ]
        self.env = sglang_env()
        self.env["PYTHONPATH"] = os.pathsep.join([str(plugin)] + [p for p in [self.env.get("PYTHONPATH")] if p])
        self.env["SGLANG_PLUGINS"] = "kachedb_test"
        self.env["KACHEDB_TEST_PROBE_OUT"] = str(self.probe_path)
        self.env["KACHEDB_TEST_PROBE_SEED"] = str(seed)
        self.proc = None

    def start(self):
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         env=self.env, cwd=str(self.log_path.parent), start_new_session=True,
                                         preexec_fn=_die_with_parent)
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while not (self.probe_path.exists() and self._answers()):
            if self.proc.poll() is not None:
                raise AssertionError(f"server {self.name} exited with {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"server {self.name} not up after {STARTUP_TIMEOUT} s:\n{self.log()}")
            time.sleep(1)
        return self

    def _answers(self):
        try:
            with urllib.request.urlopen(self.url + "/model_info", timeout=5) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def probe(self):
        return json.loads(self.probe_path.read_text())

    def log(self, n=8000):
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"

    def generate(self, input_ids, max_new_tokens=4):
        body = {"input_ids": input_ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
        req = urllib.request.Request(self.url + "/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                return json.loads(r.read())
        except (urllib.error.URLError, OSError) as e:
            raise AssertionError(f"{self.name}: /generate failed ({e}):\n{self.log()}")

    def stop(self):
        """SIGTERM to the launcher (SGLang then ends its children); SIGKILL to the
        session after 60 s; returns the PIDs still in the session (none)."""
        if self.proc is None:
            return []
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        left = _session(self.proc.pid)
        deadline = time.monotonic() + 30
        while left and time.monotonic() < deadline:
            time.sleep(1)
            left = _session(self.proc.pid)
        if left or self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the session this test created for it
            except ProcessLookupError:
                pass
            self.proc.wait()
        return left


def _session(sid):
    """The PIDs of the live processes in session ``sid`` (zombies excluded)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[3]) == sid and fields[0] != "Z":
            out.append(int(d.name))
    return out


def _hicache_config(sock):
    import kachedb.sglang

    return kachedb.sglang.hicache_config(sock)


def _wait_blocks(d, n, timeout=120):
    """Waits until the daemon holds ``n`` blocks (SGLang's controller backs a
    request's pages up after answering it); returns its stats."""
    deadline = time.monotonic() + timeout
    while True:
        st = d.stats()
        if st["blocks"] >= n or time.monotonic() > deadline:
            return st
        time.sleep(0.5)


@pytest.fixture(scope="module")
def servers(workdir):
    model = _model(workdir / "tiny-llama-random")
    plugin = _plugin(workdir / "sglang-plugin")
    d = Daemon(str(workdir / "server.sock")).start()
    out = {}
    try:
        probed, served = set(), set()  # namespaces with the probe's pages / a request's pages
        for i, (name, args, request) in enumerate(SERVERS):
            s = Server(workdir, name, model, plugin, d.socket, args, seed=100 + i)
            rec = out[name] = {}
            try:
                s.start()
                rec["launcher_pid"] = s.proc.pid
                rec["probe"] = s.probe()
                assert "error" not in rec["probe"], f"{name}: {rec['probe']['error']}\n{s.log()}"
                ns = rec["probe"]["stats"]["namespace_v1"]
                probed.add(ns)
                if request:
                    rec["response"] = s.generate(PROMPT)
                    served.add(ns)
                    # SGLang's controller backs the pages up after it answered
                    rec["daemon"] = _wait_blocks(d, len(probed) * PROBE_PAGES + len(served) * PROMPT_PAGES)
            finally:
                rec["left_running"] = s.stop()
                rec["log"] = s.log(400000)
        yield out, d.stats()
    finally:
        d.stop()


def _server(servers, name):
    return servers[0][name]


def test_the_backend_is_built_by_sglang_in_its_scheduler_process(servers):
    for name, args, _ in SERVERS:
        rec = _server(servers, name)
        p = rec["probe"]
        assert p["role"] == "scheduler", (name, p)
        assert p["ppid"] == rec["launcher_pid"] != p["pid"]  # a child of the launcher
        assert p["backends"] == ["KacheDBStorage"]
        assert p["host_pool"]["class"] == "MHATokenToKVPoolHost" and p["host_pool"]["layout"] == "layer_first"
        assert p["host_pool"]["page_size"] == PAGE
        st = p["stats"]
        assert st["refused"] is None and not st["tier_off"]
        # the namespace holds the server arguments SGLang published in that process
        assert st["fields"]["server"] == {**p["published"], "random_seed": None}
        assert "Creating dynamic storage backend 'kachedb'" in rec["log"]
        assert rec["left_running"] == [], f"{name}: processes left in the server's session"


def test_namespace_follows_the_launch_arguments(servers):
    server = {name: _server(servers, name)["probe"]["stats"]["fields"]["server"] for name, _, _ in SERVERS}
    assert server["base"]["dtype"] == "bfloat16" and server["base"]["quantization"] is None
    assert server["base"]["kv_cache_dtype"] == "auto"
    assert server["fp8"]["quantization"] == "fp8"
    assert server["kv"]["kv_cache_dtype"] == "fp8_e5m2"
    assert server["f32"]["dtype"] == "float32" and server["f32"]["kv_cache_dtype"] == "bfloat16"
    ns = {name: _server(servers, name)["probe"]["stats"]["namespace_v1"] for name, _, _ in SERVERS}
    assert ns["base-again"] == ns["base"]
    assert len({ns[n] for n in ("base", "fp8", "kv", "f32")}) == 4, ns
    # f32 differs from base in the server arguments alone: same host pool dtype and geometry
    pools_ = {n: _server(servers, n)["probe"]["stats"]["fields"]["pool"] for n in ("base", "f32")}
    assert pools_["base"] == pools_["f32"]


def test_same_launch_finds_the_pages_of_the_first(servers):
    base, again = _server(servers, "base")["probe"], _server(servers, "base-again")["probe"]
    assert base["read"]["exists"] == 0 and base["write"]["set"] == [True] * PROBE_PAGES
    assert again["read"]["exists"] == PROBE_PAGES and again["read"]["get"] == [True] * PROBE_PAGES
    assert again["read"]["digests"] == base["write"]["digests"]  # base's bytes
    assert again["stats"]["set_pages_present"] == PROBE_PAGES and again["stats"]["set_pages_stored"] == 0


def test_other_settings_find_nothing(servers):
    base = _server(servers, "base")["probe"]
    for name in ("fp8", "kv", "f32"):
        p = _server(servers, name)["probe"]
        # base (and the servers before) stored P; in this namespace it is missing
        assert p["read"]["exists"] == 0 and p["read"]["get"] == [False] * PROBE_PAGES, name
        assert p["write"]["set"] == [True] * PROBE_PAGES and p["stats"]["set_pages_stored"] == PROBE_PAGES
        assert p["write"]["digests"] != base["write"]["digests"]


def _storage_tokens(resp):
    details = resp["meta_info"].get("cached_tokens_details") or {}
    return details.get("storage", 0), details.get("storage_backend")


def test_a_request_is_served_from_the_pages_another_server_stored(servers):
    base, again = _server(servers, "base"), _server(servers, "base-again")
    assert base["response"]["meta_info"]["cached_tokens"] == 0
    assert base["daemon"]["blocks"] >= PROBE_PAGES + PROMPT_PAGES  # its controller backed the prompt up
    # a fresh server of the same launch loads the prompt's pages from KacheDB
    assert _storage_tokens(again["response"]) == (PROMPT_PAGES * PAGE, "KacheDBStorage")
    assert "HiCache prefetch success" in again["log"]
    assert again["response"]["output_ids"] == base["response"]["output_ids"]


def test_a_request_of_other_settings_loads_nothing(servers):
    for name in ("kv", "f32"):
        rec = _server(servers, name)
        assert rec["response"]["meta_info"]["cached_tokens"] == 0, (name, rec["response"]["meta_info"])
        assert _storage_tokens(rec["response"])[0] == 0


def test_daemon_holds_each_namespace_once(servers):
    _, st = servers
    # probe pages of 4 namespaces, the prompt's pages of 3 (base, kv, f32); base-again added nothing
    assert st["blocks"] == 4 * PROBE_PAGES + 3 * PROMPT_PAGES
    assert st["pins"] == 0 and st["reserved"] == 0
