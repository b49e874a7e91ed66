"""The side-by-side handoff benchmark (benchmarks/compare.py) in its CI size:
every transport runs for real, its consumer verifies the data, and the run
leaves no process or shared-memory segment behind.

Needs what CI installs: ``pip install ray redis hiredis matplotlib`` and
``apt-get install -y redis-server``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(REPO, "benchmarks")
SCRIPT = os.path.join(BENCHMARKS, "compare.py")
TRANSPORTS = ["kachedb", "tcp", "uds", "shm", "torch_mp", "redis", "ray"]
QUICK = {(65536, 200), (64 << 20, 1)}


def _missing() -> list:
    out = []
    for mod, how in (("torch", "pip install torch"), ("ray", "pip install ray"), ("redis", "pip install redis hiredis"),
                     ("matplotlib", "pip install matplotlib")):
        try:
            __import__(mod)
        except ImportError:
            out.append(how)
    if shutil.which("redis-server") is None:
        out.append("apt-get install -y redis-server")
    return out


def _our_processes(marker: str) -> list:
    found = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if marker in cmd:
                found.append((int(d), cmd[:200]))
    return found


@pytest.mark.timeout(300)
def test_quick_compare_runs_every_transport_and_cleans_up(tmp_path):
    missing = _missing()
    assert not missing, "the comparison benchmark needs: " + "; ".join(missing)
    shm_before = set(os.listdir("/dev/shm"))
    out_dir = tmp_path / "out"
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--quick", "--json", "--out", str(out_dir)],
        capture_output=True, text=True, timeout=280, cwd=REPO,
    )
    wall = time.monotonic() - t0
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stderr ---\n{proc.stderr[-6000:]}"
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    # stdout carries only JSON lines (Ray, Redis and the children write to stderr)
    assert len(rows) == len([ln for ln in proc.stdout.splitlines() if ln.strip()]), proc.stdout[:2000]

    results = [r for r in rows if "transport" in r]
    by = {(r["transport"], r["bytes"], r["count"]): r for r in results}
    for t in TRANSPORTS:
        for nbytes, count in QUICK:
            r = by.get((t, nbytes, count))
            assert r is not None, f"no result for {t} {nbytes}x{count}"
            assert "handoff_s" in r, f"{t} {nbytes}x{count}: {r}"
            assert r["verified"] is True, f"{t} {nbytes}x{count}: the consumer's data did not match"
            for k in ("handoff_s", "producer_s", "consumer_s"):
                assert r[k] > 0, (t, k, r)
            # end to end covers both sides' work
            assert r["handoff_s"] >= r["consumer_s"] * 0.99, r
            assert r["reps"] >= 3
            assert r["ratio_vs_kachedb"] == pytest.approx(
                r["handoff_s"] / by[("kachedb", nbytes, count)]["handoff_s"])

    # the copy floors: one per size, beside KacheDB's producer
    floors = {r["bytes"]: r for r in rows if "floor" in r}
    for nbytes, count in QUICK:
        f = floors[nbytes * count]
        assert f["memcpy_1t_s"] > 0 and f["memcpy_mt_s"] > 0 and f["threads"] >= 1, f
        prod = by[("kachedb", nbytes, count)]["producer_s"]
        assert f["kachedb_producer_s"] == prod
        assert f["kachedb_vs_floor"] == pytest.approx(min(f["memcpy_1t_s"], f["memcpy_mt_s"]) / prod)
        assert f["reaches"] in ("none", "memcpy on 1 thread", f"memcpy on {f['threads']} threads"), f

    cleanup = [r["cleanup"] for r in rows if "cleanup" in r]
    assert len(cleanup) == 1 and cleanup[0]["ok"], cleanup
    assert not cleanup[0]["leftover_processes"] and not cleanup[0]["leftover_shm"]

    # independent check: no segment of ours in /dev/shm, no process naming the run's temp dir
    new = set(os.listdir("/dev/shm")) - shm_before
    assert not [n for n in new if n.startswith(("kcmp", "torch_", "plasma"))], new
    assert not _our_processes("/tmp/kcmp-"), _our_processes("/tmp/kcmp-")

    # the artefacts the docs are made of
    md = (out_dir / "compare_table.md").read_text()
    assert "| KacheDB |" in md and "Ray object store" in md and "Cleanup check: every process" in md
    assert "Copy floors" in md and "| memcpy, 1 thread |" in md
    png = (out_dir / "compare_chart.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    jl = (out_dir / "compare_results.jsonl").read_text().splitlines()
    assert len(jl) == len(rows)
    assert wall < 240, f"the quick comparison took {wall:.0f} s"


def test_sizes_flag_parses_and_rejects():
    sys.path.insert(0, BENCHMARKS)
    try:
        from compare import parse_size
    finally:
        sys.path.remove(BENCHMARKS)

    c = parse_size("64KiBx10000")
    assert (c.nbytes, c.count, c.shape) == (65536, 10000, (2, 1, 8, 16, 128))
    c = parse_size("2GiB")
    assert (c.nbytes, c.count, c.shape) == (2 << 30, 1, (2, 32, 8, 16384, 128))
    with pytest.raises(ValueError):
        parse_size("12 parsecs")
    proc = subprocess.run([sys.executable, SCRIPT, "--sizes", "3B"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "multiple of 4 KiB" in proc.stderr


def test_copy_floor_copies_and_says_which_floor_the_put_reaches():
    sys.path.insert(0, BENCHMARKS)
    try:
        from handoff.floors import REACH, add_floor_ratios, measure_floor
    finally:
        sys.path.remove(BENCHMARKS)

    # an odd size (not a multiple of the threads' page-aligned shares): the copy
    # checks its own bytes and raises if they differ
    f = measure_floor((1 << 20) + 4096, 3)
    assert f["memcpy_1t_s"] > 0 and f["memcpy_mt_s"] > 0 and f["reps"] >= 3
    assert f["memcpy_1t_min_s"] <= f["memcpy_1t_s"] and f["memcpy_mt_min_s"] <= f["memcpy_mt_s"]

    floors = [{"size": s, "threads": 2, "memcpy_1t_s": 0.010, "memcpy_mt_s": 0.006} for s in ("a", "b", "c", "d")]
    results = [{"transport": "kachedb", "size": "a", "producer_s": 0.006},
               {"transport": "kachedb", "size": "b", "producer_s": 0.010},
               {"transport": "kachedb", "size": "c", "producer_s": 0.030},
               {"transport": "tcp", "size": "d", "producer_s": 0.001}]
    add_floor_ratios(floors, results)
    a, b, c, d = floors
    assert a["reaches"] == "memcpy on 2 threads" and a["kachedb_vs_floor"] == pytest.approx(1.0)
    assert b["reaches"] == "memcpy on 1 thread" and b["kachedb_vs_floor"] == pytest.approx(0.6)
    assert b["kachedb_vs_memcpy_1t"] == pytest.approx(1.0)
    assert c["reaches"] == "none" and c["kachedb_vs_floor"] == pytest.approx(0.2)
    assert 0.006 * REACH < 0.010  # b is past the 2-thread floor's reach
    assert "reaches" not in d  # no KacheDB result for that size
