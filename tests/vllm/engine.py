"""One vLLM engine process for the KacheDB integration tests and benchmark.

Run with the vLLM virtual environment's python: ``python engine.py SPEC.json``.
SPEC is a JSON object::

    {"model": dir, "socket": path or null (null: no KacheDB), "mode": "inproc" | "mp",
     "max_model_len": 2048, "block_size": 32, "load_format": "auto" | "dummy",
     "dtype": "float32", "max_num_batched_tokens": max_model_len,
     "mamba_ssm_cache_dtype": null (vLLM's "auto") or "float16" | "bfloat16" | "float32",
     "daemon_stats": false (true: the daemon's stats at the end of each phase),
     "prefix_caching": true, "tensor_parallel_size": 1, "options": {...kv_transfer_config options},
     "kv_events_endpoint": null or a ZMQ endpoint (KV events published there, vLLM's --kv-events-config),
     "phases": [ {"prompts": [[ids...], ...], "max_tokens": 8, "logprobs": false,
                  "before": [actions], "after": [actions]}, ... ],
     "out": path}

Actions (run in this process, between generate calls): ``{"reset_prefix_cache": true}``,
``{"corrupt_loaded": true}`` (give every block this process loaded the bytes of
another, through the KacheDB API), ``{"delete_on_load": k}`` (from now on, the k-th key of each
load is deleted from the daemon between vLLM's lookup and the load),
``{"start_daemon": {"bin": path, "size": "256MiB"}}``, ``{"kill_daemon": true}``,
``{"wait_file": path, "timeout": s}``, ``{"touch_file": path}``, ``{"sleep": s}``,
``{"fill_daemon": {"bytes": n, "block_bytes": m}}`` (another client puts n bytes of other
blocks: the daemon evicts its least recently used),
``{"zero_groups": ["SlidingWindowSpec", ...]}`` (negative control of hybrid models: every
block this process loaded whose KV-cache group's vLLM spec type is listed gets zero
bytes of the same shape, through the KacheDB API; the group index is the last 4 bytes,
big-endian, of the offload key; ``zeroed``: blocks per spec type),
``{"delete_stored": true}`` (deletes from the daemon every block this process stored: a
later request of the same prompt hits only what other engines stored; ``deleted_stored``:
how many, per action),
``{"plant_unloadable": {"group": "MambaSpec"}}`` (a block that can never load: the first
key this process loaded of a group of that spec type gets a uint8 block of half the
block's shape; ``planted``: the key, the shape it had and the one planted).

Writes to ``out`` a JSON object: per phase, per prompt ``tokens`` and
``num_cached_tokens``, ``ttft_s`` / ``wall_s`` (and ``logprobs``, each sampled token's,
with ``"logprobs": true``); ``stats`` = ``kachedb.vllm.stats()``
(in-process engines only, without ``stored_keys``) and, with ``"daemon_stats": true``
in SPEC, ``daemon`` = the daemon's ``stats()`` at the end of the phase (before its
``after`` actions); ``startup_s``,
``block_size`` (the engine's; in-process, after vLLM aligned it: a hybrid model's state
page may raise it) and
``stored_keys`` (the keys this process stored, hex).
"""

import json
import os
import signal
import subprocess
import sys
import time


def _start_daemon(bin_path, socket, size):
    if os.path.exists(socket):
        os.unlink(socket)
    log = open(socket + ".log", "ab")
    p = subprocess.Popen([bin_path, "serve", "--socket", socket, "--size", size], stdout=log, stderr=log,
                         stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not os.path.exists(socket):
        time.sleep(0.05)
    time.sleep(0.1)
    return p


def main():
    spec = json.load(open(sys.argv[1]))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    if spec.get("mode", "inproc") == "inproc":
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    else:
        os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kw = {}
    if spec.get("kv_events_endpoint"):
        from vllm.config import KVEventsConfig

        kw["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=spec["kv_events_endpoint"]
        )
    if spec.get("mamba_ssm_cache_dtype"):
        kw["mamba_ssm_cache_dtype"] = spec["mamba_ssm_cache_dtype"]
    if spec.get("prefix_cache_retention_interval") is not None:
        kw["prefix_cache_retention_interval"] = spec["prefix_cache_retention_interval"]
    if spec.get("socket"):
        import kachedb.vllm

        kw["kv_transfer_config"] = KVTransferConfig(**kachedb.vllm.kv_transfer_config(spec["socket"], **spec.get("options", {})))
    llm = LLM(
        model=spec["model"],
        load_format=spec.get("load_format", "auto"),
        seed=0,
        skip_tokenizer_init=True,
        dtype=spec.get("dtype", "float32"),
        max_model_len=spec.get("max_model_len", 2048),
        enforce_eager=True,
        tensor_parallel_size=spec.get("tensor_parallel_size", 1),
        # TP runs one worker process per rank (vLLM's CPU build: "mp")
        distributed_executor_backend="mp" if spec.get("tensor_parallel_size", 1) > 1 else "uni",
        block_size=spec.get("block_size", 32),
        enable_prefix_caching=spec.get("prefix_caching", True),
        max_num_batched_tokens=spec.get("max_num_batched_tokens", spec.get("max_model_len", 2048)),
        **kw,
    )
    startup = time.perf_counter() - t0
    vc = getattr(llm.llm_engine, "vllm_config", None)
    result = {"startup_s": startup, "phases": [],
              "block_size": vc.cache_config.block_size if vc is not None else None}
    daemon = None
    deleting = {"k": None}

    if spec.get("socket") and spec.get("mode", "inproc") == "inproc":
        # Test hook for "a block deleted between lookup and load": wraps the manager.
        from kachedb.vllm import manager as _m

        orig_prepare_load = _m.KacheDBOffloadingManager.prepare_load

        def prepare_load(self, keys, req_context):
            k = deleting["k"]
            keys = list(keys)
            if k is not None and len(keys) > k:
                import kachedb

                with kachedb.connect(spec["socket"]) as kc:
                    gone = kc.delete(self.spec.daemon_key(keys[k]))
                result.setdefault("deleted", []).append(bool(gone))
            return orig_prepare_load(self, keys, req_context)

        _m.KacheDBOffloadingManager.prepare_load = prepare_load

    def kachedb_client():
        import kachedb

        return kachedb.connect(spec["socket"])

    def torch_zeros_like(t):
        import torch

        return torch.zeros(tuple(t.shape), dtype=t.dtype)

    def loaded_by_kind():
        """(daemon key, vLLM spec type of its KV-cache group) of each block this
        process loaded, in load order, once each."""
        import kachedb.vllm

        st = kachedb.vllm.stats()
        kinds = {g["group_id"]: (g["spec"] or {}).get("type") for g in st["namespaces"]["rank0"]["groups"]}
        for h in dict.fromkeys(st["loaded_keys"]):
            key = bytes.fromhex(h)
            yield key, kinds[int.from_bytes(key[-4:], "big")]

    def act(a):
        nonlocal daemon
        if a.get("reset_prefix_cache"):
            llm.reset_prefix_cache()
        if a.get("corrupt_loaded"):
            # Negative control: give every block this process loaded the bytes of
            # another one (finite values, wrong tokens), through the KacheDB API.
            import kachedb
            import kachedb.vllm

            keys = [bytes.fromhex(h) for h in dict.fromkeys(kachedb.vllm.stats()["loaded_keys"])]
            with kachedb.connect(spec["socket"]) as kc:
                blocks = []
                for key in keys:
                    with kc.get(key) as t:
                        blocks.append(t.clone())
                for i, key in enumerate(keys):
                    kc.put(key, blocks[(i + 1) % len(blocks)])
            result["corrupted"] = len(keys)
        if a.get("zero_groups"):
            # Negative control of hybrid models: the loaded blocks of the named
            # KV-cache group kinds become zeros (same shape), through the KacheDB API.
            zeroed = {kind: 0 for kind in a["zero_groups"]}
            with kachedb_client() as kc:
                for key, kind in loaded_by_kind():
                    if kind in zeroed:
                        with kc.get(key) as t:
                            blank = torch_zeros_like(t)
                        kc.put(key, blank)
                        zeroed[kind] += 1
            result["zeroed"] = zeroed
        if a.get("plant_unloadable"):
            # A block that can never load under this engine's key: the right
            # key, half the shape (as a block of a smaller state dtype would be).
            kind = a["plant_unloadable"]["group"]
            key = next(k for k, g in loaded_by_kind() if g == kind)
            with kachedb_client() as kc:
                with kc.get(key) as t:
                    shape = tuple(t.shape)
                    bad = torch_zeros_like(t)[:, : shape[1] // 2].contiguous()
                kc.put(key, bad)
            result["planted"] = {"key": key.hex(), "group": kind, "shape": list(shape), "planted_shape": list(bad.shape)}
        if a.get("delete_stored"):
            import kachedb.vllm

            with kachedb_client() as kc:
                gone = [kc.delete(bytes.fromhex(h)) for h in dict.fromkeys(kachedb.vllm.stats()["stored_keys"])]
            result.setdefault("deleted_stored", []).append(sum(map(bool, gone)))
        if "delete_on_load" in a:
            deleting["k"] = a["delete_on_load"]
        if a.get("start_daemon"):
            d = a["start_daemon"]
            daemon = _start_daemon(d["bin"], spec["socket"], d.get("size", "256MiB"))
        if a.get("kill_daemon"):
            if daemon is not None:
                daemon.send_signal(signal.SIGKILL)
                daemon.wait()
                daemon = None
        if a.get("wait_file"):
            deadline = time.monotonic() + a.get("timeout", 300)
            while not os.path.exists(a["wait_file"]):
                if time.monotonic() > deadline:
                    raise TimeoutError(a["wait_file"])
                time.sleep(0.1)
        if a.get("touch_file"):
            open(a["touch_file"], "w").close()
        if a.get("sleep"):
            time.sleep(a["sleep"])
        if a.get("fill_daemon"):
            import numpy as np

            import kachedb

            f = a["fill_daemon"]
            m = int(f.get("block_bytes", 1 << 20))
            with kachedb.connect(spec["socket"]) as kc:
                for i in range(int(f["bytes"]) // m):
                    kc.put(b"fill/%d" % i, np.full(m, i % 251, dtype=np.uint8))
            result["filled"] = int(f["bytes"]) // m

    try:
        for ph in spec["phases"]:
            for a in ph.get("before", []):
                act(a)
            t_start = time.time()
            sp = SamplingParams(temperature=0, max_tokens=ph.get("max_tokens", 8), detokenize=False,
                                logprobs=0 if ph.get("logprobs") else None)
            prompts = [{"prompt_token_ids": p} for p in ph["prompts"]]
            outs = []
            for p in prompts:  # one at a time: TTFT per prompt
                t = time.perf_counter()
                o = llm.generate([p], sp, use_tqdm=False)[0]
                wall = time.perf_counter() - t
                m = getattr(o, "metrics", None)
                ttft = None
                try:
                    ttft = m.first_token_latency if m is not None else None
                except Exception:
                    ttft = None
                if ph.get("logprobs"):
                    outs_lp = [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                outs.append({
                    **({"logprobs": outs_lp} if ph.get("logprobs") else {}),
                    "tokens": list(o.outputs[0].token_ids),
                    "num_cached_tokens": o.num_cached_tokens,
                    "wall_s": wall,
                    "ttft_s": ttft,
                })
            rec = {"outputs": outs, "t0": t_start, "t1": time.time()}
            if spec.get("socket") and spec.get("mode", "inproc") == "inproc":
                import kachedb.vllm

                # The stores run off the engine's step: the phase's blocks are
                # in the daemon once they are committed.
                kachedb.vllm.flush_stores()
                st = kachedb.vllm.stats()
                st.pop("stored_keys", None)
                rec["stats"] = st
            if spec.get("socket") and spec.get("daemon_stats"):
                try:
                    with kachedb_client() as kc:
                        rec["daemon"] = kc.stats()
                except Exception as e:  # no daemon (yet, any more): none
                    rec["daemon"] = {"error": repr(e)}
            result["phases"].append(rec)
            for a in ph.get("after", []):
                act(a)
    finally:
        if daemon is not None:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait()
    if spec.get("socket") and spec.get("mode", "inproc") == "inproc":
        import kachedb.vllm

        result["stored_keys"] = kachedb.vllm.stats()["stored_keys"]
    with open(spec["out"], "w") as f:
        json.dump(result, f)
    # Engine shutdown (and, in mp mode, the engine-core process exit) happens here.
    del llm


if __name__ == "__main__":
    main()
