"""benchmarks/python_ops.py (the Python-side figures) in its quick size, against
a daemon it starts and against a given one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # harness/
from harness.daemon import Daemon  # noqa: E402

import kachedb  # noqa: E402

pytest.importorskip("torch")

SCRIPT = os.path.join(REPO, "benchmarks", "python_ops.py")


def run_bench(*args, timeout=280):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def daemon():
    """A 16 MiB daemon on a private socket, stopped afterwards."""
    with Daemon(size="16MiB") as d:
        yield d.socket


@pytest.mark.timeout(300, method="thread")
def test_bench_quick_json_smoke():
    out = run_bench("--quick", "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    by = {}
    for rec in lines:
        by.setdefault(rec["bench"], []).append(rec)
    for name in ("py_ping_rtt", "py_get_rtt_native", "py_get_rtt"):
        (rec,) = by[name]
        assert rec["p50_ns"] > 0 and rec["p99_ns"] >= rec["p50_ns"]
    assert by["py_get_rtt_native"][0]["call"] == "NativeClient.get"
    views = by["py_get_view"]
    assert [v["bytes"] for v in views] == [1 << 20, 64 << 20]
    for v in views:
        assert "skipped" in v or v["p50_ns"] > 0
    (put,) = by["py_put"]
    assert put["bytes"] == 64 << 20
    if "skipped" not in put:
        assert put["gbps"] > 0 and put["torch_copy_gbps"] > 0
        assert put["ratio"] == pytest.approx(put["gbps"] / put["torch_copy_gbps"])
    (many,) = by["py_get_many"]
    assert many["batch"] == 64 and many["ops_per_s"] > 0 and many["ops_per_s_with_release"] > 0
    (idle,) = by["py_after_idle"]
    assert (idle["gaps"], idle["gap_s"]) == (3, 0.2)
    for k in ("warm_get_p50_ns", "first_get_p50_ns", "second_get_p50_ns", "first_native_get_p50_ns",
              "first_ping_p50_ns", "pipe_echo_p50_ns", "pipe_echo_view_p50_ns"):
        assert idle[k] > 0, k
    assert idle["first_vs_warm"] == pytest.approx(idle["first_get_p50_ns"] / idle["warm_get_p50_ns"])
    assert idle["first_vs_floor"] == pytest.approx(idle["first_get_p50_ns"] / idle["pipe_echo_p50_ns"])
    assert idle["client_wakeups_per_request"] >= 0
    assert 0 <= idle["daemon_idle_cpu_pct"] < 100  # the daemon started for the run is this user's: visible
    (prefix,) = by["py_get_prefix"]
    assert prefix["us"] > 0 and prefix["ratio"] == pytest.approx(prefix["us"] / prefix["torch_views_us"])
    # The same from the rows of one tensor (how many exports the views took depends on where
    # the daemon put the blocks: one where they lie a fixed stride apart).
    (strided,) = by["py_get_prefix_strided"]
    assert 1 <= strided["exports"] <= 128 and 1 <= prefix["exports"] <= 128
    assert strided["ratio"] == pytest.approx(strided["us"] / strided["torch_views_us"])
    (small,) = by["py_put_many_small"]
    assert small["blocks"] == 200 and small["block_bytes"] == 64 << 10
    assert small["ratio"] == pytest.approx(small["put_many_s"] / small["torch_copy_loop_s"])
    assert small["target_ratio"] == 1.3
    # the daemon this run started on one CPU, the benchmark's thread on another, for both
    cpus = sorted(os.sched_getaffinity(0))
    want = f"daemon CPU {cpus[1]}, client CPU {cpus[0]}" if len(cpus) >= 2 else "unpinned"
    assert prefix["placement"] == want and small["placement"] == want


@pytest.mark.timeout(300, method="thread")
def test_small_section_alone_puts_a_thousand_blocks():
    out = run_bench("--json", "--only", "small")
    assert out.returncode == 0, out.stderr[-3000:]
    recs = {r["bench"]: r for r in map(json.loads, filter(str.strip, out.stdout.splitlines()))}
    assert sorted(recs) == ["py_get_prefix", "py_get_prefix_strided", "py_put_many_small"]
    assert recs["py_put_many_small"]["blocks"] == 1000  # the daemon it starts holds two generations of them


@pytest.mark.timeout(300, method="thread")
def test_only_runs_the_named_sections():
    out = run_bench("--quick", "--json", "--only", "idle", "--idle-gaps", "2", "--idle-gap-s", "0.05")
    assert out.returncode == 0, out.stderr[-3000:]
    benches = [json.loads(line)["bench"] for line in out.stdout.splitlines() if line.strip()]
    assert benches == ["py_after_idle"]
    rec = json.loads(out.stdout.splitlines()[0])
    assert (rec["gaps"], rec["gap_s"]) == (2, 0.05)


@pytest.mark.parametrize(
    "args, says",
    [
        (["--only", "idle,nope"], "unknown section(s) nope"),
        (["--idle-gaps", "0"], "--idle-gaps must be at least 1"),
        (["--idle-gap-s", "-1"], "--idle-gap-s must be a positive number"),
    ],
)
def test_bad_options_are_refused_with_a_reason(args, says):
    out = run_bench("--quick", *args, timeout=120)
    assert out.returncode != 0
    assert says in out.stderr


@pytest.mark.timeout(300, method="thread")
def test_bench_against_a_given_socket_and_table_output(daemon):
    out = run_bench("--quick", "--socket", daemon)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "GET-hit round trip" in out.stdout and "target" in out.stdout
    # the 16 MiB daemon cannot hold the 64 MiB block nor the 64 MiB put: said, not crashed
    assert "64 MiB as a torch view      skipped: larger than the daemon's 16 MiB megaslab" in out.stdout
    assert "1 MiB as a torch view      p50" in out.stdout  # but the 1 MiB one fits
    assert "PUT 64 MiB  skipped" in out.stdout
    with kachedb.connect(daemon) as kc:
        assert kc.stats()["pins"] == 0


def test_help():
    out = run_bench("--help", timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--quick" in out.stdout and "--json" in out.stdout and "--only" in out.stdout
