"""One LMCache engine process of the KacheDB integration tests.

Run with the LMCache environment's python: ``python engine_proc.py SPEC.json``.
SPEC is a JSON object ``{"scenario": name, "socket": path or null, "out": path,
...}``; the scenario's result (a JSON object) is written to ``out``. Every
scenario destroys its engine before returning (LMCache's storage thread keeps a
process alive until then), so the process must then exit by itself.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # lmcache_support, engine_support

import lmcache_support as S  # noqa: E402


def _bytes(t: Any) -> bytes:
    import torch

    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _remote_lookup(engine: Any, tokens: List[int]) -> int:
    return int(engine.lookup(tokens, search_range=[S.REMOTE_BACKEND]))


def _local_lookup(engine: Any, tokens: List[int]) -> int:
    return int(engine.lookup(tokens, search_range=["LocalCPUBackend"]))


def _wait_landed(daemon: Any, keys: List[bytes], timeout_s: float) -> Dict[str, Any]:
    """Polls the daemon until every key is present or ``timeout_s`` passes."""
    start = time.monotonic()
    present = daemon.lookup(keys)
    while present < len(keys) and time.monotonic() - start < timeout_s:
        time.sleep(0.01)
        present = daemon.lookup(keys)
    return {"present": present, "expected": len(keys), "waited_s": time.monotonic() - start}


def _settled_ref_counts(engine: Any, timeout_s: float) -> List[int]:
    """The reference counts of the chunks in the engine's local CPU tier, once
    they are all 1 or ``timeout_s`` has passed (the puts' references go when
    LMCache's put tasks finish)."""
    local = engine.storage_manager.storage_backends["LocalCPUBackend"]
    start = time.monotonic()
    while True:
        with local.cpu_lock:
            counts = [obj.get_ref_count() for obj in local.hot_cache.values()]
        if all(c == 1 for c in counts) or time.monotonic() - start > timeout_s:
            return counts
        time.sleep(0.01)


def scenario_store(spec: Dict[str, Any]) -> Dict[str, Any]:
    """Engine 1: stores each prompt's KV; reports when the asynchronous puts
    have landed in the daemon (through an observer client of its own)."""
    import kachedb
    import kachedb.lmcache

    engine = S.build_engine("store", socket=spec["socket"], model=spec.get("model", "kachedb-test/tiny-llama"))
    conn = S.kachedb_connector(engine)
    out: Dict[str, Any] = {"backends": list(engine.storage_manager.storage_backends), "connector": repr(conn)}
    observer = kachedb.connect(spec["socket"])
    landed = []
    for n, seed in spec["prompts"]:
        tokens = S.prompt_tokens(n, seed)
        engine.store(tokens, kv=S.prompt_kv(n, seed))
        keys = [conn.daemon_key(k) for k in S.chunk_keys(engine, tokens)]
        landed.append(_wait_landed(observer, keys, spec.get("land_timeout_s", 10.0)))
    out["landed"] = landed
    # LMCache's reference counting: once the puts are done, each chunk in the
    # local CPU tier holds one reference, its own (a connector dropping the
    # reference LMCache drops for it leaves 0: a freed chunk still cached).
    out["local_ref_counts"] = _settled_ref_counts(engine, spec.get("land_timeout_s", 10.0))
    for n, seed in spec["prompts"]:
        S.clear_local(engine, S.prompt_tokens(n, seed))  # (clear skips chunks not at one reference)
    out["stats"] = kachedb.lmcache.stats()
    out["daemon"] = observer.stats()
    observer.close()
    _destroy("store")
    return out


def scenario_load(spec: Dict[str, Any]) -> Dict[str, Any]:
    """Engine 2 (fresh: its local CPU tier is empty): looks a stored prompt up
    and retrieves it through KacheDB; partial chunks; misses; the asynchronous
    lookup-and-get path of the backend."""
    import torch

    import kachedb
    import kachedb.lmcache

    n, seed = spec["prompt"]
    tokens = S.prompt_tokens(n, seed)
    expect = S.prompt_kv(n, seed)
    engine = S.build_engine("load", socket=spec["socket"], model=spec.get("model", "kachedb-test/tiny-llama"))
    conn = S.kachedb_connector(engine)
    observer = kachedb.connect(spec["socket"])
    out: Dict[str, Any] = {"backends": list(engine.storage_manager.storage_backends), "connector": repr(conn)}
    out["num_chunks"] = len(S.chunk_keys(engine, tokens))

    # The whole prompt, through KacheDB only.
    out["local_lookup_before"] = _local_lookup(engine, tokens)
    out["remote_lookup"] = _remote_lookup(engine, tokens)
    before = observer.stats()
    got = torch.zeros_like(expect)
    mask = engine.retrieve(tokens, kv=got, req_id="whole")
    after = observer.stats()
    out["retrieved_tokens"] = int(mask.sum())
    out["byte_equal"] = _bytes(got) == _bytes(expect)
    out["get_hits_delta"] = after["get_hits"] - before["get_hits"]
    out["local_lookup_after"] = _local_lookup(engine, tokens)

    # Partial chunks: a prompt ending inside a stored chunk, and one extending
    # past the stored partial last chunk, each from an emptied local tier.
    S.clear_local(engine, tokens)
    short = tokens[: spec["short"]]
    out["short_remote_lookup"] = _remote_lookup(engine, short)
    longer = tokens + S.prompt_tokens(spec["extra"], seed + 1000)
    out["long_remote_lookup"] = _remote_lookup(engine, longer)
    before = observer.stats()
    got_long = torch.zeros((2, S.NUM_LAYERS, len(longer), S.NUM_HEADS * S.HEAD_SIZE), dtype=expect.dtype)
    mask = engine.retrieve(longer, kv=got_long, req_id="long")
    after = observer.stats()
    hit = int(mask.sum())
    out["long_retrieved_tokens"] = hit
    out["long_mask_is_prefix"] = bool(mask[:hit].all()) and not bool(mask[hit:].any())
    out["long_byte_equal"] = _bytes(got_long[:, :, :hit]) == _bytes(expect[:, :, :hit])
    out["long_untouched_zero"] = bool((got_long[:, :, hit:] == 0).all())
    out["long_get_hits_delta"] = after["get_hits"] - before["get_hits"]

    # Misses: a prompt nobody stored.
    S.clear_local(engine, tokens)
    other = S.prompt_tokens(n, seed + 7)
    before = observer.stats()
    out["miss_remote_lookup"] = _remote_lookup(engine, other)
    got_miss = torch.zeros_like(expect)
    out["miss_retrieved_tokens"] = int(engine.retrieve(other, kv=got_miss, req_id="miss").sum())
    after = observer.stats()
    out["miss_not_found_delta"] = after["not_found"] - before["not_found"]
    out["miss_get_hits_delta"] = after["get_hits"] - before["get_hits"]

    # LMCache's asynchronous path (scheduler lookup, prefetch) on the backend
    # itself, on the storage manager's event loop.
    backend = engine.storage_manager.storage_backends[S.REMOTE_BACKEND]
    loop = engine.storage_manager.loop
    keys = S.chunk_keys(engine, tokens)
    out["async_contains"] = asyncio.run_coroutine_threadsafe(backend.batched_async_contains("a1", keys), loop).result(30)
    out["async_contains_miss"] = asyncio.run_coroutine_threadsafe(
        backend.batched_async_contains("a2", S.chunk_keys(engine, other)), loop
    ).result(30)
    objs = asyncio.run_coroutine_threadsafe(backend.batched_get_non_blocking("a3", keys), loop).result(30)
    starts = [s for s, _, _ in engine.token_database.process_tokens(tokens=tokens)]
    ends = [e for _, e, _ in engine.token_database.process_tokens(tokens=tokens)]
    out["async_got"] = len(objs)
    out["async_byte_equal"] = all(
        _bytes(o.tensor) == _bytes(expect[:, :, s:e]) for o, s, e in zip(objs, starts, ends)
    )
    out["async_ref_counts"] = [o.get_ref_count() for o in objs]
    for o in objs:
        o.ref_count_down()
    # A chunk in the middle goes missing: the get returns the prefix before it.
    observer.delete(conn.daemon_key(keys[3]))
    objs = asyncio.run_coroutine_threadsafe(backend.batched_get_non_blocking("a4", keys), loop).result(30)
    out["async_got_after_delete"] = len(objs)
    for o in objs:
        o.ref_count_down()
    out["remote_lookup_after_delete"] = _remote_lookup(engine, tokens)

    out["stats"] = kachedb.lmcache.stats()
    out["daemon"] = observer.stats()
    observer.close()
    _destroy("load")
    return out


def scenario_lookup(spec: Dict[str, Any]) -> Dict[str, Any]:
    """A fresh engine (possibly of another model, or another namespace) looks a
    prompt up in KacheDB only."""
    import kachedb.lmcache

    n, seed = spec["prompt"]
    tokens = S.prompt_tokens(n, seed)
    engine = S.build_engine(
        "lookup",
        socket=spec["socket"],
        model=spec.get("model", "kachedb-test/tiny-llama"),
        namespace=spec.get("namespace"),
        tenant=spec.get("tenant"),
    )
    out = {
        "backends": list(engine.storage_manager.storage_backends),
        "connector": repr(S.kachedb_connector(engine)),
        "remote_lookup": _remote_lookup(engine, tokens),
        "stats": kachedb.lmcache.stats(),
    }
    _destroy("lookup")
    return out


def scenario_no_daemon(spec: Dict[str, Any]) -> Dict[str, Any]:
    """The plugin configured on a socket nobody serves: the engine still stores
    and retrieves through its local tier, and KacheDB answers nothing."""
    import torch

    n, seed = spec["prompt"]
    tokens = S.prompt_tokens(n, seed)
    kv = S.prompt_kv(n, seed)
    engine = S.build_engine("nodaemon", socket=spec["socket"])
    out: Dict[str, Any] = {"backends": list(engine.storage_manager.storage_backends)}
    out["connector_is_none"] = S.kachedb_connector(engine) is None
    engine.store(tokens, kv=kv)
    out["remote_lookup"] = _remote_lookup(engine, tokens)
    out["local_lookup"] = _local_lookup(engine, tokens)
    got = torch.zeros_like(kv)
    out["retrieved_tokens"] = int(engine.retrieve(tokens, kv=got, req_id="r").sum())
    out["byte_equal"] = _bytes(got) == _bytes(kv)
    _destroy("nodaemon")
    return out


def scenario_daemon_restart(spec: Dict[str, Any]) -> Dict[str, Any]:
    """The daemon (started and stopped here) goes away under a running engine
    and comes back: meanwhile KacheDB answers misses and skips stores, the engine
    raises nothing; afterwards the tier is used again."""
    import torch

    import kachedb.lmcache

    (n, seed), (n2, seed2) = spec["prompt"], spec["second"]
    tokens, kv = S.prompt_tokens(n, seed), S.prompt_kv(n, seed)
    tokens2, kv2 = S.prompt_tokens(n2, seed2), S.prompt_kv(n2, seed2)
    socket = spec["socket"]
    daemon = S.Daemon(socket, size="64MiB").start()
    out: Dict[str, Any] = {}
    try:
        engine = S.build_engine("restart", socket=socket, retry_seconds=spec["retry_seconds"])
        conn = S.kachedb_connector(engine)
        out["connector"] = repr(conn)
        engine.store(tokens, kv=kv)
        keys = [conn.daemon_key(k) for k in S.chunk_keys(engine, tokens)]
        out["landed_before"] = _wait_landed(daemon.client(), keys, 10.0)
        out["stop_rc"] = daemon.stop()

        # The daemon is gone: misses, skipped stores, no exception.
        out["down_remote_lookup"] = _remote_lookup(engine, tokens)
        S.clear_local(engine, tokens)
        got = torch.zeros_like(kv)
        out["down_retrieved_tokens"] = int(engine.retrieve(tokens, kv=got, req_id="down").sum())
        engine.store(tokens2, kv=kv2)
        out["down_local_lookup"] = _local_lookup(engine, tokens2)  # the local tier still works

        # Back (empty): after retry_seconds the tier reconnects and stores again.
        daemon = S.Daemon(socket, size="64MiB").start()
        time.sleep(spec["retry_seconds"] * 2)
        S.clear_local(engine, tokens2)
        engine.store(tokens2, kv=kv2)
        keys2 = [conn.daemon_key(k) for k in S.chunk_keys(engine, tokens2)]
        out["landed_after"] = _wait_landed(daemon.client(), keys2, 10.0)
        out["up_remote_lookup"] = _remote_lookup(engine, tokens2)
        out["up_remote_lookup_old"] = _remote_lookup(engine, tokens)  # the restarted daemon is empty
        out["stats"] = kachedb.lmcache.stats()
        _destroy("restart")
    finally:
        out["final_stop_rc"] = daemon.stop()
    return out


def scenario_vllm_order(spec: Dict[str, Any]) -> Dict[str, Any]:
    """An engine started in the order vLLM's LMCache connector starts one: the
    metadata from the model config (one KV group of the first layer's head size,
    ``kv_shape`` as vLLM's LMCache service factory computes it), then
    ``post_init`` (which builds the KacheDB connector), then the KV caches' layer
    groups registered on the metadata (as the GPU connector does on its first
    transfer; this model has two), then the prompt stored ("store") or looked
    up and retrieved ("load")."""
    import torch

    import kachedb
    import kachedb.lmcache

    n, seed = spec["prompt"]
    tokens = S.prompt_tokens(n, seed)
    name = "vllm-order-" + spec["role"]
    engine = S.build_engine(name, socket=spec["socket"], gpu_connector=S.make_grouped_cpu_connector())
    conn = S.kachedb_connector(engine)
    out: Dict[str, Any] = {"connector": repr(conn), "fields_at_post_init": dict(conn.namespace_fields)}
    S.register_layer_groups(engine.metadata)
    out["metadata_shapes"] = [list(x) for x in engine.metadata.get_shapes()]
    kv = S.grouped_prompt_kv(n, seed)
    if spec["role"] == "store":
        engine.store(tokens, kv=kv)
        keys = [conn.daemon_key(k) for k in S.chunk_keys(engine, tokens)]
        with kachedb.connect(spec["socket"]) as observer:
            out["landed"] = _wait_landed(observer, keys, 10.0)
        S.clear_local(engine, tokens)
    else:
        out["remote_lookup"] = _remote_lookup(engine, tokens)
        got = [torch.zeros_like(t) for t in kv]
        out["retrieved_tokens"] = int(engine.retrieve(tokens, kv=got, req_id="r").sum())
        out["byte_equal"] = all(_bytes(a) == _bytes(b) for a, b in zip(got, kv))
    out["fields"] = dict(conn.namespace_fields)
    out["stats"] = kachedb.lmcache.stats()
    _destroy(name)
    return out


def _local_chunks_in_region(engine: Any, client: Any) -> Dict[str, int]:
    """How many chunks LMCache's local CPU tier holds, and how many of them are
    memory of the daemon's shared region (views) rather than LMCache's own."""
    base, size = client._native.region_span()
    local = engine.storage_manager.storage_backends["LocalCPUBackend"]
    with local.cpu_lock:
        ptrs = [obj.data_ptr for obj in local.hot_cache.values()]
    return {"chunks": len(ptrs), "in_region": sum(base <= p < base + size for p in ptrs)}


def _pins_settled(daemon: Any, want: int, timeout_s: float = 10.0) -> int:
    """The daemon's pin count once it equals ``want`` or ``timeout_s`` has passed
    (a client releases pins fire-and-forget: the daemon sees them shortly after)."""
    start = time.monotonic()
    pins = daemon.stats()["pins"]
    while pins != want and time.monotonic() - start < timeout_s:
        time.sleep(0.01)
        pins = daemon.stats()["pins"]
    return pins


def scenario_views(spec: Dict[str, Any]) -> Dict[str, Any]:
    """One engine stores prompts, empties its local CPU tier, and retrieves them
    from KacheDB: are the retrieved chunks views of shared memory (no copy),
    pinned while LMCache holds them and only then, within ``max_pinned_bytes``?"""
    import torch

    import kachedb
    import kachedb.lmcache

    engine = S.build_engine("views", socket=spec["socket"], max_pinned_bytes=spec.get("max_pinned_bytes"))
    conn = S.kachedb_connector(engine)
    observer = kachedb.connect(spec["socket"])
    out: Dict[str, Any] = {
        "backends": list(engine.storage_manager.storage_backends),
        "connector": repr(conn),
        "retrieves": [],
    }
    for n, seed in spec["prompts"]:
        tokens = S.prompt_tokens(n, seed)
        engine.store(tokens, kv=S.prompt_kv(n, seed))
        keys = [conn.daemon_key(k) for k in S.chunk_keys(engine, tokens)]
        _wait_landed(observer, keys, 10.0)
        S.clear_local(engine, tokens)
    out["pins_before"] = _pins_settled(observer, 0)
    for n, seed in spec["prompts"]:
        tokens = S.prompt_tokens(n, seed)
        expect = S.prompt_kv(n, seed)
        got = torch.zeros_like(expect)
        mask = engine.retrieve(tokens, kv=got, req_id=f"views-{seed}")
        r = {
            "retrieved_tokens": int(mask.sum()),
            "byte_equal": _bytes(got) == _bytes(expect),
            # LMCache writes the chunks got from KacheDB back into its local tier
            "local": _local_chunks_in_region(engine, conn._client()),
        }
        r["pins_held"] = _pins_settled(observer, r["local"]["in_region"])
        # an L1 hit on a view chunk reads the right bytes too
        again = torch.zeros_like(expect)
        r["local_lookup"] = _local_lookup(engine, tokens)
        r["local_hit_byte_equal"] = int(engine.retrieve(tokens, kv=again, req_id="again").sum()) == n and _bytes(
            again
        ) == _bytes(expect)
        out["retrieves"].append(r)
    out["stats"] = kachedb.lmcache.stats()
    for n, seed in spec["prompts"]:
        S.clear_local(engine, S.prompt_tokens(n, seed))
    out["local_after_clear"] = _local_chunks_in_region(engine, conn._client())
    out["pins_after_clear"] = _pins_settled(observer, 0)
    observer.close()
    _destroy("views")
    return out


def _daemon_held(daemon: Any, pins: int, reserved: int, timeout_s: float = 10.0) -> Dict[str, int]:
    """The daemon's pin and open-reservation counts once they are ``pins`` and
    ``reserved`` or ``timeout_s`` has passed (releases are fire-and-forget)."""
    start = time.monotonic()
    st = daemon.stats()
    while (st["pins"], st["reserved"]) != (pins, reserved) and time.monotonic() - start < timeout_s:
        time.sleep(0.01)
        st = daemon.stats()
    return {"pins": st["pins"], "reserved": st["reserved"]}


def _chunk_bytes_in_daemon(daemon: Any, keys: List[bytes]) -> List[bytes]:
    out = []
    for k in keys:
        v = daemon.get(k)
        out.append(v.numpy().tobytes())
        del v
    return out


def scenario_store_in_place(spec: Dict[str, Any]) -> Dict[str, Any]:
    """One engine stores prompts: are the chunks LMCache allocates reservations
    in the daemon's region, committed in place under their keys when LMCache
    puts them (no copy), pinned while its local tier holds them and only then,
    within ``max_pinned_bytes``? Their bytes in the daemon are the engine's KV
    (the same bytes as a copy-path engine's chunks), retrieved byte-equal by
    the engine once its local tier is emptied; a chunk LMCache allocates and
    drops unstored gives its reservation back; nothing stays pinned or
    reserved once LMCache lets go."""
    import torch

    import kachedb
    import kachedb.lmcache

    engine = S.build_engine("in-place", socket=spec["socket"], max_pinned_bytes=spec.get("max_pinned_bytes"))
    conn = S.kachedb_connector(engine)
    observer = kachedb.connect(spec["socket"])
    out: Dict[str, Any] = {
        "backends": list(engine.storage_manager.storage_backends),
        "connector": repr(conn),
        "allocator": type(engine.storage_manager.storage_backends["LocalCPUBackend"].memory_allocator).__name__,
        "held_before": _daemon_held(observer, 0, 0),
        "stores": [],
    }
    # A copy-path engine (local tier only): the bytes LMCache lays out for each chunk.
    plain = S.build_engine("in-place-plain", socket=None)
    all_keys: List[bytes] = []
    for n, seed in spec["prompts"]:
        tokens = S.prompt_tokens(n, seed)
        kv = S.prompt_kv(n, seed)
        engine.store(tokens, kv=kv)
        # The next store's full chunks, reserved ahead right after the commit,
        # on the thread of the store: ready when it returns.
        pooled_at_return = conn.region.pooled
        keys = [conn.daemon_key(k) for k in S.chunk_keys(engine, tokens)]
        all_keys += keys
        r: Dict[str, Any] = {"landed": _wait_landed(observer, keys, 10.0)}
        _settled_ref_counts(engine, 10.0)
        r["local"] = _local_chunks_in_region(engine, conn._client())
        r["pooled"] = pooled_at_return
        r["held"] = _daemon_held(observer, r["local"]["in_region"], r["pooled"])
        plain.store(tokens, kv=kv)
        lcb = plain.storage_manager.storage_backends["LocalCPUBackend"]
        with lcb.cpu_lock:
            want = [_bytes(lcb.hot_cache[k].tensor) for k in S.chunk_keys(plain, tokens)]
        r["daemon_bytes_equal"] = _chunk_bytes_in_daemon(observer, keys) == want
        out["stores"].append(r)
    out["stats_after_store"] = kachedb.lmcache.stats()
    out["region_chunks_held"] = _local_chunks_in_region(engine, conn._client())["in_region"]
    # Emptied local tier: the pins go; the chunks stay in the daemon and come back byte-equal.
    for n, seed in spec["prompts"]:
        S.clear_local(engine, S.prompt_tokens(n, seed))
    out["pooled_after_clear"] = conn.region.pooled
    out["held_after_clear"] = _daemon_held(observer, 0, out["pooled_after_clear"])
    out["present_after_clear"] = observer.lookup(all_keys) if all_keys else 0
    out["retrieves"] = []
    for n, seed in spec["prompts"]:
        tokens = S.prompt_tokens(n, seed)
        expect = S.prompt_kv(n, seed)
        got = torch.zeros_like(expect)
        mask = engine.retrieve(tokens, kv=got, req_id=f"in-place-{seed}")
        out["retrieves"].append({"retrieved_tokens": int(mask.sum()), "byte_equal": _bytes(got) == _bytes(expect)})
        S.clear_local(engine, tokens)
    # The reservations kept ready go back; then a chunk LMCache allocates and
    # lets go without storing it.
    conn.region.drain()
    shapes, dtypes = engine.metadata.get_shapes(S.CHUNK_TOKENS), engine.metadata.get_dtypes()
    held0 = _daemon_held(observer, 0, 0)
    obj = engine.storage_manager.allocate(shapes, dtypes, busy_loop=False)
    out["dropped"] = {
        "held_before": held0,
        "in_region": _in_region(obj, conn._client()),
        "held_while_allocated": _daemon_held(observer, 0, 1),
    }
    obj.ref_count_down()
    del obj
    out["dropped"]["held_after_free"] = _daemon_held(observer, 0, 0)
    out["stats"] = kachedb.lmcache.stats()
    _destroy("in-place-plain")
    _destroy("in-place")
    out["held_after_destroy"] = _daemon_held(observer, 0, 0)
    observer.close()
    return out


def scenario_direct(spec: Dict[str, Any]) -> Dict[str, Any]:
    """On which thread do the KacheDB connector's gets and stores run? One
    engine stores a prompt and retrieves it with its local tier emptied; the
    connector's calls record their thread. Stores of chunks in the region and
    every get run on the thread that called LMCache (its event loop is not
    involved), and a stored prompt is in the daemon when ``engine.store``
    returns; with ``max_pinned_bytes`` 0 (chunks in LMCache's memory: copies)
    the stores run on LMCache's event loop, as LMCache runs remote puts."""
    import threading

    import torch

    import kachedb
    from kachedb.lmcache import records

    engine = S.build_engine("direct", socket=spec["socket"], max_pinned_bytes=spec.get("max_pinned_bytes"))
    conn = S.kachedb_connector(engine)
    observer = kachedb.connect(spec["socket"])
    calls: List[Any] = []
    for name in ("_store", "_load_prefix"):
        inner = getattr(conn, name)

        def record(*a: Any, _inner: Any = inner, _name: str = name, **k: Any) -> Any:
            calls.append((_name, threading.get_ident()))
            return _inner(*a, **k)

        setattr(conn, name, record)
    me = threading.get_ident()
    n, seed = spec["prompt"]
    tokens, kv = S.prompt_tokens(n, seed), S.prompt_kv(n, seed)
    if spec.get("by_hashes"):
        # Keyed by hashes LMCache is handed (its multi-process adapter passes
        # vLLM's block hashes and the chunks' lengths, no tokens).
        hashes = [(seed * 1_000_003 + 7919 * i) & ((1 << 63) - 1) for i in range(-(-n // S.CHUNK_TOKENS))]
        offsets = [min(S.CHUNK_TOKENS, n - i * S.CHUNK_TOKENS) for i in range(len(hashes))]
        keys = [conn.daemon_key(k) for _, _, k in engine.token_database.process_tokens(hashes=hashes, offsets=offsets)]
        engine.store(hashes=hashes, offsets=offsets, kv=kv, slot_mapping=list(range(n)))
        out = {"chunks": len(keys), "landed": _wait_landed(observer, keys, 10.0)}
        out["stats"] = kachedb.lmcache.stats()
        out["daemon"] = observer.stats()
        _destroy("direct")
        observer.close()
        return out
    keys = [conn.daemon_key(k) for k in S.chunk_keys(engine, tokens)]
    engine.store(tokens, kv=kv)
    out: Dict[str, Any] = {"present_when_store_returned": observer.lookup(keys), "chunks": len(keys)}
    out["backends"] = list(engine.storage_manager.storage_backends)
    out["connector"] = repr(conn)
    out["landed"] = _wait_landed(observer, keys, 10.0)
    S.clear_local(engine, tokens)
    got = torch.zeros_like(kv)
    mask = engine.retrieve(tokens, kv=got, req_id="direct")
    out["retrieved_tokens"] = int(mask.sum())
    out["byte_equal"] = _bytes(got) == _bytes(kv)
    out["calls"] = [[name, "caller" if tid == me else "other"] for name, tid in calls]
    extend = int(spec.get("extend", 0))
    if extend:
        # A longer prompt's store with its saved prefix masked (as vLLM's
        # adapter stores it): a batch that starts mid-prompt.
        tokens = S.prompt_tokens(n + extend, seed)
        mask = torch.ones(n + extend, dtype=torch.bool)
        mask[:n] = False
        engine.store(tokens, kv=S.prompt_kv(n + extend, seed), mask=mask)
        keys = [conn.daemon_key(k) for k in S.chunk_keys(engine, tokens)]
        out["landed_extended"] = _wait_landed(observer, keys, 10.0)
    out["stats"] = kachedb.lmcache.stats()
    # the chunks' hashes as the KV events carry them, for a test that subscribes
    out["event_hashes"] = [records.event_hash(k.chunk_hash) for k in S.chunk_keys(engine, tokens)]
    out["daemon"] = observer.stats()
    S.clear_local(engine, tokens)
    _destroy("direct")
    observer.close()
    return out


def _in_region(obj: Any, client: Any) -> bool:
    base, size = client._native.region_span()
    return base <= obj.data_ptr < base + size


def _destroy(instance_id: str) -> None:
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    LMCacheEngineBuilder.destroy(instance_id)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    result = globals()["scenario_" + spec["scenario"]](spec)
    tmp = spec["out"] + ".tmp"
    Path(tmp).write_text(json.dumps(result))
    Path(tmp).rename(spec["out"])


if __name__ == "__main__":
    main()
