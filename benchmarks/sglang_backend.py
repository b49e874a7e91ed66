#!/usr/bin/env python3
"""Store and retrieve of a prompt's KV through SGLang HiCache's L3 storage:
the KacheDB backend vs SGLang's own file backend, in the same run, on SGLang's
real host pools (CPU).

Run with the SGLang environment (``make sglang-env``; ninja on PATH for SGLang's
page-hash extension, as ``make bench-sglang`` sets it)::

    PATH=.venv-sglang/bin:$PATH .venv-sglang/bin/python benchmarks/sglang_backend.py [--json]
        [--tokens 2048] [--reps 5] [--layouts page_first,layer_first]

Per layout and rep, a fresh prompt (SGLang's own 64-hex page hashes) whose KV
fills ``--tokens`` slots of a host pool is

* ``kachedb``: stored with ``batch_set_v1`` and retrieved with ``batch_exists`` +
  ``batch_get_v1`` into other slots (the zero-copy path SGLang's controller takes
  with ``interface_v1``), through the real daemon binary (started here);
* ``file``: SGLang's ``HiCacheFile`` (``--hicache-storage-backend file``) driven as
  its controller drives it: ``get_data_page`` + ``batch_set`` to store,
  ``batch_exists`` + ``batch_get`` into dummy pages + ``set_from_flat_data_page``
  to retrieve; files under ``--file-dir`` (default: a temporary directory);
* ``copy`` (the same-run baseline): the same bytes copied between the same
  buffers, with nothing else: the pages' byte ranges (``get_page_buffer_meta``)
  copied from the host pool into blocks freshly reserved in the daemon's shared
  memory for each prompt (never written before, as the blocks KacheDB stores
  into) (store), and from those blocks into the host pool's other slots
  (retrieve), by torch: one strided view per page for the MHA pools (the
  fewest views that name the page's ranges), all pages in one
  ``torch._foreach_copy_`` call (torch's multi-threaded copy), the views made
  before the clock starts. (KacheDB's v1 path copies the same byte ranges
  natively: ``Client.put_ranges`` / ``get_prefix_into``.) KacheDB's figure as a
  percentage of it is how close its v1
  path comes to the cost of the copy itself (100 % = nothing but the copy);
* ``memcpy``: the same pages copied host slot to host slot with the pool's own
  page copy (``get_data_page`` / ``set_from_flat_data_page``; strided for
  ``layer_first``): what moving the bytes within host memory costs.

Before each timed operation ``--evict-mib`` MiB are written, so that every
operation starts with the prompt's bytes out of the CPU caches (as after the
GPU wrote the host pages), not with what the operation before it left there.
They are written by one thread (numpy), not by a parallel torch op: after one,
torch's OpenMP workers spin for a few milliseconds (libgomp's wait policy),
holding a core that any other thread then shares, while torch's own next copy
finds them hot. Neither is how an engine's store starts (SGLang's controller
stores pages that a GPU copy wrote); ``--evict-with torch`` keeps that
condition, to see it.
KacheDB and the copy run back to back (both stores, then both retrieves),
each of them first in every other rep; the file backend and ``memcpy`` follow,
and the file backend's dirty pages are written back (``os.sync``) before the
next rep, so that no rep's figures pay for the previous rep's writeback.
Both backends and the baseline are checked byte-equal after each retrieve. Figures are medians
over ``--reps`` prompts: milliseconds for the whole prompt and microseconds per
page. Copies per page: KacheDB's v1 path one each way (host pool to shared
memory, shared memory to host pool); the file backend's store two (the page
into a flat tensor, then a file write) and its retrieve two (a file read into a
flat page, then into the host pool). The model geometry defaults to a Llama-3.2-1B-like layer stack
(16 layers, 8 KV heads of 64, bfloat16, 64 tokens per page: 32 KiB per token).
"""

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # harness/
from harness.daemon import Daemon, built_binary  # noqa: E402


def grid(addrs, row_sizes):
    """``(shape, strides, extent)`` of one view that lays each page's byte
    ranges out in order, when ``addrs`` (pages x ranges) is the same grid in
    every page (equal range sizes; offsets ``o * s_outer + i * s_inner`` from
    the page's first range), as the MHA pools' are; ``None`` otherwise."""
    import numpy as np

    size = int(row_sizes[0])
    if (row_sizes != size).any():
        return None
    rel = addrs - addrs[:, :1]
    if (rel != rel[0]).any():
        return None
    r = rel[0]
    per = len(r)
    if per == 1:
        return (size,), (1,), size
    steps = np.diff(r)
    s_inner = int(steps[0])
    bad = np.flatnonzero(steps != s_inner)
    inner = int(bad[0]) + 1 if bad.size else per
    if per % inner:
        return None
    outer = per // inner
    s_outer = int(r[inner]) if outer > 1 else size
    want = np.arange(outer, dtype=np.int64)[:, None] * s_outer + np.arange(inner, dtype=np.int64)[None, :] * s_inner
    if s_inner <= 0 or s_outer <= 0 or (r.reshape(outer, inner) != want).any():
        return None
    return (outer, inner, size), (s_outer, s_inner, 1), (outer - 1) * s_outer + (inner - 1) * s_inner + size


def page_views(host, indices, n_pages):
    """Per page, the fewest torch views of the host pool whose bytes in
    row-major order are the page's ``get_page_buffer_meta`` ranges: one strided
    view per page for the MHA pools (what a plain torch copy of the page takes),
    else one per range."""
    import numpy as np
    import torch

    buf = host.kv_buffer
    flat = buf.reshape(-1).view(torch.uint8)
    base = buf.data_ptr()
    ptrs, sizes = host.get_page_buffer_meta(indices)
    addrs = np.asarray(ptrs, dtype=np.int64).reshape(n_pages, -1)
    lens = np.asarray(sizes, dtype=np.int64).reshape(n_pages, -1)
    g = grid(addrs, lens[0])
    if g is not None:
        shape, strides, _ = g
        return [[flat.as_strided(shape, strides, int(a) - base)] for a in addrs[:, 0].tolist()]
    return [[flat[a - base : a - base + n] for a, n in zip(row, lens[0].tolist())] for row in addrs.tolist()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    ap.add_argument("--tokens", type=int, default=2048, help="prompt length in tokens (default 2048)")
    ap.add_argument("--reps", type=int, default=5, help="prompts per layout (default 5; medians)")
    ap.add_argument("--layouts", default="page_first,layer_first", help="host-pool layouts (default both)")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--daemon-size", default="2GiB", help="the daemon's megaslab (default 2GiB)")
    ap.add_argument("--file-dir", default=None, help="directory of SGLang's file backend (default: a temporary one)")
    ap.add_argument("--evict-mib", type=int, default=256,
                    help="MiB written before each timed operation so that every one starts with the prompt's "
                         "bytes out of the CPU caches (default 256; 0: no eviction)")
    ap.add_argument("--evict-with", choices=("numpy", "torch"), default="numpy",
                    help="what writes them: one thread (numpy, the default) or torch's parallel fill, which leaves "
                         "torch's OpenMP workers spinning on the cores when the timed operation starts")
    a = ap.parse_args()

    import numpy as np
    import torch

    import kachedb.sglang
    import kachedb.sglang.storage
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.storage import StorageBackendFactory
    from sglang.srt.mem_cache.utils import get_hash_str

    ps = a.page_size
    tokens = a.tokens // ps * ps
    n_pages = tokens // ps
    layouts = [x for x in a.layouts.split(",") if x]
    tmp = tempfile.mkdtemp(prefix="kachedb-sglang-bench-")
    file_dir = a.file_dir or os.path.join(tmp, "hicache-files")
    sock = os.path.join(tmp, "kachedb.sock")
    daemon = Daemon(sock, a.daemon_size, binary=built_binary()).start()
    rng = random.Random(0)
    results = {}
    try:
        kv = MHATokenToKVPool(size=tokens, page_size=ps, dtype=torch.bfloat16, head_num=a.kv_heads, head_dim=a.head_dim,
                              layer_num=a.layers, device="cpu", enable_memory_saver=False, start_layer=0,
                              end_layer=a.layers)

        def config(layout, extra):
            return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                        is_mla_model=False, enable_storage_metrics=False,
                                        is_page_first_layout=layout == "page_first", model_name="bench/llama-like",
                                        extra_config=json.loads(json.dumps(extra)))

        for layout in layouts:
            # room for the source slots and the destination slots
            host = MHATokenToKVPoolHost(kv.get_device_pool_infos()[0].buffer_info, host_to_device_ratio=2.0, host_size=0,
                                        page_size=ps, layout=layout, pin_memory=False, device="cpu",
                                        device_capacity_tokens=kv.size, start_layer=0, end_layer=a.layers)
            src = host.alloc(tokens)
            dst = host.alloc(tokens)
            page_bytes = host.get_data_page(int(src[0]), flat=True).numel() * host.dtype.itemsize
            # No SGLang server in this process: its pages are this benchmark's alone.
            kdb = StorageBackendFactory.create_backend(
                "dynamic", config(layout, kachedb.sglang.hicache_config(sock, no_server_args=True)), host
            )
            kdb.register_mem_pool_host(host)
            fb = StorageBackendFactory.create_backend("file", config(layout, {"file_storage_path": file_dir}), host)
            fb.register_mem_pool_host(host)

            def fill():
                for s in range(0, tokens, ps):
                    page = host.get_data_page(int(src[s]), flat=True)
                    host.set_from_flat_data_page(int(src[s]), torch.randn(page.numel()).to(page.dtype))

            def clear_dst():
                for s in range(0, tokens, ps):
                    page = host.get_data_page(int(dst[s]), flat=True)
                    host.set_from_flat_data_page(int(dst[s]), torch.zeros(page.numel(), dtype=page.dtype))

            def equal():
                return all(
                    torch.equal(host.get_data_page(int(src[s]), flat=True), host.get_data_page(int(dst[s]), flat=True))
                    for s in range(0, tokens, ps)
                )

            def file_store(keys):
                data = [host.get_data_page(int(src[i * ps])) for i in range(len(keys))]
                return fb.batch_set(keys, data)

            def file_retrieve(keys):
                hit = fb.batch_exists(keys)
                dummies = [host.get_dummy_flat_data_page() for _ in keys[:hit]]
                pages = fb.batch_get(keys[:hit], dummies)
                for i, p in enumerate(pages):
                    if p is None:
                        return i
                    host.set_from_flat_data_page(int(dst[i * ps]), p)
                return hit

            def kdb_retrieve(keys):
                hit = kdb.batch_exists(keys)
                return sum(kdb.batch_get_v1(keys[:hit], dst[: hit * ps]))

            # the copy baseline: per rep, blocks freshly reserved in the
            # daemon's memory (never written before, as the blocks KacheDB stores
            # into), written by the store copy and read by the retrieve copy;
            # aborted when the layout is done
            baseline_client = kachedb.connect(sock)
            base_held = []
            # the page views the torch copy takes (one strided view per page)
            src_pages = page_views(host, src, n_pages)
            dst_pages = page_views(host, dst, n_pages)

            def pairs(block_views, pages, to_block):
                blocks, pool = [], []
                for block, views in zip(block_views, pages):
                    off = 0
                    for v in views:
                        n = v.numel()
                        blocks.append(block[off:off + n].view(v.shape))
                        pool.append(v)
                        off += n
                return (blocks, pool) if to_block else (pool, blocks)

            def copy_all(pairs_):
                torch._foreach_copy_(*pairs_)

            def copy_pairs(rep):
                """(store pairs, retrieve pairs) between the pool's page views and
                blocks freshly reserved for this prompt, as KacheDB's path lays them."""
                r = baseline_client.reserve_many([f"bench-copy-{layout}-{rep}-{i}" for i in range(n_pages)],
                                                 (page_bytes,), torch.uint8)
                base_held.append(r)
                return pairs(r.out, src_pages, True), pairs(r.out, dst_pages, False)

            scratch = (torch.empty(a.evict_mib << 20, dtype=torch.uint8) if a.evict_with == "torch"
                       else np.empty(a.evict_mib << 20, dtype=np.uint8))

            def evict():
                """Every timed operation starts from the same state: the pool's
                and the blocks' bytes out of the caches (as after a GPU wrote the
                pages), not whatever the previous operation left there."""
                if a.evict_mib and a.evict_with == "torch":
                    scratch.fill_(1)
                elif a.evict_mib:
                    scratch.fill(1)

            def timed(f, *args):
                evict()
                t = time.perf_counter()
                r = f(*args)
                return time.perf_counter() - t, r

            def memcpy():
                for s in range(0, tokens, ps):
                    host.set_from_flat_data_page(int(dst[s]), host.get_data_page(int(src[s]), flat=True))
                return n_pages

            rows = {"kachedb": {"store": [], "retrieve": []}, "copy": {"store": [], "retrieve": []},
                    "file": {"store": [], "retrieve": []}, "memcpy": {"retrieve": []}}
            for rep in range(a.reps + 1):  # rep 0 warms up (page-hash extension, allocations)
                fill()
                prompt = [rng.randrange(1, 150_000) for _ in range(tokens)]
                keys = list(get_hash_str(prompt, None, page_size=ps))
                assert len(keys) == n_pages
                timings = {}
                store_pairs, retrieve_pairs = copy_pairs(rep)
                # KacheDB and its baseline back to back, each first in every other rep
                both = [
                    ("kachedb", lambda k: all(kdb.batch_set_v1(k, src)), kdb_retrieve),
                    ("copy", lambda k: copy_all(store_pairs) or True, lambda k: copy_all(retrieve_pairs) or n_pages),
                ]
                if rep % 2:
                    both.reverse()
                for name, store, _ in both:
                    timings[(name, "store")], ok = timed(store, keys)
                    if not ok:
                        sys.exit(f"{name}: store failed")
                for name, _, retrieve in both:
                    clear_dst()
                    timings[(name, "retrieve")], got = timed(retrieve, keys)
                    if got != n_pages or not equal():
                        sys.exit(f"{name}: retrieved {got}/{n_pages} pages, equal={equal()}")
                clear_dst()
                timings[("file", "store")], ok = timed(file_store, keys)
                if not ok:
                    sys.exit("file: store failed")
                timings[("file", "retrieve")], got = timed(file_retrieve, keys)
                if got != n_pages or not equal():
                    sys.exit(f"file: retrieved {got}/{n_pages} pages, equal={equal()}")
                clear_dst()
                timings[("memcpy", "retrieve")], _ = timed(memcpy)
                # the file backend's dirty pages written back now, not during the next rep's figures
                os.sync()
                if rep == 0:
                    continue
                for (name, op), s in timings.items():
                    rows[name][op].append(s)
            res = {"pages": n_pages, "page_bytes": page_bytes, "prompt_bytes": page_bytes * n_pages}
            for name, ops in rows.items():
                for op, xs in ops.items():
                    med = statistics.median(xs)
                    res[f"{name}_{op}_ms"] = round(med * 1e3, 3)
                    res[f"{name}_{op}_us_per_page"] = round(med * 1e6 / n_pages, 2)
                    res[f"{name}_{op}_samples_ms"] = [round(x * 1e3, 3) for x in xs]
            res["store_file_over_kachedb"] = round(res["file_store_ms"] / res["kachedb_store_ms"], 2)
            res["retrieve_file_over_kachedb"] = round(res["file_retrieve_ms"] / res["kachedb_retrieve_ms"], 2)
            res["retrieve_kachedb_over_memcpy"] = round(res["kachedb_retrieve_ms"] / res["memcpy_retrieve_ms"], 2)
            for op in ("store", "retrieve"):
                res[f"{op}_kachedb_pct_of_copy"] = round(100 * res[f"copy_{op}_ms"] / res[f"kachedb_{op}_ms"], 1)
            for r in base_held:
                r.out.clear()
                r.abort()
            base_held.clear()
            baseline_client.close()
            res["daemon_pins_after"] = kdb._link.client().stats()["pins"]
            results[layout] = res
            kdb.close()
    finally:
        daemon.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    out = {
        "tokens": tokens,
        "page_size": ps,
        "layers": a.layers,
        "kv_heads": a.kv_heads,
        "head_dim": a.head_dim,
        "dtype": "bfloat16",
        "reps": a.reps,
        "evict_mib": a.evict_mib,
        "evict_with": a.evict_with,
        "file_dir": a.file_dir or "(temporary directory)",
        "layouts": results,
    }
    if a.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"{tokens}-token prompt, {a.layers} layers x {a.kv_heads} KV heads x {a.head_dim}, bf16, "
          f"{ps} tokens/page; medians of {a.reps}")
    print(f"{'layout':<12} {'backend':<8} {'store ms':>9} {'µs/page':>9} {'retrieve ms':>12} {'µs/page':>9}")
    for layout, r in results.items():
        print(f"{layout:<12} (prompt {r['prompt_bytes'] / 2**20:.1f} MiB, {r['pages']} pages of {r['page_bytes'] / 2**10:.0f} KiB)")
        for name in ("copy", "kachedb", "file"):
            print(f"{'':<12} {name:<8} {r[f'{name}_store_ms']:>9.2f} {r[f'{name}_store_us_per_page']:>9.1f} "
                  f"{r[f'{name}_retrieve_ms']:>12.2f} {r[f'{name}_retrieve_us_per_page']:>9.1f}")
        print(f"{'':<12} {'memcpy':<8} {'':>9} {'':>9} {r['memcpy_retrieve_ms']:>12.2f} {r['memcpy_retrieve_us_per_page']:>9.1f}")
        print(f"{'':<12} kachedb at {r['store_kachedb_pct_of_copy']}% of the copy's speed storing, "
              f"{r['retrieve_kachedb_pct_of_copy']}% retrieving (one copy each way)")
        print(f"{'':<12} file / kachedb: store {r['store_file_over_kachedb']}x, retrieve {r['retrieve_file_over_kachedb']}x; "
              f"kachedb retrieve / memcpy {r['retrieve_kachedb_over_memcpy']}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
