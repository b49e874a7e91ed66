#!/usr/bin/env python3
"""``python benchmarks/python_ops.py [--json] [--quick] [--socket PATH] [--only SECTIONS]``: the
Python-side figures of the installed ``kachedb`` package.

* ``py_get_rtt``: ``kc.get(key)`` of a small block (4 KiB), p50/p99, beside
  ``py_get_rtt_native`` (the bare ``NativeClient.get`` underneath) and
  ``py_ping_rtt`` (an empty round trip): the differences are the Python cost.
* ``py_get_view``: ``kc.get`` of 1 MiB .. 2 GiB blocks to a usable tensor (a
  view: the time should not depend on the size).
* ``py_put``: ``kc.put`` of a 512 MiB CPU tensor against ``dst.copy_(src)`` into
  a preallocated, pre-faulted tensor, measured in the same run.
* ``py_get_many``: batched ``get_many`` of 64 keys, ops/s.
* ``py_get_rtt_pinned``: ``kc.get`` p50 against a fresh daemon with both on one
  core (``taskset -c 0`` for both: a busy node) and on two cores.
* ``py_put_many_small``: ``put_many`` of 1000 x 64 KiB CPU tensors against
  torch ``copy_`` of the same 1000 tensors into preallocated ones (and against
  one ``copy_`` of all the bytes at once): the ratio and the overhead per block,
  with the daemon's threads on one CPU and this thread on another, as for
  ``py_get_prefix``.
* ``py_get_prefix``: ``get_prefix`` of 128 blocks against torch making 128
  views (``base[i]``) of one tensor in this process, with the daemon's threads
  on one CPU and this thread on another (the daemon it started; with
  ``--socket``, unpinned).
* ``py_after_idle``: the first request after an idle gap (``--idle-gap-s``,
  ``--idle-gaps`` of them): ``kc.get`` (and the second one right after it),
  ``NativeClient.get`` and ``ping``, each after its own gap, against a warm
  ``kc.get`` and against the machine's wake-up floor measured in the same run
  after the same gaps: a one-byte echo through pipes to a child process blocked
  in ``read`` (and that echo followed by torch importing a local tensor's DLPack
  capsule, the work ``kc.get`` does with its answer). Also the daemon's CPU use during the gaps and the futex wakes it
  sent to parked clients per request after idle. ``--only idle`` runs this alone.

Each figure is the median of several repetitions after a warm-up. A private
daemon is started for the run unless ``--socket`` names one.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: harness/
from harness.daemon import Daemon  # noqa: E402

__all__ = ["main"]

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

#: The README's bars, shown beside the figures.
TARGET_RTT_NS = 5_000
TARGET_SAME_CORE_NS = 8_000
TARGET_SEPARATE_CORES_NS = 3_000
TARGET_PUT_MANY_OVERHEAD_US = 3.0
TARGET_PUT_MANY_RATIO = 1.3
#: Blocks of the small section, and the megaslab that holds two generations of them
#: (a replaced block is freed at the next commit) within 40 % of it.
SMALL_BLOCKS = 1000
SMALL_BLOCK_BYTES = 64 * KiB
SMALL_SLAB = 5 * SMALL_BLOCKS * (SMALL_BLOCK_BYTES + 4 * KiB) // 2 + 8 * MiB
TARGET_PREFIX_RATIO = 2.0
TARGET_VIEW_NS = 20_000
TARGET_PUT_RATIO = 0.80
TARGET_AFTER_IDLE_RATIO = 2.0

#: What ``--only`` can name, in the order they run.
SECTIONS = ("rtt", "idle", "pinned", "view", "put", "many", "small")


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return float(s[n // 2]) if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2.0


def _pct(sorted_xs: Sequence[int], p: float) -> int:
    return int(sorted_xs[min(len(sorted_xs) - 1, int(round((len(sorted_xs) - 1) * p)))])


def _human_bytes(n: int) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


def mem_available() -> int:
    """Bytes this process could still allocate: ``MemAvailable``, capped by the
    cgroup (v2 or v1) limit minus its usage."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * KiB
                    break
    except OSError:
        pass
    if avail is None:
        avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    for limit_path, usage_path in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            with open(limit_path) as f:
                raw = f.read().strip()
            with open(usage_path) as f:
                used = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if raw != "max" and int(raw) < (1 << 60):
            avail = min(avail, int(raw) - used)
        break
    return max(0, avail)


def _pinned_get_rtt(daemon_cpu: int, client_cpu: int, iters: int, reps: int) -> Tuple[float, float]:
    """``kc.get`` p50/p99 against a fresh daemon whose threads all run on
    ``daemon_cpu`` (it inherits this thread's affinity when spawned), this
    thread on ``client_cpu``; this thread's affinity is restored after."""
    import torch

    import kachedb

    original = os.sched_getaffinity(0)
    daemon = None
    try:
        os.sched_setaffinity(0, {daemon_cpu})
        daemon = Daemon(size=64 * MiB).start()
        os.sched_setaffinity(0, {client_cpu})
        with kachedb.connect(daemon.socket) as kc:
            kc.put(b"pinned", torch.zeros(2048, dtype=torch.float16))
            return _latency(lambda: kc.get(b"pinned"), iters, reps, 2_000)
    finally:
        os.sched_setaffinity(0, original)
        if daemon is not None:
            daemon.stop()


class _SeparateCores:
    """Within the block, every thread of the daemon ``pid`` runs on the
    second CPU of this process's affinity set and this thread on the first
    (the placement of a serving node: the daemon on its own core); both
    affinities are restored after. Does nothing (``placement`` says so) with
    fewer than two CPUs or no daemon pid."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.cpus = sorted(os.sched_getaffinity(0))
        self.placement = "unpinned"
        self._saved: List[Tuple[int, Any]] = []

    def _threads(self) -> List[int]:
        try:
            return [int(t) for t in os.listdir(f"/proc/{self.pid}/task")]
        except OSError:
            return []

    def __enter__(self) -> "_SeparateCores":
        if self.pid <= 0 or len(self.cpus) < 2:
            return self
        try:
            for tid in [0] + self._threads():
                self._saved.append((tid, os.sched_getaffinity(tid)))
            for tid in self._threads():
                os.sched_setaffinity(tid, {self.cpus[1]})
            os.sched_setaffinity(0, {self.cpus[0]})
            self.placement = f"daemon CPU {self.cpus[1]}, client CPU {self.cpus[0]}"
        except OSError:
            self.__exit__(None, None, None)
        return self

    def __exit__(self, *exc: Any) -> None:
        for tid, cpus in reversed(self._saved):
            try:
                os.sched_setaffinity(tid, cpus)
            except OSError:
                pass  # a daemon thread that has exited
        self._saved = []


#: The child of the wake-up floor: echoes each byte it reads, blocked in read() between them.
_ECHO_CHILD = "import os\nwhile True:\n    b = os.read(0, 1)\n    if not b:\n        break\n    os.write(1, b)\n"


def _cpu_ns(pid: int) -> Optional[int]:
    """CPU time of every thread of ``pid`` so far, in ns (``/proc/PID/task/*/schedstat``),
    or ``None`` where the process is not visible."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    total = 0
    for t in tasks:
        try:
            with open(f"/proc/{pid}/task/{t}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return total


def _after_idle(kc: Any, key: bytes, gaps: int, gap_s: float, warm_iters: int, reps: int) -> Dict[str, Any]:
    """The first request after ``gap_s`` of idle, against a warm one and the
    wake-up floor (see the module's ``py_after_idle``). Each kind of request
    gets its own gap, the kinds in turn, so all see the same conditions."""
    import subprocess

    native = kc._native
    warm_p50, _ = _latency(lambda: kc.get(key), warm_iters, reps, 2_000)
    stats = kc.stats()
    pid = int(stats.get("daemon_pid", 0))
    wakeups0 = int(stats.get("wakeups_sent", 0))
    child = subprocess.Popen([sys.executable, "-S", "-c", _ECHO_CHILD], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, bufsize=0)
    w, r = child.stdin.fileno(), child.stdout.fileno()
    clock = time.perf_counter_ns

    def echo() -> None:
        os.write(w, b"x")
        if os.read(r, 1) != b"x":
            raise RuntimeError("the echo child answered something else")

    for _ in range(100):  # the child is up and its path warm
        echo()
    # The floor of kc.get's own work: the echo, then torch importing a DLPack
    # capsule of a local 4 KiB tensor (kc.get imports the block's capsule so).
    import torch

    local = torch.zeros(2048, dtype=torch.float16)
    from_dlpack = torch._C._from_dlpack
    first: Dict[str, List[int]] = {"kc_get": [], "kc_get_second": [], "native_get": [], "ping": [], "pipe_echo": [],
                                   "pipe_echo_view": []}
    idle_cpu_ns, idle_wall_ns = 0, 0
    try:
        for _ in range(gaps):
            for kind in ("kc_get", "native_get", "ping", "pipe_echo", "pipe_echo_view"):
                capsule = local.__dlpack__() if kind == "pipe_echo_view" else None
                c0, s0 = _cpu_ns(pid) if pid else None, clock()
                time.sleep(gap_s)
                c1, s1 = _cpu_ns(pid) if pid else None, clock()
                if c0 is not None and c1 is not None:
                    idle_cpu_ns += c1 - c0
                    idle_wall_ns += s1 - s0
                if kind == "kc_get":
                    t0 = clock()
                    v = kc.get(key)
                    t1 = clock()
                    v2 = kc.get(key)
                    t2 = clock()
                    first["kc_get"].append(t1 - t0)
                    first["kc_get_second"].append(t2 - t1)
                    del v, v2
                elif kind == "native_get":
                    t0 = clock()
                    v = native.get(key)
                    t1 = clock()
                    first["native_get"].append(t1 - t0)
                    del v
                elif kind == "ping":
                    t0 = clock()
                    native.ping()
                    t1 = clock()
                    first["ping"].append(t1 - t0)
                elif kind == "pipe_echo":
                    t0 = clock()
                    echo()
                    t1 = clock()
                    first["pipe_echo"].append(t1 - t0)
                else:
                    t0 = clock()
                    echo()
                    v = from_dlpack(capsule)
                    t1 = clock()
                    first["pipe_echo_view"].append(t1 - t0)
                    del v, capsule
    finally:
        child.stdin.close()
        child.wait(timeout=10)
        child.stdout.close()
    wakeups = int(kc.stats().get("wakeups_sent", 0)) - wakeups0
    med = {k: _median(v) for k, v in first.items()}
    rec: Dict[str, Any] = {
        "bench": "py_after_idle", "gap_s": gap_s, "gaps": gaps, "warm_get_p50_ns": warm_p50,
        "first_get_p50_ns": med["kc_get"], "second_get_p50_ns": med["kc_get_second"],
        "first_native_get_p50_ns": med["native_get"], "first_ping_p50_ns": med["ping"],
        "pipe_echo_p50_ns": med["pipe_echo"], "pipe_echo_view_p50_ns": med["pipe_echo_view"],
        "first_get_max_ns": max(first["kc_get"]), "pipe_echo_max_ns": max(first["pipe_echo"]),
        "first_vs_warm": med["kc_get"] / warm_p50, "first_vs_floor": med["kc_get"] / med["pipe_echo"],
        "ping_vs_floor": med["ping"] / med["pipe_echo"],
        "first_vs_floor_view": med["kc_get"] / med["pipe_echo_view"],
        # Futex wakes the daemon sent to this client parked on its completion ring,
        # per request made right after a gap (the releases are fire-and-forget: no wait).
        "client_wakeups_per_request": wakeups / (3 * gaps),
        "target_first_vs_warm": TARGET_AFTER_IDLE_RATIO,
    }
    if idle_wall_ns:
        rec["daemon_idle_cpu_pct"] = 100.0 * idle_cpu_ns / idle_wall_ns
    return rec


def _emit_after_idle(out: "_Out", kc: Any, key: bytes, args: argparse.Namespace, reps: int, rtt_iters: int) -> None:
    gaps = args.idle_gaps if args.idle_gaps is not None else (3 if args.quick else 15)
    gap_s = args.idle_gap_s if args.idle_gap_s is not None else (0.2 if args.quick else 1.0)
    rec = _after_idle(kc, key, gaps, gap_s, min(rtt_iters, 20_000), reps)
    us = lambda ns: ns / 1e3  # noqa: E731
    cpu = rec.get("daemon_idle_cpu_pct")
    out.emit(rec,
             f"first request after {gap_s:g} s idle ({gaps} gaps, medians): kc.get {us(rec['first_get_p50_ns']):7.1f} us "
             f"(then {us(rec['second_get_p50_ns']):.1f} us), NativeClient.get {us(rec['first_native_get_p50_ns']):.1f} us, "
             f"ping {us(rec['first_ping_p50_ns']):.1f} us\n"
             f"  vs warm kc.get {us(rec['warm_get_p50_ns']):.1f} us = {rec['first_vs_warm']:.1f}x   "
             f"target <= {TARGET_AFTER_IDLE_RATIO:g}x: {_met(rec['first_vs_warm'] <= TARGET_AFTER_IDLE_RATIO)}\n"
             f"  vs the wake-up floor (pipe echo to a child blocked in read, same gaps) {us(rec['pipe_echo_p50_ns']):.1f} us "
             f"= {rec['first_vs_floor']:.2f}x (ping {rec['ping_vs_floor']:.2f}x); "
             f"max {us(rec['first_get_max_ns']):.0f} / {us(rec['pipe_echo_max_ns']):.0f} us\n"
             f"  vs the echo then torch importing a local tensor's DLPack capsule (kc.get's own work) "
             f"{us(rec['pipe_echo_view_p50_ns']):.1f} us = {rec['first_vs_floor_view']:.2f}x\n"
             f"  futex wakes sent to the parked client per request {rec['client_wakeups_per_request']:.2f}"
             + (f"; daemon CPU during the gaps {cpu:.3f} % of a core" if cpu is not None else ""))


class _Out:
    def __init__(self, as_json: bool) -> None:
        self.json = as_json

    def emit(self, record: Dict[str, Any], human: str) -> None:
        if self.json:
            print(json.dumps(record), flush=True)
        else:
            print(human, flush=True)

    def note(self, text: str) -> None:
        if not self.json:
            print(text, flush=True)


def _met(ok: bool) -> str:
    return "met" if ok else "MISSED"


def _latency(fn: Callable[[], Any], iters: int, reps: int, warmup: int) -> Tuple[float, float]:
    """Median over ``reps`` of the p50 and of the p99 of ``iters`` timed calls
    (the result of each call is dropped outside the timed span)."""
    clock = time.perf_counter_ns
    for _ in range(warmup):
        fn()
    p50s, p99s = [], []
    for _ in range(reps):
        ts: List[int] = [0] * iters
        for i in range(iters):
            t0 = clock()
            r = fn()
            ts[i] = clock() - t0
            del r
        ts.sort()
        p50s.append(_pct(ts, 0.50))
        p99s.append(_pct(ts, 0.99))
    return _median(p50s), _median(p99s)


def run(args: argparse.Namespace) -> int:
    import torch

    import kachedb

    out = _Out(args.json)
    quick = args.quick
    only = set(args.only.split(",")) if args.only else None

    def want(section: str) -> bool:
        return only is None or section in only
    reps = 3 if quick else 5
    rtt_iters = 5_000 if quick else 50_000
    view_sizes = [1 * MiB, 64 * MiB] if quick else [1 * MiB, 64 * MiB, 512 * MiB, 2 * GiB]
    put_bytes = 64 * MiB if quick else 512 * MiB

    # What fits: the biggest view block, or two put blocks (a replaced block is
    # freed at the next commit), plus the put's source and destination tensors
    # in this process, the daemon's default 512 MiB headroom and a margin.
    avail = mem_available()
    skipped: Dict[int, str] = {}

    def need(sizes: List[int], put: int) -> int:
        slab = max([put * 2] + sizes) + 64 * MiB
        return slab + 2 * put + 512 * MiB + 256 * MiB

    fitting = list(view_sizes) if want("view") else []
    while fitting and need(fitting, put_bytes) > avail:
        big = fitting.pop()
        skipped[big] = f"needs about {need([big], put_bytes) // MiB} MiB of memory, {avail // MiB} MiB available"
    put_ok = need([], put_bytes) <= avail and want("put")

    daemon = None
    if args.socket is None:
        small_slab = SMALL_SLAB if want("small") and not quick else 0
        daemon = Daemon(size=max([put_bytes * 2 if put_ok else 0, small_slab] + fitting) + 64 * MiB,
                        ready_timeout_s=60).start()
        socket = daemon.socket
    else:
        socket = args.socket
    try:
        kc = kachedb.connect(socket)
        slab = kc.stats()["bytes_total"]
        if args.socket is not None:
            # Leave a few MiB for the small blocks; blocks are whole pages (+1 for alignment).
            for s in [s for s in fitting if s + 4 * MiB > slab]:
                fitting.remove(s)
                skipped[s] = f"larger than the daemon's {slab // MiB} MiB megaslab"
            put_ok = put_ok and put_bytes * 2 + 4 * MiB <= slab
        native = kc._native
        out.note(
            f"benchmarks/python_ops.py (Python {sys.version.split()[0]}, torch {torch.__version__}, "
            f"{torch.get_num_threads()} torch threads) — medians of {reps} runs after warm-up; "
            f"daemon {'started for the run' if daemon else 'at ' + socket}, megaslab {_human_bytes(slab)}"
        )

        # --- round trips -------------------------------------------------------------------
        key = b"bench/py/small"
        kc.put(key, torch.zeros(2048, dtype=torch.float16))  # 4 KiB
        if want("rtt"):
            warm = min(2_000, rtt_iters)
            p50, p99 = _latency(native.ping, rtt_iters, reps, warm)
            out.emit({"bench": "py_ping_rtt", "p50_ns": p50, "p99_ns": p99},
                     f"PING round trip (NativeClient.ping)      p50 {p50:9.0f} ns   p99 {p99:10.0f} ns")
            p50n, p99n = _latency(lambda: native.get(key), rtt_iters, reps, warm)
            out.emit({"bench": "py_get_rtt_native", "call": "NativeClient.get", "bytes": 4096, "p50_ns": p50n, "p99_ns": p99n},
                     f"GET-hit round trip (NativeClient.get)    p50 {p50n:9.0f} ns   p99 {p99n:10.0f} ns")
            p50, p99 = _latency(lambda: kc.get(key), rtt_iters, reps, warm)
            out.emit({"bench": "py_get_rtt", "bytes": 4096, "p50_ns": p50, "p99_ns": p99, "target_p50_ns": TARGET_RTT_NS},
                     f"GET-hit round trip (kc.get -> tensor)    p50 {p50:9.0f} ns   p99 {p99:10.0f} ns   "
                     f"target p50 <= {TARGET_RTT_NS} ns: {_met(p50 <= TARGET_RTT_NS)}; Python adds {p50 - p50n:.0f} ns")

        if want("idle"):
            _emit_after_idle(out, kc, key, args, reps, rtt_iters)

        # The same round trip with client and daemon pinned to one core, then two.
        if want("pinned"):
            if args.socket is None and len(os.sched_getaffinity(0)) >= 2:
                cpus = sorted(os.sched_getaffinity(0))
                for name, dcpu, ccpu, target in (("same core", cpus[0], cpus[0], TARGET_SAME_CORE_NS),
                                                 ("separate cores", cpus[1], cpus[0], TARGET_SEPARATE_CORES_NS)):
                    p50, p99 = _pinned_get_rtt(dcpu, ccpu, rtt_iters // 5 if quick else rtt_iters // 2, reps)
                    out.emit({"bench": "py_get_rtt_pinned", "placement": name, "daemon_cpu": dcpu, "client_cpu": ccpu,
                              "p50_ns": p50, "p99_ns": p99, "target_p50_ns": target},
                             f"GET-hit round trip, {name:<14}     p50 {p50:9.0f} ns   p99 {p99:10.0f} ns   "
                             f"target p50 <= {target} ns: {_met(p50 <= target)} (daemon CPU {dcpu}, client CPU {ccpu})")

        # --- get of big blocks as views -----------------------------------------------------
        if want("view"):
            view_p50s = []
            for size in view_sizes:
                if size in skipped:
                    out.emit({"bench": "py_get_view", "bytes": size, "skipped": skipped[size]},
                             f"GET {_human_bytes(size):>8} as a torch view      skipped: {skipped[size]}")
                    continue
                k = f"bench/py/view/{size}"
                n = size // 2  # bfloat16 elements, laid out as (blocks, 8 heads, 128 dims)
                with kc.reserve(k, (n // 1024, 8, 128), torch.bfloat16):
                    pass  # the pages are already there (the daemon reserved them at start)
                iters = 2_000 if quick else 5_000
                p50, p99 = _latency(lambda: kc.get(k), iters, reps, 200)
                view_p50s.append(p50)
                out.emit({"bench": "py_get_view", "bytes": size, "dtype": "bfloat16", "p50_ns": p50, "p99_ns": p99, "target_p50_ns": TARGET_VIEW_NS},
                         f"GET {_human_bytes(size):>8} as a torch view      p50 {p50:9.0f} ns   p99 {p99:10.0f} ns   "
                         f"target <= {TARGET_VIEW_NS} ns: {_met(p50 <= TARGET_VIEW_NS)}")
                kc.delete(k)
            if len(view_p50s) > 1:
                out.note(f"  views from {_human_bytes(min(s for s in view_sizes if s not in skipped))} to "
                         f"{_human_bytes(max(s for s in view_sizes if s not in skipped))}: "
                         f"p50 {min(view_p50s):.0f}..{max(view_p50s):.0f} ns (flat if close)")

        # --- put against torch's own copy ------------------------------------------------------
        if want("put"):
            if not put_ok:
                reason = f"needs about {need([], put_bytes) // MiB} MiB of memory ({avail // MiB} MiB available) or a larger megaslab"
                out.emit({"bench": "py_put", "bytes": put_bytes, "skipped": reason}, f"PUT {_human_bytes(put_bytes)}  skipped: {reason}")
            else:
                src = torch.arange(put_bytes // 8, dtype=torch.int64).view(torch.uint8)  # varied bytes
                dst = torch.empty_like(src)
                dst.fill_(0)  # fault every page in before timing
                k = "bench/py/put"
                kc.put(k, src)
                dst.copy_(src)
                put_s, copy_s = [], []
                for _ in range(reps):
                    t0 = time.perf_counter_ns()
                    kc.put(k, src)
                    t1 = time.perf_counter_ns()
                    dst.copy_(src)
                    t2 = time.perf_counter_ns()
                    put_s.append((t1 - t0) / 1e9)
                    copy_s.append((t2 - t1) / 1e9)
                put_gbps = put_bytes / _median(put_s) / 1e9
                copy_gbps = put_bytes / _median(copy_s) / 1e9
                ratio = put_gbps / copy_gbps
                # The stored block is the source's bytes.
                got = kc.get(k)
                if not torch.equal(got[:4096], src[:4096]) or not torch.equal(got[-4096:], src[-4096:]):
                    raise RuntimeError("the benchmark's put stored different bytes")
                del got
                kc.delete(k)
                del src, dst
                gc.collect()
                out.emit({"bench": "py_put", "bytes": put_bytes, "gbps": put_gbps, "torch_copy_gbps": copy_gbps, "ratio": ratio,
                          "torch_threads": torch.get_num_threads(), "target_ratio": TARGET_PUT_RATIO},
                         f"PUT {_human_bytes(put_bytes)} from a CPU tensor   {put_gbps:6.2f} GB/s vs torch copy_ {copy_gbps:6.2f} GB/s "
                         f"= {ratio * 100:3.0f} %   target >= {TARGET_PUT_RATIO * 100:.0f} %: {_met(ratio >= TARGET_PUT_RATIO)}")

        # --- batched get_many -----------------------------------------------------------------
        if want("many"):
            keys = [f"bench/py/many/{i}" for i in range(64)]
            kc.put_many(keys, [torch.full((2048,), i, dtype=torch.float16) for i in range(64)])
            batches = 100 if quick else 500
            call_rates, cycle_rates = [], []
            for r in range(reps + 1):
                t_call = 0
                t0 = time.perf_counter_ns()
                for _ in range(batches):
                    a = time.perf_counter_ns()
                    views = kc.get_many(keys)
                    t_call += time.perf_counter_ns() - a
                    del views  # 64 releases
                t_cycle = time.perf_counter_ns() - t0
                if r:  # the first is warm-up
                    call_rates.append(64 * batches / (t_call / 1e9))
                    cycle_rates.append(64 * batches / (t_cycle / 1e9))
            rate, cycle = _median(call_rates), _median(cycle_rates)
            out.emit({"bench": "py_get_many", "batch": 64, "ops_per_s": rate, "ops_per_s_with_release": cycle},
                     f"get_many(64) -> tensors                {rate / 1e6:6.3f} M gets/s   "
                     f"({cycle / 1e6:.3f} M/s counting the views' releases)")
        # --- small blocks in batches: put_many, get_prefix ---------------------------------
        if want("small"):
            blk = SMALL_BLOCK_BYTES
            n_small = 200 if quick else SMALL_BLOCKS
            # Room for two generations of the blocks (a replaced block is freed at commit).
            n_small = max(128, min(n_small, int(slab * 0.4) // (blk + 4 * KiB)))
            if n_small * (blk + 4 * KiB) * 2 > slab:
                out.emit({"bench": "py_put_many_small", "skipped": f"the {slab // MiB} MiB megaslab is too small"},
                         f"put_many of 64 KiB blocks            skipped: the {slab // MiB} MiB megaslab is too small")
            else:
                skeys = [f"bench/py/small/{i}" for i in range(n_small)]
                srcs = [torch.full((blk // 2,), i % 251, dtype=torch.float16) for i in range(n_small)]
                dsts = [torch.zeros_like(t) for t in srcs]
                whole_src = torch.cat(srcs)
                whole_dst = torch.zeros_like(whole_src)
                kc.put_many(skeys, srcs)
                daemon_pid = int(kc.stats().get("daemon_pid", 0)) if args.socket is None else 0
                pm_s, loop_s, one_s = [], [], []
                with _SeparateCores(daemon_pid) as placed:
                    for _ in range(reps + 1):
                        t0 = time.perf_counter_ns()
                        kc.put_many(skeys, srcs)
                        t1 = time.perf_counter_ns()
                        for d, sv in zip(dsts, srcs):
                            d.copy_(sv)
                        t2 = time.perf_counter_ns()
                        whole_dst.copy_(whole_src)
                        t3 = time.perf_counter_ns()
                        pm_s.append((t1 - t0) / 1e9)
                        loop_s.append((t2 - t1) / 1e9)
                        one_s.append((t3 - t2) / 1e9)
                pm, lp, one = _median(pm_s[1:]), _median(loop_s[1:]), _median(one_s[1:])
                over_us = (pm - lp) / n_small * 1e6
                over_one_us = (pm - one) / n_small * 1e6
                ratio = pm / lp
                last = kc.get(skeys[-1])
                if not torch.equal(last, srcs[-1]):
                    raise RuntimeError("put_many stored other bytes than were put")
                del last
                out.emit({"bench": "py_put_many_small", "blocks": n_small, "block_bytes": blk, "put_many_s": pm,
                          "torch_copy_loop_s": lp, "torch_copy_one_s": one, "ratio": ratio,
                          "overhead_per_block_us": over_us, "overhead_vs_one_copy_us": over_one_us,
                          "target_ratio": TARGET_PUT_MANY_RATIO, "target_overhead_us": TARGET_PUT_MANY_OVERHEAD_US,
                          "placement": placed.placement},
                         f"put_many {n_small} x 64 KiB               {pm * 1e3:7.2f} ms vs torch copy_ of the same tensors "
                         f"{lp * 1e3:7.2f} ms = {ratio:.2f}x   target <= {TARGET_PUT_MANY_RATIO}x: "
                         f"{_met(ratio <= TARGET_PUT_MANY_RATIO)}; {over_us:+.2f} us per block   target <= "
                         f"{TARGET_PUT_MANY_OVERHEAD_US} us: {_met(over_us <= TARGET_PUT_MANY_OVERHEAD_US)} "
                         f"(one copy_ of all the bytes {one * 1e3:.2f} ms: {over_one_us:+.2f} us per block; "
                         f"{placed.placement})")
                del dsts, whole_src, whole_dst
                # get_prefix of 128 blocks against torch making 128 views of one tensor: the
                # blocks put from separate tensors (each at its own offset in a page, as the
                # block then is: one DLPack export per view), then from the rows of one
                # tensor (the blocks a fixed stride apart: the views from one export).
                base = torch.zeros(128, blk // 2, dtype=torch.float16)
                rows = torch.stack(srcs[:128])
                ekeys = [f"bench/py/even/{i}" for i in range(128)]
                kc.put_many(ekeys, list(rows))
                rounds = 100 if quick else 500
                for layout, prefix, want in (("", skeys[:128], srcs[5]), (" (one stride)", ekeys, rows[5])):
                    pre_s, torch_s = [], []
                    with _SeparateCores(daemon_pid) as placed:
                        for _ in range(reps + 1):
                            t0 = time.perf_counter_ns()
                            for _ in range(rounds):
                                views = kc.get_prefix(prefix)
                                del views
                            t1 = time.perf_counter_ns()
                            for _ in range(rounds):
                                views = [base[i] for i in range(128)]
                                del views
                            t2 = time.perf_counter_ns()
                            pre_s.append((t1 - t0) / rounds / 1e3)
                            torch_s.append((t2 - t1) / rounds / 1e3)
                    pre, tv = _median(pre_s[1:]), _median(torch_s[1:])
                    got = kc.get_prefix(prefix)
                    if len(got) != 128 or not torch.equal(got[5], want):
                        raise RuntimeError("get_prefix returned other blocks than were put")
                    exports = len({v.untyped_storage().data_ptr() for v in got})
                    del got
                    out.emit({"bench": "py_get_prefix" + ("_strided" if layout else ""), "blocks": 128, "us": pre,
                              "torch_views_us": tv, "ratio": pre / tv, "exports": exports,
                              "target_ratio": TARGET_PREFIX_RATIO, "placement": placed.placement},
                             f"get_prefix of 128 blocks{layout} (incl. release) {pre:7.1f} us vs torch making 128 views "
                             f"{tv:6.1f} us = {pre / tv:.2f}x   target <= {TARGET_PREFIX_RATIO}x: "
                             f"{_met(pre / tv <= TARGET_PREFIX_RATIO)} ({exports} exports; {placed.placement})")
                del srcs, rows
                kc.delete_many(skeys + ekeys)

        kc.close()
        del kc
        gc.collect()
    finally:
        if daemon is not None:
            daemon.stop()
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="benchmarks/python_ops.py",
        description="Python-side figures: get round trip, get of big blocks as views, put against torch copy "
        "bandwidth, batched get_many. (`kachedb-bench ring|ops` are the Rust benchmarks.)",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object per line instead of a table")
    ap.add_argument("--quick", action="store_true", help="a short run: blocks of 1 and 64 MiB, a 64 MiB put, fewer repetitions")
    ap.add_argument("--socket", default=None, help="use the daemon at this socket instead of starting one")
    ap.add_argument("--only", default=None, metavar="SECTIONS",
                    help=f"run only these sections, comma-separated: {','.join(SECTIONS)} (e.g. --only idle)")
    ap.add_argument("--idle-gaps", type=int, default=None, metavar="N",
                    help="idle gaps per kind of request in the idle section (default 15; 3 with --quick)")
    ap.add_argument("--idle-gap-s", type=float, default=None, metavar="S",
                    help="length of each idle gap in seconds (default 1.0; 0.2 with --quick)")
    args = ap.parse_args(list(argv) if argv is not None else None)
    unknown = set(args.only.split(",")) - set(SECTIONS) if args.only else set()
    if unknown:
        ap.error(f"--only: unknown section(s) {', '.join(sorted(unknown))}; the sections are {','.join(SECTIONS)}")
    if args.idle_gaps is not None and args.idle_gaps < 1:
        ap.error(f"--idle-gaps must be at least 1, not {args.idle_gaps}")
    if args.idle_gap_s is not None and not args.idle_gap_s > 0:
        ap.error(f"--idle-gap-s must be a positive number of seconds, not {args.idle_gap_s}")
    try:
        return run(args)
    except ImportError as e:
        print(f"python_ops: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - a benchmark reports, it does not trace back
        from kachedb import KacheDBError

        if isinstance(e, (KacheDBError, RuntimeError)):
            print(f"python_ops: {e}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
