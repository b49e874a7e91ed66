#!/usr/bin/env python3
"""``python benchmarks/compare.py``: hand a KV tensor from one process to another
through KacheDB and through the transports a user would otherwise pick (TCP
loopback, Unix socket, multiprocessing.shared_memory, torch.multiprocessing,
Redis, Ray's object store), on the same machine, with the same tensors.
See docs/benchmarks.md.

    python benchmarks/compare.py                      # full run, table on stdout
    python benchmarks/compare.py --quick --json       # CI: small sizes, JSON lines
    python benchmarks/compare.py --out docs --doc docs/benchmarks.md   # regenerate the docs

For every transport and size, a long-lived *producer* process makes a fresh
private tensor (untimed), then hands it over; a long-lived *consumer* process
ends up with a usable ``torch.Tensor`` of it and verifies it (a strided checksum
over every page plus the first and last words, compared with the producer's).
Times come from ``time.perf_counter`` (CLOCK_MONOTONIC, system-wide on Linux):

* ``producer_s``: producer start -> its handoff call(s) returned;
* ``consumer_s``: the consumer saw the first sign of the data (metadata or
  header arrived, ref/queue item ready) -> it holds the tensor(s);
* ``handoff_s``: producer start -> consumer holds the tensor(s) (end to end);
* ``touch_s``: the consumer's first read of every page afterwards (page faults
  of a fresh mapping land here, not in ``handoff_s``).

Medians over several repetitions after a warm-up. The run cleans up every
process and shared-memory segment it made and checks that it did.
``KACHEDB_COMPARE_DEBUG=1`` prints every repetition's times.

The pieces live in ``benchmarks/handoff/``: ``cases`` (sizes, payload, checksum),
``transports`` (one producer/consumer pair per transport, in child processes),
``services`` (KacheDB daemon, redis-server, Ray), ``runner`` (repetitions and
time budget), ``cleanup`` (the leftover check) and ``report`` (table, chart, doc).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

from handoff.cases import Case, FULL_SIZES, QUICK_SIZES, case_title, fmt_bytes, parse_size
from handoff.cleanup import check_cleanup, set_subreaper, shm_names, stop_resource_tracker
from handoff.floors import add_floor_ratios, measure_floors
from handoff.report import add_ratios, machine_description, render_chart, render_markdown, update_doc
from handoff.runner import Runner, mem_available
from handoff.transports import TITLES, TORCH_MP_BATCH, TRANSPORTS, quiet_warnings, single_threaded_torch


def build_parser(prog: str = "benchmarks/compare.py") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=(
        "Hand a KV tensor from one process to another: KacheDB vs TCP loopback, Unix socket, "
        "multiprocessing.shared_memory, torch.multiprocessing, Ray's object store and Redis."))
    p.add_argument("--sizes", default=None,
                   help=f"comma-separated sizes, NxCOUNT for COUNT separate tensors (default {FULL_SIZES}; "
                        f"--quick: {QUICK_SIZES})")
    p.add_argument("--transports", default=",".join(TRANSPORTS),
                   help=f"comma-separated subset of {','.join(TRANSPORTS)}")
    p.add_argument("--quick", action="store_true", help=f"CI mode: {QUICK_SIZES}, 3 reps")
    p.add_argument("--reps", type=int, default=None, help="repetitions after the warm-up (default: by size, "
                                                          "fewer when one is slow)")
    p.add_argument("--json", action="store_true", help="JSON lines on stdout (progress and table on stderr)")
    p.add_argument("--out", default=None, help="directory for compare_table.md, compare_chart.png and compare_results.jsonl")
    p.add_argument("--doc", default=None, help="Markdown file whose generated block is replaced with the table")
    p.add_argument("--render", metavar="JSONL", default=None,
                   help="do not measure: re-render the table/chart/doc block (--out, --doc) from a "
                        "compare_results.jsonl of an earlier run")
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds after which remaining cases are skipped (default 510, quick 150); "
                        "each size of each transport gets a fair share of what is left")
    p.add_argument("--case-budget", type=float, default=None,
                   help="seconds per transport and size for the timed repetitions (default 6)")
    p.add_argument("--no-floors", action="store_true",
                   help="do not measure the copy floors (memcpy of each size's bytes on one thread and on "
                        "several, beside KacheDB's producer)")
    return p


def write_outputs(results: List[dict], cases: List[Case], transports: List[str], meta: dict, rows: List[dict],
                  out_dir: Optional[str], doc: Optional[str], log: Callable[[str], None]) -> str:
    """The Markdown table (returned), and with ``out_dir`` compare_table.md,
    compare_results.jsonl and compare_chart.png; with ``doc`` its generated block."""
    floors = [r for r in rows if "floor" in r]
    md = render_markdown(results, cases, transports, meta, floors)
    chart_err = None
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "compare_table.md"), "w") as f:
            f.write(md)
        with open(os.path.join(out_dir, "compare_results.jsonl"), "w") as f:
            for d in rows:
                f.write(json.dumps(d) + "\n")
        chart_err = render_chart(results, cases, transports, os.path.join(out_dir, "compare_chart.png"), meta)
        if chart_err:
            log(chart_err)
    if doc:
        rel = None
        if out_dir and not chart_err:
            rel = os.path.relpath(os.path.join(out_dir, "compare_chart.png"), os.path.dirname(os.path.abspath(doc)))
        update_doc(doc, md, rel)
    return md


def render_saved(path: str, out_dir: Optional[str], doc: Optional[str]) -> str:
    """Re-renders the table, chart and doc block from a compare_results.jsonl
    written by an earlier run (no measuring)."""
    rows = [json.loads(line) for line in open(path) if line.strip()]
    meta = next(r["meta"] for r in rows if "meta" in r)
    meta["cleanup"] = next((r["cleanup"] for r in rows if "cleanup" in r), meta.get("cleanup"))
    results = [r for r in rows if "transport" in r]
    cases = [parse_size(s) for s in meta["sizes"]]
    return write_outputs(results, cases, meta["transports"], meta, rows, out_dir, doc, lambda s: print(s, file=sys.stderr))


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Optional[Sequence[str]] = None, prog: str = "benchmarks/compare.py") -> int:
    args = build_parser(prog).parse_args(argv)
    if args.render:
        sys.stdout.write(render_saved(args.render, args.out, args.doc))
        return 0
    if args.time_limit is None:
        args.time_limit = 150.0 if args.quick else 510.0
    if args.case_budget is None:
        args.case_budget = 6.0
    try:
        cases = [parse_size(s) for s in (args.sizes or (QUICK_SIZES if args.quick else FULL_SIZES)).split(",") if s.strip()]
    except ValueError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    bad = [t for t in transports if t not in TRANSPORTS]
    if bad:
        print(f"{prog}: unknown transport(s) {', '.join(bad)}; choose from {', '.join(TRANSPORTS)}", file=sys.stderr)
        return 2
    if "kachedb" in transports:
        transports = ["kachedb"] + [t for t in transports if t != "kachedb"]

    # stdout carries only our output; anything else (Ray, redis, children) writes to stderr
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    def log(s: str) -> None:
        print(s, file=sys.stderr, flush=True)

    rows_out: List[dict] = []

    def emit(d: dict) -> None:
        rows_out.append(d)
        if args.json:
            out.write(json.dumps(d) + "\n")
            out.flush()

    quiet_warnings()
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # children and Ray workers: see single_threaded_torch
    single_threaded_torch()
    subreaper = set_subreaper()
    shm_before = shm_names()
    tmp = tempfile.mkdtemp(prefix="kcmp-", dir="/tmp")  # short: Ray's socket paths live under it
    started = time.strftime("%Y-%m-%d %H:%M %Z")
    old_term = signal.signal(signal.SIGTERM, _raise_interrupt)
    runner = Runner(args, log, emit)
    meta: Dict[str, Any] = {"machine": machine_description(), "started": started,
                            "command": " ".join([f"python {prog}", *(argv if argv is not None else sys.argv[1:])])}
    avail = mem_available()
    log(f"{prog}: {', '.join(case_title(c) for c in cases)}; "
        f"{', '.join(TITLES[t] for t in transports)}; MemAvailable {fmt_bytes(avail)}")
    for c in cases:
        ok, why = runner.fits(c)
        if not ok:
            log(f"  size {case_title(c)} will be skipped: {why}")
    interrupted = False
    floors: List[dict] = []
    try:
        if not args.no_floors:
            log("copy floors (memcpy of each size's bytes, this process)")
            floors = measure_floors(cases, mem_available, log)
        runner.run(transports, cases, tmp)
    except KeyboardInterrupt:
        interrupted = True
        log("interrupted: cleaning up")
    finally:
        signal.signal(signal.SIGTERM, old_term)
        shutil.rmtree(tmp, ignore_errors=True)
        stop_resource_tracker()
    markers = [tmp]
    cleanup = check_cleanup(shm_before, tmp, markers)
    if not subreaper:
        cleanup["note"] = "PR_SET_CHILD_SUBREAPER unavailable: only direct descendants were checked"
    meta["wall_s"] = runner.elapsed()
    meta["cleanup"] = cleanup
    meta["notes"] = ["every producer and consumer process runs torch with 1 intra-op thread"] + runner.notes
    if "redis" in transports:
        meta["notes"].append("Redis values above 1 MiB are split into 1 MiB keys (proto-max-bulk-len left at "
                             "its default of 512 MB)")
    if "torch_mp" in transports and any(c.count > TORCH_MP_BATCH for c in cases):
        meta["notes"].append(f"torch.multiprocessing sends more than {TORCH_MP_BATCH} tensors in acknowledged "
                             "batches (file_descriptor strategy: 2 fds per tensor in flight, RLIMIT_NOFILE)")
    add_ratios(runner.results)
    add_floor_ratios(floors, runner.results)
    for r in runner.results:
        emit(r)
    for f in floors:
        emit(f)
    emit({"meta": {**meta, "sizes": [c.label for c in cases], "transports": transports}})
    emit({"cleanup": cleanup})
    md = write_outputs(runner.results, cases, transports, meta, rows_out, args.out, args.doc, log)
    if args.json:
        log("")
        log(md)
    else:
        out.write(md)
    log(f"cleanup: {'ok' if cleanup['ok'] else 'FAILED'} ({len(cleanup['leftover_processes'])} leftover processes, "
        f"{len(cleanup['leftover_shm'])} leftover /dev/shm segments, "
        f"temp dir {'left' if cleanup['temp_dir_left'] else 'removed'}); total {runner.elapsed():.0f} s")
    out.flush()
    bad_rows = [r for r in runner.results if "error" in r or ("handoff_s" in r and not r["verified"])
                or ("skipped" in r and "MemAvailable" not in r["skipped"])]
    if interrupted:
        return 130
    return 0 if cleanup["ok"] and not bad_rows else 1


if __name__ == "__main__":
    sys.exit(main())
