"""The pause clients see when the daemon is taken over (`kachedb serve --takeover`,
docs/takeover.md).

Starts a daemon (target/release/kachedb), fills it with blocks, starts client
processes doing GETs (and a PUT every 16th operation) as fast as they can, then
takes the daemon over N times. Each client notes every operation slower than
0.2 ms with its start time (CLOCK_MONOTONIC, the same in every process). For
each takeover it prints the handover time the new daemon reports and the longest
client operation overlapping it; the same-run baseline is the longest operation
in a window of the same length just before that takeover.

    python benchmarks/takeover.py [--takeovers 20] [--clients 4] [--blocks 2000] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def client(sock: str, wid: int, blocks: int, stop_path: str, ready_path: str, out_path: str) -> None:
    import torch

    import kachedb

    kc = kachedb.connect(sock)
    slow = []  # (start, seconds) of operations over 0.2 ms
    ops = errors = 0
    i = wid
    value = torch.ones(4096, dtype=torch.float16)
    while not os.path.exists(stop_path):
        i += 1
        t0 = time.monotonic()
        try:
            if i % 16 == 0:
                kc.put(f"bench/{i % blocks}", value)
            else:
                t = kc.get(f"bench/{i % blocks}")
                del t
        except Exception:
            errors += 1
        dt = time.monotonic() - t0
        ops += 1
        if ops == 1000:
            open(ready_path, "w").close()
        if dt > 2e-4:
            slow.append((t0, dt))
    kc.close()
    with open(out_path, "w") as f:
        json.dump({"slow": slow, "ops": ops, "errors": errors}, f)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--takeovers", type=int, default=20)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=2000, help="8 KiB blocks in the store")
    ap.add_argument("--binary", default=os.path.join(ROOT, "target", "release", "kachedb"))
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if not os.path.exists(a.binary):
        sys.exit(f"{a.binary} not found: cargo build --release -p kachedb-cli")
    import torch

    import kachedb

    d = tempfile.mkdtemp(prefix="kdb-takeover-", dir="/tmp")
    sock = os.path.join(d, "d.sock")
    procs = [subprocess.Popen([a.binary, "serve", "--socket", sock, "--size", "256MiB"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    workers = []
    rows = []
    try:
        for _ in range(300):
            if os.path.exists(sock):
                break
            time.sleep(0.02)
        with kachedb.connect(sock) as kc:
            v = torch.ones(4096, dtype=torch.float16)
            for i in range(a.blocks):
                kc.put(f"bench/{i}", v)
        stop = os.path.join(d, "stop")
        ctx = mp.get_context("spawn")
        for w in range(a.clients):
            p = ctx.Process(target=client, args=(sock, w, a.blocks, stop, os.path.join(d, f"r{w}"), os.path.join(d, f"c{w}.json")))
            p.start()
            workers.append(p)
        while not all(os.path.exists(os.path.join(d, f"r{w}")) for w in range(a.clients)):
            if not all(p.is_alive() for p in workers):
                sys.exit("a client process died")
            time.sleep(0.05)
        windows = []
        for n in range(a.takeovers):
            time.sleep(0.3)
            t0 = time.monotonic()
            new = subprocess.Popen([a.binary, "serve", "--socket", sock, "--takeover"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            line = new.stdout.readline()
            procs[-1].wait(30)
            t1 = time.monotonic()
            procs.append(new)
            m = re.search(r"in ([0-9.]+) ms", line)
            if not m:
                sys.exit(f"takeover {n} failed: {line!r}")
            windows.append((t0, t1, float(m.group(1))))
        open(stop, "w").close()
        for p in workers:
            p.join(60)
        res = [json.load(open(os.path.join(d, f"c{w}.json"))) for w in range(a.clients)]
        slow = [s for r in res for s in r["slow"]]
        ops = sum(r["ops"] for r in res)
        errors = sum(r["errors"] for r in res)

        def longest(lo: float, hi: float) -> float:
            return max([dt for (t, dt) in slow if t < hi and t + dt > lo] or [0.0]) * 1e3

        for n, (t0, t1, handover) in enumerate(windows):
            rows.append({"takeover": n, "handover_ms": handover, "longest_op_ms": longest(t0, t1),
                         "baseline_longest_op_ms": longest(t0 - (t1 - t0), t0)})
        summary = {
            "takeovers": a.takeovers,
            "clients": a.clients,
            "blocks": a.blocks,
            "client_ops": ops,
            "client_errors": errors,
            "handover_ms_p50": statistics.median(r["handover_ms"] for r in rows),
            "longest_op_ms_p50": statistics.median(r["longest_op_ms"] for r in rows),
            "longest_op_ms_max": max(r["longest_op_ms"] for r in rows),
            "baseline_longest_op_ms_p50": statistics.median(r["baseline_longest_op_ms"] for r in rows),
        }
        if a.json:
            print(json.dumps({"rows": rows, "summary": summary}))
        else:
            print(f"{'#':>3} {'handover ms':>12} {'longest op ms':>14} {'baseline ms':>12}")
            for r in rows:
                print(f"{r['takeover']:>3} {r['handover_ms']:>12.1f} {r['longest_op_ms']:>14.1f} {r['baseline_longest_op_ms']:>12.1f}")
            print(f"{ops} client operations, {errors} errors; handover p50 {summary['handover_ms_p50']:.1f} ms; "
                  f"longest client operation p50 {summary['longest_op_ms_p50']:.1f} ms, max {summary['longest_op_ms_max']:.1f} ms "
                  f"(baseline window p50 {summary['baseline_longest_op_ms_p50']:.1f} ms)")
        return 1 if errors else 0
    finally:
        for p in workers:
            if p.is_alive():
                p.kill()
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(15)
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
