"""examples/prefill_savings.py at CI size, run as a user would (a subprocess):
the KV cache of a prompt computed in one process is reused by another through
KacheDB, with the same greedy tokens and allclose first-step logits as a cold
prefill, and nothing (daemon, workers) left running afterwards."""
import json
import os
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

pytest.importorskip("torch")
try:
    import transformers  # noqa: F401
except ImportError:  # a CI dependency (Makefile PY_DEPS): fail loudly, do not skip
    pytest.fail("examples/prefill_savings.py needs transformers: pip install transformers (or make setup)",
                pytrace=False)

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "prefill_savings.py"
TIMEOUT = 420  # s; the CI-size run takes ~30 s on a loaded 2-core machine, mostly process start-up
TAG_VAR = "KACHEDB_PREFILL_TEST_TAG"

pytestmark = pytest.mark.timeout(TIMEOUT + 120)


def processes_tagged(tag: str) -> list:
    """Processes whose environment carries ``TAG_VAR=tag``: everything the example
    started (its workers and the daemon inherit the environment)."""
    needle = f"{TAG_VAR}={tag}".encode()
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in env and state != "Z":
            found.append(int(pid))
    return found


def kill_all(pids: list) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


@pytest.fixture(scope="module")
def small_run():
    """Runs the example once at CI size with --json; yields (returncode, figures
    by path, other records, stderr, leftover pids)."""
    tag = uuid.uuid4().hex
    env = dict(os.environ, **{TAG_VAR: tag}, PYTHONUNBUFFERED="1")
    with tempfile.TemporaryDirectory(prefix="kdb-prefill-test-") as tmp:
        sock = os.path.join(tmp, "k.sock")
        proc = subprocess.Popen(
            [sys.executable, str(EXAMPLE), "--small", "--json", "--socket", sock],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp,
        )
        try:
            out, err = proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)  # lets the example stop its daemon and workers
            try:
                out, err = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            kill_all(processes_tagged(tag))
            pytest.fail(f"the example did not finish within {TIMEOUT} s; stderr:\n{err[-4000:]}")
        left = processes_tagged(tag)
        kill_all(left)  # do not leak into the rest of the suite, but report it below
        socket_left = os.path.exists(sock)
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    paths = {r["path"]: r for r in records if "path" in r}
    others = [r for r in records if "path" not in r]
    yield proc.returncode, paths, others, err, left, socket_left


def test_runs_and_reports_every_path(small_run):
    code, paths, others, err, _, _ = small_run
    assert code == 0, f"exit code {code}; stderr:\n{err[-4000:]}"
    assert set(paths) == {"cold", "kachedb", "kachedb_concat", "tcp"}
    kinds = {r.get("figure") for r in others} | {"summary" for r in others if r.get("summary")}
    assert {"setup", "producer", "summary"} <= kinds
    for name, fig in paths.items():
        assert fig["ttft_s"] > 0, name
        assert fig["kv_transfer_s"] >= 0, name
        assert len(fig["tokens"]) == 8, name


def test_warm_paths_match_cold(small_run):
    _, paths, _, err, _, _ = small_run
    cold = paths["cold"]
    for name in ("kachedb", "kachedb_concat", "tcp"):
        fig = paths[name]
        assert fig["tokens"] == cold["tokens"], f"{name}: greedy tokens differ from the cold path's"
        assert fig["tokens_match_cold"], name
        assert fig["logits_allclose_cold"], \
            f"{name}: first-step logits not allclose (max diff {fig['max_abs_logit_diff']})"
        assert fig["max_abs_logit_diff"] <= 1e-4, name


def test_kachedb_served_the_prefix(small_run):
    _, paths, others, _, _, _ = small_run
    setup = next(r for r in others if r.get("figure") == "setup")
    producer = next(r for r in others if r.get("figure") == "producer")
    summary = next(r for r in others if r.get("summary"))
    kd = paths["kachedb"]
    blocks = setup["prompt_len"] // setup["block_size"]
    assert producer["blocks"] == blocks
    assert kd["hit_blocks"] == blocks > 0
    assert kd["cached_tokens"] == blocks * setup["block_size"]
    assert kd["prefill_tokens"] == setup["suffix_len"]
    assert kd["kv_bytes"] == producer["kv_bytes"] > 0
    assert paths["tcp"]["hit_blocks"] == blocks
    stats = summary["daemon_stats"]
    assert stats["lookup_hits"] > 0 and stats["get_hits"] > 0
    # The producer stored its blocks as one chain: each after the one before it.
    assert stats["chained_blocks"] == blocks - 1 and stats["parents_missing"] == 0
    assert stats["pins"] == 0, "views outlived the request that used them"
    assert kd["pins_after"] == 0
    assert summary["kachedb_served_hits"] and summary["tokens_identical"] and summary["logits_allclose"]


def test_nothing_left_running(small_run):
    _, _, others, _, left, socket_left = small_run
    setup = next(r for r in others if r.get("figure") == "setup")
    summary = next(r for r in others if r.get("summary"))
    assert setup["daemon_started"]
    assert summary["daemon_stopped"] is True
    assert summary["processes_left"] == []
    assert not os.path.exists(f"/proc/{setup['daemon_pid']}") or _is_zombie(setup["daemon_pid"]), \
        f"daemon pid {setup['daemon_pid']} still running"
    assert left == [], f"processes started by the example still running: {left}"
    assert not socket_left, "the daemon's socket was left behind"


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.timeout(300)
def test_stops_its_daemon_and_workers_on_error():
    """A run that fails after the daemon started (a --model directory with a config
    but no weights: the parent reads the config, process A fails to load the
    weights) exits non-zero and still stops the daemon and its workers."""
    from transformers import LlamaConfig

    tag = uuid.uuid4().hex
    env = dict(os.environ, **{TAG_VAR: tag})
    with tempfile.TemporaryDirectory(prefix="kdb-prefill-test-") as tmp:
        model_dir = os.path.join(tmp, "weightless")
        LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=1).save_pretrained(model_dir)
        sock = os.path.join(tmp, "k.sock")
        proc = subprocess.run(
            [sys.executable, str(EXAMPLE), "--small", "--json", "--model", model_dir, "--socket", sock],
            capture_output=True, text=True, env=env, cwd=tmp, timeout=240,
        )
        left = processes_tagged(tag)
        kill_all(left)
        socket_left = os.path.exists(sock)
    assert proc.returncode != 0
    assert "process A" in proc.stderr, proc.stderr[-3000:]
    setup = [json.loads(line) for line in proc.stdout.splitlines() if '"figure": "setup"' in line]
    assert setup and setup[0]["daemon_started"], "the run failed before it started its daemon"
    assert left == [], f"processes left after a failed run: {left}"
    assert not socket_left
