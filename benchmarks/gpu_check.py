#!/usr/bin/env python3
"""KacheDB on a CUDA GPU: the checks that need one (issue 10).

1. ``register_cuda()`` on a multi-GB region (``--size``, default 4 GiB).
2. H2D and D2H of 256 MiB between the registered region and the GPU, against a
   ``pin_memory=True`` torch tensor in the same run (goal: >= 90 %).
3. ``non_blocking=True`` copies of views to the GPU (issue 12, item 6): a view
   copied with ``kachedb.to_device(view, "cuda", non_blocking=True)`` and dropped
   at once, its key deleted and its extent written by a new block while the DMA
   may still run, must arrive exact on the GPU (its pin is kept until a CUDA
   event after the copy completes); the same with a plain
   ``view.to("cuda", non_blocking=True)`` is reported (it may arrive mixed).
4. The vLLM worker's GPU store/load path (``kachedb.vllm.worker``) on synthetic
   vLLM-shaped KV caches (per layer ``(num_blocks, page_bytes)`` views of one CUDA
   buffer): blocks stored from the GPU, loaded back into other GPU blocks, bytes
   compared.

Where no CUDA GPU is at hand it says so and exits 0. Needs torch with CUDA, the
kachedb package and the daemon binary (``--bin``); step 3 also needs vLLM (skipped,
saying so, without it)::

    python benchmarks/gpu_check.py [--json] [--size 4GiB] [--bin target/release/kachedb]
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: harness/
from harness.daemon import Daemon  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _gbps(nbytes, seconds):
    return nbytes / seconds / 1e9


def _time_copy(dst, src, reps, torch):
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    best = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        dst.copy_(src, non_blocking=True)
        e.record()
        e.synchronize()
        best.append(s.elapsed_time(e) / 1e3)
    best.sort()
    return best[len(best) // 2]


def copy_bandwidth(kc, torch, nbytes, reps):
    """H2D / D2H of ``nbytes`` between a registered-region block and the GPU vs a pinned tensor."""
    gpu = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    with kc.reserve(b"gpu-check-256MiB", (nbytes,), torch.uint8) as shm:
        shm.fill_(1)
        res = {
            "h2d_region_GBps": _gbps(nbytes, _time_copy(gpu, shm, reps, torch)),
            "h2d_pinned_GBps": _gbps(nbytes, _time_copy(gpu, pinned, reps, torch)),
            "d2h_region_GBps": _gbps(nbytes, _time_copy(shm, gpu, reps, torch)),
            "d2h_pinned_GBps": _gbps(nbytes, _time_copy(pinned, gpu, reps, torch)),
        }
    kc.delete(b"gpu-check-256MiB")
    res["h2d_ratio"] = res["h2d_region_GBps"] / res["h2d_pinned_GBps"]
    res["d2h_ratio"] = res["d2h_region_GBps"] / res["d2h_pinned_GBps"]
    res["goal_90pct"] = res["h2d_ratio"] >= 0.9 and res["d2h_ratio"] >= 0.9
    return res


def non_blocking_copies(kc, torch, nbytes, rounds=5):
    """Copies a view to the GPU without waiting, drops it, and overwrites its
    extent at once; how many rounds arrived exact, by ``kachedb.to_device``
    and by a plain ``.to(non_blocking=True)``."""
    import kachedb

    res = {"rounds": rounds, "to_device_exact": 0, "plain_exact": 0}
    old = torch.full((nbytes,), 0x11, dtype=torch.uint8)
    new = torch.full((nbytes,), 0x22, dtype=torch.uint8)
    for how in ("to_device", "plain"):
        for i in range(rounds):
            key = f"gpu-check-nb-{how}-{i}"
            kc.put(key, old)
            view = kc.get(key)
            if how == "to_device":
                gpu = kachedb.to_device(view, "cuda", non_blocking=True)
            else:
                gpu = view.to("cuda", non_blocking=True)
            del view
            kc.delete(key)
            kc.put(key + "-next", new)  # best fit: the extent just freed, if it was
            torch.cuda.synchronize()
            res[f"{how}_exact"] += int(bool((gpu == 0x11).all().item()))
            del gpu
            kc.delete(key + "-next")
    res["ok"] = res["to_device_exact"] == rounds
    return res


def worker_path(sock, torch, num_layers=8, num_blocks=256, page=64 * 1024, n=64):
    """kachedb.vllm's worker on synthetic vLLM-shaped CUDA KV caches: store n blocks,
    load them into other blocks, compare bytes."""
    try:
        from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor, GPULoadStoreSpec
    except Exception as e:  # noqa: BLE001 - vLLM missing or not importable with this torch
        return {"skipped": f"vLLM's kv_offload types are not importable here ({type(e).__name__}: {e})"}
    from types import SimpleNamespace

    from kachedb.vllm import _state
    from kachedb.vllm.manager import KacheDBLoadStoreSpec
    from kachedb.vllm.worker import KacheDBOffloadingWorker

    buf = torch.randint(-128, 127, (num_layers, num_blocks, page), dtype=torch.int8, device="cuda")
    tensors = [CanonicalKVCacheTensor(buf[l], page) for l in range(num_layers)]
    caches = CanonicalKVCaches(tensors, [[CanonicalKVCacheRef(l, page) for l in range(num_layers)]])
    ns = os.urandom(16)
    spec = SimpleNamespace(socket=sock, rank=0, retry_s=5.0, store_mode="batched", stats_file=None,
                           daemon_key=lambda k, rank=None: ns + bytes(k))
    w = KacheDBOffloadingWorker(spec, caches)
    # Round 0 pays the first use (the side stream, the first reservations); rounds 1.. are warm.
    rounds, equal, done, invalid = [], True, set(), []
    for r in range(3):
        src, dst = list(range(n)), list(range(n, 2 * n))
        keys = [(r * n + i).to_bytes(32, "big") + b"\0\0\0\0" for i in range(n)]
        buf[:, dst].zero_()
        torch.cuda.synchronize()
        t = time.perf_counter()
        w.submit_store(2 * r + 1, GPULoadStoreSpec(src, [n], [0]), KacheDBLoadStoreSpec(keys))
        w.wait({2 * r + 1})
        store_s = time.perf_counter() - t
        t = time.perf_counter()
        w.submit_load(2 * r + 2, KacheDBLoadStoreSpec(keys), GPULoadStoreSpec(dst, [n], [0]))
        w.wait({2 * r + 2})
        torch.cuda.synchronize()
        load_s = time.perf_counter() - t
        done |= {x.job_id for x in w.get_finished()}
        equal = equal and bool(torch.equal(buf[:, src], buf[:, dst]))
        invalid += w.take_invalid_block_ids()
        rounds.append({"store_s": store_s, "load_s": load_s})
    nbytes = n * num_layers * page
    w.shutdown()
    store_s, load_s = rounds[-1]["store_s"], rounds[-1]["load_s"]
    return {"blocks": n, "block_bytes": num_layers * page, "jobs_finished": sorted(done), "bytes_equal": equal,
            "failed_blocks": sorted(invalid), "store_GBps": _gbps(nbytes, store_s), "load_GBps": _gbps(nbytes, load_s),
            "first_store_GBps": _gbps(nbytes, rounds[0]["store_s"]), "rounds": rounds,
            "counters": {k: v for k, v in _state.snapshot().items() if k not in ("stored_keys", "loaded_keys", "namespaces")}}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--size", default="4GiB", help="region size (multi-GB)")
    ap.add_argument("--copy-mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--bin", default=str(ROOT / "target" / "release" / "kachedb"))
    a = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("gpu_check: torch is not installed: nothing to check here")
        return 0
    if not torch.cuda.is_available():
        msg = "gpu_check: no CUDA GPU here (torch.cuda.is_available() is False): nothing to check; run it on a GPU machine"
        print(json.dumps({"gpu": None, "skipped": msg}) if a.json else msg)
        return 0
    import kachedb

    tmp = tempfile.mkdtemp(prefix="kachedb-gpu-")
    sock = os.path.join(tmp, "k.sock")
    d = Daemon(sock, a.size, binary=a.bin, ready_timeout_s=120).start()
    out = {"gpu": torch.cuda.get_device_name(0), "region": a.size}
    try:
        with kachedb.connect(sock) as kc:
            t = time.perf_counter()
            kc.register_cuda()
            out["register_cuda_s"] = time.perf_counter() - t
            out["copies"] = copy_bandwidth(kc, torch, a.copy_mib << 20, a.reps)
            out["non_blocking"] = non_blocking_copies(kc, torch, a.copy_mib << 20)
        out["worker"] = worker_path(sock, torch)
        with kachedb.connect(sock) as kc:
            st = kc.stats()
        out["daemon_after"] = {k: st[k] for k in ("pins", "reserved", "blocks")}
    finally:
        d.stop()
    if a.json:
        print(json.dumps(out, indent=1))
    else:
        c = out["copies"]
        print(f"GPU {out['gpu']}; register_cuda() of a {a.size} region: {out['register_cuda_s'] * 1e3:.0f} ms")
        print(f"H2D {a.copy_mib} MiB: region {c['h2d_region_GBps']:.1f} GB/s vs pinned {c['h2d_pinned_GBps']:.1f} GB/s ({100 * c['h2d_ratio']:.0f} %)")
        print(f"D2H {a.copy_mib} MiB: region {c['d2h_region_GBps']:.1f} GB/s vs pinned {c['d2h_pinned_GBps']:.1f} GB/s ({100 * c['d2h_ratio']:.0f} %)")
        print(f"non_blocking copies: {json.dumps(out['non_blocking'])}")
        print(f"worker GPU path: {json.dumps(out['worker'])}")
        print(f"daemon after: {out['daemon_after']}")
    ok = out["worker"].get("skipped") or (out["worker"]["bytes_equal"] and not out["worker"]["failed_blocks"])
    ok = ok and out["non_blocking"]["ok"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
