"""KacheDB behind real LMCache engines, each in its own process, on one real
daemon (target/release/kachedb).

Engine 1 stores prompts' KV (through its local CPU tier and, asynchronously,
the KacheDB plugin); engine 2, a fresh process whose local CPU tier is empty,
looks them up in KacheDB only (LMCache's lookup restricted to the plugin's
backend) and retrieves them byte-equal, which the daemon's GET hit counter
confirms. LMCache only logs an error when a remote plugin fails to build and
carries on with its local tier, so every test checks that the backend is the
KacheDB connector and that the daemon saw the traffic.
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import lmcache_support as S

pytestmark = pytest.mark.timeout(900)

HERE = Path(__file__).resolve().parent

#: (tokens, seed) of the prompts engine 1 stores. 200 tokens are 12 full chunks
#: of 16 and a partial chunk of 8.
PROMPT = (200, 1)
SECOND = (64, 2)
#: Bad reference counting shows up in LMCache's log as these.
REFCOUNT_ERRORS = ("Double free", "is negative", "being garbage collected with ref_count")


def run_engine(workdir: Path, name: str, spec: dict, timeout_s: float = 600) -> dict:
    """Runs engine_proc.py in a fresh process; it must exit by itself with 0."""
    out = workdir / f"{name}.json"
    spec = dict(spec, out=str(out))
    spec_path = workdir / f"{name}.spec.json"
    spec_path.write_text(json.dumps(spec))
    log_path = workdir / f"{name}.log"
    env = dict(os.environ, PYTHONHASHSEED="0")
    with open(log_path, "wb") as log:
        p = subprocess.Popen(
            [sys.executable, str(HERE / "engine_proc.py"), str(spec_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=str(workdir),
        )
        try:
            rc = p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            pytest.fail(f"engine process {name} did not exit within {timeout_s} s:\n{log_path.read_text()[-4000:]}")
    text = log_path.read_text(errors="replace")
    assert rc == 0, f"engine process {name} exited with {rc}:\n{text[-4000:]}"
    for bad in REFCOUNT_ERRORS:
        assert bad not in text, f"engine process {name} logged {bad!r}:\n{text[-4000:]}"
    return json.loads(out.read_text())


def assert_kachedb_serving(result: dict) -> None:
    assert S.REMOTE_BACKEND in result["backends"], result["backends"]
    assert result["connector"].startswith("<KacheDBConnector kachedb"), result["connector"]


#: The megaslab of this module's daemon (the `daemon` fixture, conftest.py).
DAEMON_SIZE = "256MiB"


@pytest.fixture(scope="module")
def stored(daemon, workdir):
    result = run_engine(workdir, "store", {"scenario": "store", "socket": daemon.socket, "prompts": [PROMPT, SECOND]})
    return result


@pytest.fixture(scope="module")
def loaded(daemon, stored, workdir):
    spec = {"scenario": "load", "socket": daemon.socket, "prompt": PROMPT, "short": 40, "extra": 40}
    return run_engine(workdir, "load", spec)


def chunks(n_tokens: int) -> int:
    return -(-n_tokens // S.CHUNK_TOKENS)


def test_engine_stores_through_kachedb(stored):
    assert_kachedb_serving(stored)
    # The asynchronous puts landed in the daemon (polled with a deadline).
    for (n, _), landed in zip([PROMPT, SECOND], stored["landed"]):
        assert landed["expected"] == chunks(n)
        assert landed["present"] == landed["expected"], landed
    total = chunks(PROMPT[0]) + chunks(SECOND[0])
    # LMCache's reference-count contract: its CPU tier's chunks are back at one reference each
    assert stored["local_ref_counts"] == [1] * total
    assert stored["stats"]["stored_chunks"] == total
    assert stored["daemon"]["blocks"] == total
    assert stored["daemon"]["commits"] == total
    # the prompt's KV bytes: 2 (K, V) x layers x tokens x hidden x 2 (bf16)
    token_bytes = 2 * S.NUM_LAYERS * S.NUM_HEADS * S.HEAD_SIZE * 2
    assert stored["stats"]["stored_bytes"] == (PROMPT[0] + SECOND[0]) * token_bytes


def test_fresh_engine_retrieves_byte_equal_through_kachedb(loaded):
    assert_kachedb_serving(loaded)
    n = PROMPT[0]
    assert loaded["num_chunks"] == chunks(n)
    assert loaded["local_lookup_before"] == 0  # a fresh process: LMCache's CPU tier is empty
    assert loaded["remote_lookup"] == n  # the full prefix, from KacheDB alone
    assert loaded["retrieved_tokens"] == n
    assert loaded["byte_equal"]
    # every chunk, the partial last one included, was a GET hit in the daemon
    assert loaded["get_hits_delta"] == chunks(n)
    # LMCache keeps what it fetched in its local tier
    assert loaded["local_lookup_after"] == n


def test_partial_chunks(loaded):
    # A prompt ending inside a stored chunk hits its whole chunks only.
    assert loaded["short_remote_lookup"] == (40 // S.CHUNK_TOKENS) * S.CHUNK_TOKENS
    # A prompt extending the stored one: the stored partial chunk (8 tokens) is
    # not the 16-token chunk the longer prompt has there.
    full = (PROMPT[0] // S.CHUNK_TOKENS) * S.CHUNK_TOKENS
    assert loaded["long_remote_lookup"] == full
    assert loaded["long_retrieved_tokens"] == full
    assert loaded["long_mask_is_prefix"]
    assert loaded["long_byte_equal"]
    assert loaded["long_untouched_zero"]
    assert loaded["long_get_hits_delta"] == full // S.CHUNK_TOKENS


def test_misses(loaded):
    assert loaded["miss_remote_lookup"] == 0
    assert loaded["miss_retrieved_tokens"] == 0
    assert loaded["miss_not_found_delta"] > 0  # the daemon was asked, and said no
    assert loaded["miss_get_hits_delta"] == 0


def test_async_contains_and_get_non_blocking(loaded):
    n = chunks(PROMPT[0])
    assert loaded["async_contains"] == n
    assert loaded["async_contains_miss"] == 0
    assert loaded["async_got"] == n
    assert loaded["async_byte_equal"]
    assert loaded["async_ref_counts"] == [1] * n  # the caller's reference, and only it
    # chunk 3 deleted from the daemon: the prefix before it
    assert loaded["async_got_after_delete"] == 3
    assert loaded["remote_lookup_after_delete"] == 3 * S.CHUNK_TOKENS


def test_other_model_or_namespace_gets_no_hits(daemon, stored, workdir):
    base = {"scenario": "lookup", "socket": daemon.socket, "prompt": SECOND}
    same = run_engine(workdir, "lookup-same", dict(base, tenant="team-l"))
    # (a tenant's row is taken by the next new name once it has no client and no bytes: read it now)
    team_l = {t["name"]: t for t in daemon.stats()["tenants"]}.get("team-l")
    assert_kachedb_serving(same)
    assert same["remote_lookup"] == SECOND[0]  # the control: this lookup can hit
    other = run_engine(workdir, "lookup-other-model", dict(base, model="kachedb-test/other-model"))
    assert_kachedb_serving(other)
    assert other["remote_lookup"] == 0
    assert other["stats"]["lookups"] >= 1  # KacheDB was asked
    salted = run_engine(workdir, "lookup-other-namespace", dict(base, namespace="tenant-b"))
    assert_kachedb_serving(salted)
    assert salted["remote_lookup"] == 0
    # Each plugin connected as its tenant: the `tenant` option, else the namespace label.
    assert team_l is not None and team_l["lookup_hits"] >= chunks(SECOND[0]), team_l
    rows = {t["name"]: t for t in daemon.stats()["tenants"]}
    assert rows["tenant-b"]["lookup_misses"] >= 1 and rows["tenant-b"]["lookup_hits"] == 0, rows.get("tenant-b")


def test_no_pins_or_reservations_left(daemon, loaded):
    s = daemon.stats()
    assert s["pins"] == 0
    assert s["reserved"] == 0
    assert loaded["daemon"]["pins"] == 0
    assert s["invariants_ok"]


def test_absent_daemon_leaves_the_engine_on_its_local_tier(workdir):
    with tempfile.TemporaryDirectory(prefix="kdb-lmc-none-", dir="/tmp") as d:
        spec = {"scenario": "no_daemon", "socket": os.path.join(d, "nobody.sock"), "prompt": SECOND}
        r = run_engine(workdir, "no-daemon", spec)
    assert r["connector_is_none"]
    assert r["remote_lookup"] == 0
    assert r["local_lookup"] == SECOND[0]
    assert r["retrieved_tokens"] == SECOND[0]
    assert r["byte_equal"]


def test_daemon_going_away_and_coming_back(workdir):
    with tempfile.TemporaryDirectory(prefix="kdb-lmc-restart-", dir="/tmp") as d:
        os.chmod(d, 0o700)
        spec = {"scenario": "daemon_restart", "socket": os.path.join(d, "d.sock"), "prompt": PROMPT, "second": SECOND,
                "retry_seconds": 0.5}
        r = run_engine(workdir, "daemon-restart", spec)
    assert r["connector"].startswith("<KacheDBConnector kachedb")
    assert r["landed_before"]["present"] == chunks(PROMPT[0])
    assert r["stop_rc"] == 0
    # gone: misses and skipped stores, the engine unharmed
    assert r["down_remote_lookup"] == 0
    assert r["down_retrieved_tokens"] == 0
    assert r["down_local_lookup"] == SECOND[0]
    assert r["stats"]["tier_off"] >= 1
    assert r["stats"]["store_skipped_off"] >= chunks(SECOND[0])
    # back: reconnected, stores land again; the new daemon did not inherit the old chunks
    assert r["stats"]["reconnects"] >= 1
    assert r["landed_after"]["present"] == chunks(SECOND[0])
    assert r["up_remote_lookup"] == SECOND[0]
    assert r["up_remote_lookup_old"] == 0
    assert r["final_stop_rc"] == 0
