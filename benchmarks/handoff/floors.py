"""The copy floors of a run: each size's bytes copied by glibc ``memcpy`` on one
thread and split between threads, in this process, in the same run as the
transports. A put into KacheDB is one copy (the producer's client copies the
tensor into the daemon's shared memory), so the best of these two is the least
it can cost; ``kachedb_vs_floor`` says how close the producer gets, and
``reaches`` which floor its time is at.

The destination is shared anonymous memory (shmem pages, as the daemon's
megaslab), faulted in before timing; the source is private memory holding
varied bytes. The bytes are copied as one contiguous range (one ``memcpy`` per
thread): the floor of the bandwidth, without the per-block costs that a size of
many blocks adds to every transport."""

from __future__ import annotations

import ctypes
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, List, Optional

from .cases import GIB, MIB, Case, fmt_bytes

#: At most this many threads copy (as ``kachedb_client::copy``: a few saturate a socket's memory bandwidth).
MAX_THREADS = 8
#: A floor needs a source and a destination of the size, plus this much left over.
HEADROOM = 1 * GIB
#: A producer within this factor of a floor is said to reach it.
REACH = 1.1


def copy_threads() -> int:
    """Threads of the multi-threaded floor: this process's CPUs, at most ``MAX_THREADS``."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except OSError:
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, MAX_THREADS))


def _reps(total: int) -> int:
    return 3 if total >= GIB else 5 if total >= 256 * MIB else 9


def _median(xs: List[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2.0


def measure_floor(total: int, threads: int) -> Dict[str, float]:
    """Medians (and minima) of copying ``total`` bytes with one ``memcpy``, and
    with ``threads`` threads each copying a page-aligned share, after a warm-up.
    ``ctypes.memmove`` releases the GIL, so the threads copy in parallel."""
    src = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    dst = mmap.mmap(-1, total, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    try:
        pattern = bytes(range(251)) * (4 * MIB // 251 + 1)
        for off in range(0, total, 4 * MIB):  # varied bytes; every page of both faulted in
            n = min(4 * MIB, total - off)
            src[off:off + n] = pattern[:n]
            dst[off:off + n] = pattern[:n]
        s_addr = ctypes.addressof(ctypes.c_char.from_buffer(src))
        d_addr = ctypes.addressof(ctypes.c_char.from_buffer(dst))
        share = -(-total // threads // 4096) * 4096
        parts = [(off, min(share, total - off)) for off in range(0, total, share)]
        clock = time.perf_counter

        def one() -> float:
            t0 = clock()
            ctypes.memmove(d_addr, s_addr, total)
            return clock() - t0

        with ThreadPoolExecutor(max_workers=len(parts), thread_name_prefix="floor-copy") as pool:
            def many() -> float:
                t0 = clock()
                for f in [pool.submit(ctypes.memmove, d_addr + off, s_addr + off, n) for off, n in parts]:
                    f.result()
                return clock() - t0

            single, multi = [], []
            for r in range(_reps(total) + 1):
                a, b = one(), many()
                if r:  # the first is the warm-up
                    single.append(a)
                    multi.append(b)
        if dst[total - 1:total] != src[total - 1:total] or dst[:64] != src[:64]:
            raise RuntimeError("the floor's copy left other bytes than its source")
        return {"memcpy_1t_s": _median(single), "memcpy_1t_min_s": min(single),
                "memcpy_mt_s": _median(multi), "memcpy_mt_min_s": min(multi), "reps": len(single)}
    finally:
        src.close()
        dst.close()


def measure_floors(cases: List[Case], mem_available: Callable[[], int], log: Callable[[str], None]) -> List[dict]:
    """One floor row per size that fits in memory (a skipped row says why)."""
    threads = copy_threads()
    rows = []
    for c in cases:
        row: dict = {"floor": "memcpy", "size": c.label, "bytes": c.total, "threads": threads}
        need = 2 * c.total + HEADROOM
        avail = mem_available()
        if avail < need:
            row["skipped"] = f"needs ~{fmt_bytes(need)}, MemAvailable is {fmt_bytes(avail)}"
        else:
            row.update(measure_floor(c.total, threads))
            log(f"  memcpy of {fmt_bytes(c.total)}: {row['memcpy_1t_s'] * 1e3:.1f} ms on 1 thread, "
                f"{row['memcpy_mt_s'] * 1e3:.1f} ms on {threads}")
        rows.append(row)
    return rows


def add_floor_ratios(floors: List[dict], results: List[dict]) -> None:
    """Adds to each floor row KacheDB's producer time of its size (the put: one
    copy), ``kachedb_vs_floor`` (the best floor's time / the producer's: 1 is
    the floor, above 1 faster than it) and ``reaches``: the fastest floor whose
    time the producer is within ``REACH`` of, or ``none``."""
    prod = {r["size"]: r["producer_s"] for r in results if r.get("transport") == "kachedb" and "producer_s" in r}
    for f in floors:
        p = prod.get(f["size"])
        if p is None or "memcpy_1t_s" not in f:
            continue
        best = min(f["memcpy_1t_s"], f["memcpy_mt_s"])
        f["kachedb_producer_s"] = p
        f["kachedb_vs_floor"] = best / p
        f["kachedb_vs_memcpy_1t"] = f["memcpy_1t_s"] / p
        f["kachedb_vs_memcpy_mt"] = f["memcpy_mt_s"] / p
        reached = [(t, name) for t, name in ((f["memcpy_mt_s"], f"memcpy on {f['threads']} threads"),
                                             (f["memcpy_1t_s"], "memcpy on 1 thread")) if p <= REACH * t]
        f["reaches"] = min(reached)[1] if reached else "none"


def floor_rows_markdown(floors: List[dict], title: Callable[[str], str]) -> List[str]:
    """The floors' table: each size's memcpy times beside KacheDB's producer."""
    if not floors:
        return []
    from .cases import fmt_time

    lines = ["", "Copy floors (the same bytes copied by glibc `memcpy` in this process, same run; KacheDB's put is "
             "one copy, by the producer's client): × floor = the best floor's time / KacheDB's producer time "
             f"(1 = at the floor); reaches = the fastest floor it is within {REACH:g}× of.", "",
             "| size | memcpy, 1 thread | memcpy, N threads | KacheDB producer | × floor | reaches |",
             "|---|---:|---:|---:|---:|---|"]
    for f in floors:
        if "skipped" in f:
            lines.append(f"| {title(f['size'])} | | | | | skipped: {f['skipped']} |")
            continue
        prod: Optional[float] = f.get("kachedb_producer_s")
        lines.append(f"| {title(f['size'])} | {fmt_time(f['memcpy_1t_s'])} | {fmt_time(f['memcpy_mt_s'])} "
                     f"(N = {f['threads']}) | {fmt_time(prod)} | "
                     f"{'' if prod is None else format(f['kachedb_vs_floor'], '.2f')} | {f.get('reaches', '')} |")
    return lines
