"""Runs every transport over every size: warm-up, timed repetitions within a
time budget, medians."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Tuple

from .cases import Case, GIB, KIB, MIB, case_title, fmt_bytes, fmt_time
from .services import Services, ray_actor_classes
from .transports import Peer, RPC_TIMEOUT, TITLES


def _median(xs: List[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def max_reps(case: Case, quick: bool) -> int:
    """The most timed repetitions of a size; fewer when one is slow (see --case-budget)."""
    if quick:
        return 3
    if case.count > 1:
        return 5
    if case.total <= 64 * MIB:
        return 11
    return 7 if case.total <= 512 * MIB else 5


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * KIB
    return 0


COPIES = 3  # fresh private tensor + transport copy + (store slack / receive buffer / server)
HEADROOM = 1 * GIB


class Runner:
    def __init__(self, args: argparse.Namespace, log: Callable[[str], None], emit: Callable[[dict], None]) -> None:
        self.args, self.log, self.emit = args, log, emit
        self.t_start = time.monotonic()
        self.results: List[dict] = []
        self.notes: List[str] = []
        self.cases_left = 0
        self.last_wall: Dict[str, Tuple[float, int]] = {}  # transport -> (wall of one rep, bytes)

    def elapsed(self) -> float:
        return time.monotonic() - self.t_start

    def over_budget(self) -> bool:
        return self.elapsed() > self.args.time_limit

    def record(self, row: dict) -> None:
        self.results.append(row)

    def skip(self, tname: str, case: Case, why: str) -> None:
        self.cases_left -= 1
        self.record({"transport": tname, "bytes": case.nbytes, "count": case.count, "size": case.label,
                     "skipped": why})
        self.log(f"  {TITLES[tname]:<22} {case_title(case):>16}: skipped: {why}")

    def too_slow(self, tname: str, case: Case) -> Optional[str]:
        """Why ``case`` would end past --time-limit (a warm-up and 3 repetitions,
        each predicted from this transport's previous single-tensor size, scaled by
        bytes)."""
        if self.over_budget():
            return f"time limit ({self.args.time_limit:.0f} s) reached"
        prev = self.last_wall.get(tname)
        if prev is None or case.count > 1:
            return None
        wall, total = prev
        est = 4 * wall * max(1.0, case.total / total)
        if self.elapsed() + est > self.args.time_limit:
            return (f"time limit: would need ~{est:.0f} s more, {max(0.0, self.args.time_limit - self.elapsed()):.0f} s "
                    f"of --time-limit {self.args.time_limit:.0f} s left")
        return None

    def fits(self, case: Case) -> Tuple[bool, str]:
        need = COPIES * case.total + HEADROOM
        avail = mem_available()
        if avail < need:
            return False, (f"needs ~{fmt_bytes(need)} ({COPIES} copies + {fmt_bytes(HEADROOM)}), "
                           f"MemAvailable is {fmt_bytes(avail)}")
        return True, ""

    def measure(self, tname: str, case: Case, run_rep: Callable[[int], dict]) -> None:
        """Warm-up, then ``reps`` repetitions (fewer when one rep is slow); records medians."""
        # a fair share of the time left, so that a slow transport early on does not
        # push the last ones past --time-limit
        left = max(0.0, self.args.time_limit - self.elapsed())
        budget = min(self.args.case_budget, left / max(1, self.cases_left))
        self.cases_left -= 1
        w0 = time.monotonic()
        warm = run_rep(0)
        wall = time.monotonic() - w0
        if case.count == 1:  # many small blocks cost per block, not per byte: no basis for scaling
            self.last_wall[tname] = (wall, case.total)
        if self.args.reps is not None:
            reps = self.args.reps
        else:
            reps = max(3, min(max_reps(case, self.args.quick), int(budget / max(wall, 1e-3))))
        prod, cons, hand, touch = [], [], [], []
        verified = warm["digest"] == warm["expect"]
        for r in range(1, reps + 1):
            res = run_rep(r)
            prod.append(res["tp"] - res["t0"])
            cons.append(res["t1"] - res["tc0"])
            hand.append(res["t1"] - res["t0"])
            touch.append(res["touch_s"])
            if os.environ.get("KACHEDB_COMPARE_DEBUG"):
                self.log(f"    rep {r}: producer {fmt_time(res['tp'] - res['t0'])}, notify gap "
                         f"{fmt_time(res['tc0'] - res['tp'])}, consumer {fmt_time(res['t1'] - res['tc0'])}, "
                         f"handoff {fmt_time(res['t1'] - res['t0'])}")
            if res["digest"] != res["expect"]:
                verified = False
        row = {"transport": tname, "bytes": case.nbytes, "count": case.count, "size": case.label,
               "total_bytes": case.total,
               "handoff_s": _median(hand), "producer_s": _median(prod), "consumer_s": _median(cons),
               "touch_s": _median(touch), "handoff_min_s": min(hand), "handoff_max_s": max(hand),
               "reps": reps, "warmup": 1, "verified": verified}
        self.record(row)
        flag = "" if verified else "  DATA MISMATCH"
        self.log(f"  {TITLES[tname]:<22} {case_title(case):>16}: handoff {fmt_time(row['handoff_s']):>9}  "
                 f"producer {fmt_time(row['producer_s']):>9}  consumer {fmt_time(row['consumer_s']):>9}  "
                 f"touch {fmt_time(row['touch_s']):>9}  ({reps} reps){flag}")

    # -- the transports run through child processes
    def run_mp_transport(self, tname: str, cases: List[Case], services: Services) -> None:
        import torch.multiprocessing as tmp

        ctx = tmp.get_context("spawn")
        max_total = max(c.total for c in cases)
        cfg: Dict[str, Any] = {}
        if tname == "kachedb":
            cfg.update(services.start_kachedb(max_total))
        elif tname == "redis":
            cfg.update(services.start_redis(max_total))
        elif tname == "uds":
            cfg["uds_path"] = os.path.join(services.tmp, "uds.sock")
        link_p, link_c = ctx.Pipe(duplex=True)
        queue = ctx.Queue() if tname == "torch_mp" else None
        peers: List[Peer] = []
        try:
            cons = Peer(ctx, "consumer", tname, cfg, link_c, queue)
            peers.append(cons)
            info = cons.result(120)
            prod = Peer(ctx, "producer", tname, cfg, link_p, queue)
            peers.append(prod)
            pinfo = prod.result(120)
            if tname == "redis" and pinfo.get("hiredis") is not None:
                self.notes.append(f"redis-py {'with' if pinfo['hiredis'] else 'without'} the hiredis parser")
            if "addr" in info:
                prod.call("connect", info["addr"])
            for case in cases:
                if self.over_budget():
                    self.skip(tname, case, f"time limit ({self.args.time_limit:.0f} s) reached")
                    continue
                ok, why = self.fits(case)
                if not ok:
                    self.skip(tname, case, why)
                    continue
                why = self.too_slow(tname, case)
                if why:
                    self.skip(tname, case, why)
                    continue
                cons.call("case", case.to_dict())
                prod.call("case", case.to_dict())

                def run_rep(r: int) -> dict:
                    cons.send("rep", r)
                    prod.send("rep", r)
                    p = prod.result()
                    c = cons.result()
                    prod.call("end_rep")
                    cons.call("end_rep")
                    return {"t0": p["t0"], "tp": p["tp"], "expect": p["digest"], "tc0": c["tc0"], "t1": c["t1"],
                            "digest": c["digest"], "touch_s": c["touch_s"]}

                try:
                    self.measure(tname, case, run_rep)
                finally:
                    with contextlib.suppress(Exception):
                        prod.call("end_case", timeout=60)
                    with contextlib.suppress(Exception):
                        cons.call("end_case", timeout=60)
        finally:
            for p in reversed(peers):
                p.stop()
            link_p.close()
            link_c.close()
            if queue is not None:
                queue.close()
                queue.join_thread()
            if tname == "kachedb":
                services.stop_kachedb()
            elif tname == "redis":
                services.stop_redis()

    def run_ray(self, cases: List[Case], services: Services) -> None:
        import ray

        services.start_ray(max(c.total for c in cases))
        try:
            P, C = ray_actor_classes()
            cons, prod = C.remote(), P.remote()
            for case in cases:
                if self.over_budget():
                    self.skip("ray", case, f"time limit ({self.args.time_limit:.0f} s) reached")
                    continue
                ok, why = self.fits(case)
                if not ok:
                    self.skip("ray", case, why)
                    continue
                why = self.too_slow("ray", case)
                if why:
                    self.skip("ray", case, why)
                    continue
                d = case.to_dict()
                try:
                    self.measure("ray", case, lambda r: ray.get(prod.rep.remote(d, r, cons), timeout=RPC_TIMEOUT))
                finally:
                    ray.get(prod.end_case.remote(), timeout=RPC_TIMEOUT)
            for a in (prod, cons):
                with contextlib.suppress(Exception):
                    ray.kill(a)
        finally:
            services.stop_ray()

    def run(self, transports: List[str], cases: List[Case], tmp: str) -> None:
        services = Services(tmp, self.log)
        self.cases_left = len(transports) * len(cases)
        try:
            for tname in transports:
                if self.over_budget():
                    for case in cases:
                        self.skip(tname, case, f"time limit ({self.args.time_limit:.0f} s) reached")
                    continue
                runnable = []
                for case in cases:
                    ok, why = self.fits(case)
                    if ok:
                        runnable.append(case)
                    else:
                        self.skip(tname, case, why)
                if not runnable:
                    continue
                missing = _missing_dependency(tname)
                if missing:
                    for case in runnable:
                        self.skip(tname, case, f"unavailable: {missing}")
                    continue
                self.log(f"[{self.elapsed():5.0f} s] {TITLES[tname]}")
                try:
                    if tname == "ray":
                        self.run_ray(runnable, services)
                    else:
                        self.run_mp_transport(tname, runnable, services)
                except Exception as e:
                    msg = str(e).strip().splitlines()
                    short = msg[-1] if msg else type(e).__name__
                    self.log(f"  {TITLES[tname]} failed: {''.join(traceback.format_exception_only(type(e), e)).strip()}")
                    done = {(r["transport"], r["size"]) for r in self.results}
                    for case in runnable:
                        if (tname, case.label) not in done:
                            self.cases_left -= 1
                            self.record({"transport": tname, "bytes": case.nbytes, "count": case.count,
                                         "size": case.label, "error": short[:500]})
        finally:
            services.stop_all()


def _missing_dependency(tname: str) -> Optional[str]:
    import importlib.util

    if tname == "ray" and importlib.util.find_spec("ray") is None:
        return "ray is not installed (pip install ray)"
    if tname == "redis":
        if importlib.util.find_spec("redis") is None:
            return "redis-py is not installed (pip install redis hiredis)"
        if shutil.which("redis-server") is None:
            return "redis-server not found (apt-get install -y redis-server)"
    return None
