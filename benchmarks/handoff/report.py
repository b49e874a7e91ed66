"""The results as a Markdown table, a chart and the generated block of
docs/benchmarks.md."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import subprocess
from typing import Dict, List, Optional

from .cases import Case, KIB, case_title, fmt_bytes, fmt_ratio, fmt_time
from .floors import floor_rows_markdown
from .services import redis_version
from .transports import TITLES


def add_ratios(results: List[dict]) -> None:
    base = {r["size"]: r["handoff_s"] for r in results if r["transport"] == "kachedb" and "handoff_s" in r}
    for r in results:
        if "handoff_s" in r:
            b = base.get(r["size"])
            r["ratio_vs_kachedb"] = (r["handoff_s"] / b) if b else None


def machine_description() -> dict:
    info: Dict[str, str] = {}
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first CPU is enough
                k, _, v = line.partition(":")
                info[k.strip()] = v.strip()
    cpu = info.get("model name", "?")
    if "cpu family" in info and "model" in info:
        cpu += f" (family {info['cpu family']} model {info['model']})"
    if "hypervisor" in info.get("flags", "").split():
        cpu += ", virtual machine"
    mem = 0
    with contextlib.suppress(OSError):
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem = int(line.split()[1]) * KIB
    versions = {"python": platform.python_version()}
    for mod in ("torch", "numpy", "kachedb", "ray", "redis"):
        with contextlib.suppress(Exception):
            versions[mod] = __import__(mod).__version__
    exe = shutil.which("redis-server")
    if exe:
        versions["redis-server"] = redis_version(exe)
    rev = _git_revision()
    if rev:
        versions["kachedb"] = f"{versions.get('kachedb', '?')} (git {rev})"
    return {"cpu": cpu, "cpus": os.cpu_count(), "mem_total": mem, "kernel": platform.release(),
            "versions": versions}


def _git_revision() -> Optional[str]:
    """The commit of the KacheDB checkout this benchmark runs from, with
    ``+dirty`` for uncommitted changes; None outside one (the installed
    package's directory is no guide: site-packages may sit inside another
    git repository, pyenv's for one)."""
    try:
        where = os.path.dirname(os.path.abspath(__file__))
        top = subprocess.run(["git", "-C", where, "rev-parse", "--show-toplevel"], capture_output=True,
                             text=True, timeout=10)
        if top.returncode != 0 or not os.path.isdir(os.path.join(top.stdout.strip(), "crates", "kachedb-shm")):
            return None
        rev = subprocess.run(["git", "-C", where, "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        if rev.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", where, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return rev.stdout.strip() + ("+dirty" if dirty else "")
    except Exception:
        return None


def render_markdown(results: List[dict], cases: List[Case], transports: List[str], meta: dict,
                    floors: Optional[List[dict]] = None) -> str:
    by = {(r["transport"], r["size"]): r for r in results}
    lines = []
    m = meta["machine"]
    v = ", ".join(f"{k} {val}" for k, val in m["versions"].items())
    lines.append(f"Machine: {m['cpu']}, {m['cpus']} CPUs, {fmt_bytes(m['mem_total'])} RAM, Linux {m['kernel']}; {v}.")
    lines.append(f"Run: `{meta['command']}` ({meta['started']}, {meta['wall_s']:.0f} s).")
    lines.append("")
    lines.append("End-to-end handoff (producer starts -> consumer holds a verified `torch.Tensor`), median; "
                 "in brackets: × KacheDB's time (above 1 = slower than KacheDB).")
    lines.append("")
    hdr = "| transport | " + " | ".join(case_title(c) for c in cases) + " |"
    lines += [hdr, "|---|" + "---:|" * len(cases)]
    for t in transports:
        cells = []
        for c in cases:
            r = by.get((t, c.label))
            if r is None:
                cells.append("–")
            elif "handoff_s" in r:
                ratio = r.get("ratio_vs_kachedb")
                mark = "" if r["verified"] else " ✗ DATA MISMATCH"
                cells.append(fmt_time(r["handoff_s"]) + ("" if t == "kachedb" or ratio is None else f" ({fmt_ratio(ratio)})") + mark)
            else:
                cells.append("skipped" if "skipped" in r else "failed")
        lines.append(f"| {TITLES[t]} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Detail (medians; `touch` = the consumer's first read of every page afterwards, not in handoff):")
    lines.append("")
    lines.append("| size | transport | producer | consumer | handoff | × KacheDB | handoff min–max | touch | reps | data |")
    lines.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for c in cases:
        for t in transports:
            r = by.get((t, c.label))
            if r is None:
                continue
            if "handoff_s" in r:
                ratio = r.get("ratio_vs_kachedb")
                lines.append(f"| {case_title(c)} | {TITLES[t]} | {fmt_time(r['producer_s'])} | {fmt_time(r['consumer_s'])} | "
                             f"{fmt_time(r['handoff_s'])} | {'' if ratio is None else f'{ratio:.2f}'} | "
                             f"{fmt_time(r['handoff_min_s'])} – {fmt_time(r['handoff_max_s'])} | "
                             f"{fmt_time(r['touch_s'])} | {r['reps']} | {'verified' if r['verified'] else 'MISMATCH'} |")
            else:
                why = r.get("skipped") or ("failed: " + r.get("error", "?"))
                lines.append(f"| {case_title(c)} | {TITLES[t]} | | | | | | | | {why} |")
    skipped = [case_title(c) for c in cases
               if any(r["size"] == c.label and "MemAvailable" in r.get("skipped", "") for r in results)]
    if skipped:
        lines.append("")
        lines.append(f"Skipped for lack of memory: {', '.join(skipped)}.")
    titles = {c.label: case_title(c) for c in cases}
    lines += floor_rows_markdown(floors or [], lambda label: titles.get(label, label))
    if meta.get("notes"):
        lines.append("")
        lines.append("Notes: " + "; ".join(meta["notes"]) + ".")
    cl = meta.get("cleanup")
    if cl is not None:
        lines.append("")
        lines.append("Cleanup check: " + ("every process and shared-memory segment the run made is gone."
                                          if cl["ok"] else f"FAILED: {json.dumps(cl)}"))
    return "\n".join(lines) + "\n"


def render_chart(results: List[dict], cases: List[Case], transports: List[str], path: str, meta: dict) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib): no chart"
    from matplotlib.ticker import FuncFormatter

    by = {(r["transport"], r["size"]): r for r in results}
    fig, ax = plt.subplots(figsize=(12, 5.5), dpi=110)
    width = 0.8 / max(1, len(transports))
    colors = {"kachedb": "#d62728", "tcp": "#1f77b4", "uds": "#17becf", "shm": "#2ca02c",
              "torch_mp": "#ff7f0e", "ray": "#9467bd", "redis": "#8c564b"}
    for i, t in enumerate(transports):
        xs, ys, labels = [], [], []
        for j, c in enumerate(cases):
            r = by.get((t, c.label))
            if r and "handoff_s" in r:
                xs.append(j + (i - (len(transports) - 1) / 2) * width)
                ys.append(r["handoff_s"])
                ratio = r.get("ratio_vs_kachedb")
                labels.append("" if t == "kachedb" or ratio is None else fmt_ratio(ratio))
        ax.bar(xs, ys, width, label=TITLES[t], color=colors.get(t), edgecolor="black" if t == "kachedb" else None,
               linewidth=0.8)
        for x, y, lab in zip(xs, ys, labels):
            ax.text(x, y * 1.08, lab, ha="center", va="bottom", fontsize=6.5, rotation=90)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g} s" if v >= 1 else fmt_time(v)))
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels([case_title(c) for c in cases])
    lo, hi = ax.get_ylim()
    ax.set_ylim(lo, hi * 2.5)
    ax.set_ylabel("end-to-end handoff, median (log scale)")
    ax.set_title("Producer process -> consumer process holding a usable torch.Tensor (lower is better; × = vs KacheDB)")
    ax.grid(axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    m = meta["machine"]
    fig.text(0.01, 0.01, f"{m['cpu']}, {m['cpus']} CPUs, {fmt_bytes(m['mem_total'])}; {meta['started']}", fontsize=7)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path)
    plt.close(fig)
    return None


BEGIN, END = "<!-- compare:begin (generated by the benchmark; edits here are overwritten) -->", "<!-- compare:end -->"


def update_doc(path: str, md: str, chart_rel: Optional[str]) -> None:
    body = md + (f"\n![handoff time per transport and size]({chart_rel})\n" if chart_rel else "")
    block = f"{BEGIN}\n{body}{END}"
    text = open(path).read() if os.path.exists(path) else ""
    if BEGIN in text and END in text:
        a, rest = text.split(BEGIN, 1)
        _, b = rest.split(END, 1)
        text = a + block + b
    else:
        text = text + ("\n" if text and not text.endswith("\n") else "") + block + "\n"
    with open(path, "w") as f:
        f.write(text)
