#!/usr/bin/env python3
"""A 2K-token prompt's KV stored and retrieved through LMCache with the KacheDB
remote tier vs with LMCache's own local CPU tier, in the same run.

Run with the LMCache environment (``make lmcache-env``)::

    .venv-lmcache/bin/python benchmarks/lmcache_backend.py [--json] [--tokens 2048] [--reps 5]

Two real LMCache engines in this process (``tests/lmcache/lmcache_support.py``:
bfloat16 KV, a CPU copy connector standing in for the GPU one), one daemon (the
real binary, ``target/release/kachedb``):

* ``local_cpu``: an engine with its local CPU tier only. ``store`` is
  ``engine.store`` (the chunks copied out of the KV buffer into LMCache's CPU
  memory); ``retrieve`` is ``engine.retrieve`` with the chunks in that tier
  (copied back into a zeroed KV buffer).
* ``kachedb``: an engine with the KacheDB plugin. ``store`` is ``engine.store``
  until every chunk is in the daemon (LMCache puts to remote tiers
  asynchronously: the time includes LMCache's copy of the KV into its chunk
  memory, which with the plugin is reserved in the daemon's region, and the
  put, which commits those reservations under their keys, polled on the
  daemon: one copy; a chunk the plugin had to copy, counted from
  ``kachedb.lmcache.stats()``, makes it two); ``retrieve`` is ``engine.retrieve`` with LMCache's CPU
  tier emptied first, so every chunk comes from the daemon (a ``MemoryObj`` that
  is the block's view, copied into the KV buffer: one copy, as from the local
  tier).

The local CPU tier is the same-run baseline: the ratio is KacheDB's time over
it (1.0 = as fast as LMCache's private tier). Between repetitions the tiers are
emptied (the KacheDB chunks deleted). Figures are medians over ``--reps`` (after
``--warmup`` unmeasured ones); per chunk = total / chunks. Every retrieve is
checked byte-equal, and once LMCache's local tier is emptied at the end no pin
may be left in the daemon.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "lmcache"), str(ROOT / "tests")]  # lmcache_support, engine_support


def _ms(xs):
    return statistics.median(xs) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--tokens", type=int, default=2048, help="prompt length (default 2048)")
    ap.add_argument("--reps", type=int, default=15, help="repetitions (default 15; medians)")
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured repetitions first (default 1)")
    ap.add_argument("--chunk", type=int, default=256, help="LMCache chunk size in tokens (default 256, LMCache's)")
    ap.add_argument("--layers", type=int, default=16, help="layers (default 16)")
    ap.add_argument("--kv-heads", type=int, default=8, help="KV heads (default 8)")
    ap.add_argument("--head-size", type=int, default=64, help="head size (default 64)")
    ap.add_argument("--daemon-size", default="2GiB", help="the daemon's megaslab (default 2GiB)")
    a = ap.parse_args()

    import torch

    import lmcache_support as S

    hidden = a.kv_heads * a.head_size
    token_bytes = 2 * a.layers * hidden * 2
    prompt_bytes = a.tokens * token_bytes
    local_gib = max(0.25, 3 * prompt_bytes / 2**30)
    dims = dict(layers=a.layers, heads=a.kv_heads, head_size=a.head_size, chunk_tokens=a.chunk, local_cpu_gib=local_gib)

    daemon = S.Daemon(size=a.daemon_size).start()
    try:
        from lmcache.v1.cache_engine import LMCacheEngineBuilder

        local = S.build_engine("bench-local", socket=None, **dims)
        kdb = S.build_engine("bench-kachedb", socket=daemon.socket, **dims)
        conn = S.kachedb_connector(kdb)
        if conn is None:
            raise SystemExit(f"the KacheDB plugin did not build (see LMCache's log); daemon log:\n{daemon.log()}")
        tokens = S.prompt_tokens(a.tokens, 1)
        kv = S.prompt_kv(a.tokens, 1, layers=a.layers, hidden=hidden)
        want = kv.view(torch.uint8)
        dkeys = [conn.daemon_key(k) for k in S.chunk_keys(kdb, tokens)]
        n_chunks = len(dkeys)
        observer = daemon.client()
        import kachedb.lmcache

        copied_before = kachedb.lmcache.stats()
        t = {"local_cpu": {"store": [], "retrieve": []}, "kachedb": {"store": [], "retrieve": []}}
        ok = True
        for rep in range(a.warmup + a.reps):
            if rep == a.warmup:  # the warm-up's figures are dropped
                t = {tier: {op: [] for op in d} for tier, d in t.items()}
            # LMCache's local CPU tier
            local.clear()
            s = time.perf_counter()
            local.store(tokens, kv=kv)
            t["local_cpu"]["store"].append(time.perf_counter() - s)
            got = torch.zeros_like(kv)
            s = time.perf_counter()
            m = local.retrieve(tokens, kv=got, req_id="bench")
            t["local_cpu"]["retrieve"].append(time.perf_counter() - s)
            ok &= int(m.sum()) == a.tokens and torch.equal(got.view(torch.uint8), want)

            # the KacheDB tier
            S.clear_local(kdb, tokens)
            observer.delete_many(dkeys)
            s = time.perf_counter()
            kdb.store(tokens, kv=kv)
            deadline = s + 60
            while observer.lookup(dkeys) < n_chunks:
                if time.perf_counter() > deadline:
                    raise SystemExit("the KacheDB puts did not land within 60 s")
                time.sleep(0.0002)
            t["kachedb"]["store"].append(time.perf_counter() - s)
            S.clear_local(kdb, tokens)
            got = torch.zeros_like(kv)
            hits_before = observer.stats()["get_hits"]
            s = time.perf_counter()
            m = kdb.retrieve(tokens, kv=got, req_id="bench")
            t["kachedb"]["retrieve"].append(time.perf_counter() - s)
            ok &= int(m.sum()) == a.tokens and torch.equal(got.view(torch.uint8), want)
            ok &= observer.stats()["get_hits"] - hits_before == n_chunks
        after = kachedb.lmcache.stats()
        stored = after.get("stored_chunks", 0) - copied_before.get("stored_chunks", 0)
        in_place = after.get("stored_in_place", 0) - copied_before.get("stored_in_place", 0)
        # LMCache's local tier holds the last retrieve's chunks (views: pinned)
        pins_held = observer.stats()["pins"]
        S.clear_local(kdb, tokens)
        deadline = time.perf_counter() + 10
        while observer.stats()["pins"] and time.perf_counter() < deadline:
            time.sleep(0.01)  # (pins are released fire-and-forget)
        pins_left = observer.stats()["pins"]
        LMCacheEngineBuilder.destroy("bench-kachedb")
        LMCacheEngineBuilder.destroy("bench-local")
    finally:
        daemon.stop()

    res = {
        "config": {
            "tokens": a.tokens,
            "chunk_tokens": a.chunk,
            "chunks": n_chunks,
            "layers": a.layers,
            "kv_heads": a.kv_heads,
            "head_size": a.head_size,
            "dtype": "bfloat16",
            "prompt_bytes": prompt_bytes,
            "reps": a.reps,
        },
        "byte_equal": bool(ok),
        "pins_held_by_local_tier": pins_held,
        "pins_left": pins_left,
        "stored_chunks": stored,
        "stored_in_place": in_place,
        "copies": {
            "local_cpu": {"store": 1, "retrieve": 1},
            "kachedb": {"store": 1 if stored and in_place == stored else 2, "retrieve": 1},
        },
    }
    for tier, d in t.items():
        res[tier] = {
            "store_ms": _ms(d["store"]),
            "store_per_chunk_ms": _ms(d["store"]) / n_chunks,
            "retrieve_ms": _ms(d["retrieve"]),
            "retrieve_per_chunk_ms": _ms(d["retrieve"]) / n_chunks,
            "retrieve_gb_s": prompt_bytes / statistics.median(d["retrieve"]) / 1e9,
        }
    res["ratio"] = {op: res["kachedb"][f"{op}_ms"] / res["local_cpu"][f"{op}_ms"] for op in ("store", "retrieve")}
    if a.json:
        print(json.dumps(res, indent=1))
    else:
        c = res["config"]
        print(
            f"{c['tokens']} tokens, {c['chunks']} chunks of {c['chunk_tokens']}, "
            f"{c['prompt_bytes'] / 2**20:.1f} MiB of bf16 KV; medians of {c['reps']}"
        )
        print(f"{'':<9} {'local CPU tier (baseline)':>27} {'KacheDB tier':>24} {'ratio':>7}")
        print(f"{'':<9} {'ms':>9} {'ms/chunk':>9} {'copies':>7} {'ms':>9} {'ms/chunk':>9} {'copies':>6}")
        for op in ("store", "retrieve"):
            lo, kd = res["local_cpu"], res["kachedb"]
            print(
                f"{op:<9} {lo[f'{op}_ms']:9.2f} {lo[f'{op}_per_chunk_ms']:9.3f} {res['copies']['local_cpu'][op]:7d} "
                f"{kd[f'{op}_ms']:9.2f} {kd[f'{op}_per_chunk_ms']:9.3f} {res['copies']['kachedb'][op]:6d} "
                f"{res['ratio'][op]:6.2f}x"
            )
        print(
            f"byte-equal: {res['byte_equal']}; chunks stored in place (no copy by the plugin): {in_place} of {stored}; "
            f"pins held by LMCache's local tier after the last retrieve: {pins_held}, left once it is emptied: {pins_left}"
        )
    if not ok or pins_left:
        sys.exit(1)


if __name__ == "__main__":
    main()
