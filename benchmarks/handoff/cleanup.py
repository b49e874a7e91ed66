"""The check that a run left no process and no shared-memory segment behind."""

from __future__ import annotations

import contextlib
import ctypes
import os
import time
from typing import Dict, List, Tuple

from .transports import SHM_PREFIX


def set_subreaper() -> bool:
    """Orphaned descendants (a daemon whose parent died, Ray's workers) are
    re-parented to this process, so the final check sees every process the run
    started."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except Exception:
        return False


def _proc_table() -> Dict[int, Tuple[int, str, str]]:
    """pid -> (ppid, state, cmdline)."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
            rest = stat[stat.rindex(")") + 2:].split()
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            out[int(d)] = (int(rest[1]), rest[0], cmd or stat[stat.index("(") + 1:stat.rindex(")")])
        except (OSError, ValueError, IndexError):
            continue
    return out


def _descendants(root: int, table: Dict[int, Tuple[int, str, str]]) -> List[int]:
    kids: Dict[int, List[int]] = {}
    for pid, (ppid, _, _) in table.items():
        kids.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.append(k)
            todo.append(k)
    return out


def _reap_zombies() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def shm_names() -> set:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def stop_resource_tracker() -> None:
    with contextlib.suppress(Exception):
        from multiprocessing import resource_tracker

        stop = getattr(resource_tracker._resource_tracker, "_stop", None)
        if stop is not None:
            stop()


def check_cleanup(shm_before: set, tmp: str, markers: List[str], wait_s: float = 15.0) -> dict:
    """Waits up to ``wait_s`` for stragglers, then reports leftover processes
    (descendants of this one, or any process naming the run's temp dir or Redis
    port) and shared-memory segments this run made."""
    me = os.getpid()
    deadline = time.monotonic() + wait_s
    while True:
        _reap_zombies()
        table = _proc_table()
        left = [p for p in _descendants(me, table) if table[p][1] != "Z"]
        left += [p for p, (_, st, cmd) in table.items()
                 if p != me and p not in left and st != "Z" and any(m and m in cmd for m in markers)]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    procs = [{"pid": p, "cmd": table[p][2][:200]} for p in left if p in table]
    new_shm = sorted(shm_names() - shm_before)
    ours = [n for n in new_shm if n.startswith((SHM_PREFIX, "torch_", "plasma", "ray"))]
    tmp_left = os.path.exists(tmp)
    return {"ok": not procs and not ours and not tmp_left, "leftover_processes": procs,
            "leftover_shm": ours, "other_new_shm": [n for n in new_shm if n not in ours],
            "temp_dir_left": tmp_left}
