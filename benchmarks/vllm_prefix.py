#!/usr/bin/env python3
"""TTFT of a fresh vLLM engine on a long prompt: cold, with a KacheDB hit, and with
vLLM's own in-engine prefix-cache hit (the upper bound); plus the KacheDB store and
load time per block and per scheduler step.

Run with the vLLM environment (``make vllm-env``)::

    .venv-vllm/bin/python benchmarks/vllm_prefix.py [--json] [--tokens 2048] [--reps 6]

Three engine processes, each fresh, on one daemon (the real binary) and one model
(a Llama of ~94 M parameters built from a config alone, ``load_format="dummy"``):

1. ``baseline``: no KacheDB. Cold TTFT of each prompt, then the same prompt again:
   vLLM's in-engine prefix-cache hit (the upper bound).
2. ``writer``: KacheDB on, empty daemon. Cold TTFT of each prompt (it also stores
   the prompt's blocks), then the same prompt again (in-engine hit with the connector on).
   ``baseline`` and ``writer`` run at the same time and take turns, prompt by prompt
   (the other one idle; each goes first in half the turns; neither exits before
   the other's last prompt; a turn ends once the writer's stores are committed
   and the daemon's disk tier has written them), so that cold with and without
   the connector are measured in the same minutes and machine state. The connector submits a step's
   stores when the step ends, before its token is returned; they run on the
   worker's store thread (off the step): ``store_thread`` is set true, since
   these engines run in-process, where ``"auto"`` keeps stores inside the step
   (in vLLM's engine-core process ``"auto"`` chooses the thread).
3. ``reader``: KacheDB on, a fresh process. Each prompt's first request: a KacheDB hit
   (the prompt's blocks loaded from the daemon).
4. ``disk reader`` (``--disk-restart``, the default): the daemon runs with a disk tier
   (``--disk DIR``); after the writer's blocks are all on disk it is killed with
   ``kill -9`` and a new daemon is started on the same DIR, with an empty megaslab.
   A fresh engine's first request of each prompt: its blocks filled from the disk tier.

TTFT is the wall time of ``LLM.generate`` with ``max_tokens=1`` (in-process engine).
Each engine first serves one unmeasured cold prompt of the same length (its own;
the two taking turns here too).
Figures are medians over ``--reps`` prompts (and the median of the per-prompt
cold ratios, each prompt's two engines measured in one turn); ``--json`` also has each prompt's cold
TTFT with the engine process's CPU time, page faults and context switches. Goals (issue 10): KacheDB hit within
1.5x of the in-engine hit and at most 10 % of cold.
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: harness/
from harness.daemon import Daemon  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def engine_main(spec_path):
    spec = json.load(open(spec_path))
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kw = {}
    if spec["socket"]:
        import kachedb.vllm

        kw["kv_transfer_config"] = KVTransferConfig(**kachedb.vllm.kv_transfer_config(spec["socket"], **spec.get("options", {})))
    llm = LLM(model=spec["model"], load_format="dummy", seed=0, skip_tokenizer_init=True, dtype="float32",
              max_model_len=spec["max_model_len"], max_num_batched_tokens=spec["max_batched_tokens"], enforce_eager=True,
              distributed_executor_backend="uni", block_size=32, enable_prefix_caching=True, **kw)
    startup = time.perf_counter() - t0
    sp = SamplingParams(temperature=0, max_tokens=1, detokenize=False)

    import resource

    def ttft(prompt):
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t = time.perf_counter()
        o = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
        wall = time.perf_counter() - t
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        # where the process's time went (all its threads): CPU seconds, page faults, context switches
        usage = {"user_s": r1.ru_utime - r0.ru_utime, "sys_s": r1.ru_stime - r0.ru_stime,
                 "minflt": r1.ru_minflt - r0.ru_minflt, "majflt": r1.ru_majflt - r0.ru_majflt,
                 "nvcsw": r1.ru_nvcsw - r0.ru_nvcsw, "nivcsw": r1.ru_nivcsw - r0.ru_nivcsw}
        return wall, o.num_cached_tokens, list(o.outputs[0].token_ids), usage

    turns = spec.get("turn_dir")  # taking turns with another engine (see ``run_in_turns``)
    if turns:
        Path(turns, f"{spec['name']}.ready").touch()
        _wait_file(Path(turns, f"{spec['name']}.warm"))
    # warm-up (a turn of its own): a cold prompt of the measured length, unrelated
    # to the measured ones and different in each engine (first-call overheads,
    # first touch of the pages a prefill writes), not counted
    rng = random.Random(spec["name"] if "name" in spec else spec["out"])
    ttft([rng.randrange(8192) for _ in range(len(spec["prompts"][0]))])
    if spec["socket"]:
        import kachedb.vllm

        kachedb.vllm.flush_stores()
    llm.reset_prefix_cache()
    res = {"startup_s": startup, "runs": []}
    if turns:
        Path(turns, f"{spec['name']}.warmed").touch()
    for i, p in enumerate(spec["prompts"]):
        if turns:
            _wait_file(Path(turns, f"{spec['name']}.go{i}"))
        first = ttft(p)
        if spec.get("repeat"):
            # The in-engine hit is timed once the first request's work is done:
            # the connector's stores committed, and a pause like the one before
            # the KacheDB reader's hit. Timed at once, it measured that work too
            # (the store thread's copies, the prefill's clean-up) and came out
            # slower than a load from outside the engine.
            if spec["socket"]:
                import kachedb.vllm

                kachedb.vllm.flush_stores()
            time.sleep(float(spec.get("settle_s", 0.0)))
        second = ttft(p) if spec.get("repeat") else None
        res["runs"].append({"first": first, "second": second})
        if turns and spec["socket"]:
            import kachedb.vllm

            # The turn ends once its stores are committed: they never run into
            # the next turn's prompt.
            kachedb.vllm.flush_stores()
        if turns:
            Path(turns, f"{spec['name']}.done{i}").touch()
    if spec["socket"]:
        import kachedb.vllm

        kachedb.vllm.flush_stores()  # the last stores run off the step: counted once committed
        st = kachedb.vllm.stats()
        for k in ("stored_keys", "loaded_keys"):
            st.pop(k, None)
        res["stats"] = st
    json.dump(res, open(spec["out"], "w"))
    if turns:
        # Exit (engine shutdown, freeing its memory: seconds of CPU) only once the
        # other engine's last prompt is done, never during it.
        _wait_file(Path(turns, f"{spec['name']}.exit"))


def _wait_file(path, timeout_s=900.0, proc=None):
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc is not None and proc.poll() is not None:
            return False
        if time.monotonic() > deadline:
            sys.exit(f"timed out waiting for {path}")
        time.sleep(0.01)
    return True


def run_in_turns(tmp, names_specs, pause_s=0.5, quiet=None):
    """Engines started together, each prompt taken in turns: engine A's prompt i,
    then B's (B first for odd i), the other engine idle meanwhile (it exits only
    after the last turn: an engine's shutdown takes seconds of CPU). Cold TTFT
    with and without the connector are then measured in the same minutes, not
    one engine's run after the other's (the machine's load drifts between them).
    ``quiet()``, if given, runs before each turn and returns once the daemon's
    own background work of the turns before (the disk tier's writes) is done."""
    turn_dir = Path(tmp) / "turns"
    turn_dir.mkdir(exist_ok=True)
    procs = {}
    for name, spec in names_specs:
        spec = dict(spec, name=name, turn_dir=str(turn_dir), out=str(Path(tmp) / f"{name}.json"))
        path = Path(tmp) / f"{name}.spec.json"
        path.write_text(json.dumps(spec))
        log = open(Path(tmp) / f"{name}.log", "wb")
        procs[name] = (subprocess.Popen([sys.executable, __file__, "--engine", str(path)], stdout=log,
                                        stderr=subprocess.STDOUT), spec)

    def failed(name):
        p, _ = procs[name]
        p.kill()
        sys.exit(f"engine {name} failed ({p.wait()}):\n" +
                 (Path(tmp) / f"{name}.log").read_text(errors="replace")[-4000:])

    try:
        for name, (p, _) in procs.items():
            if not _wait_file(turn_dir / f"{name}.ready", proc=p):
                failed(name)
        names = [n for n, _ in names_specs]
        for name in names[::-1]:  # the warm-up turn (then the first measured turn's order)
            time.sleep(pause_s)
            (turn_dir / f"{name}.warm").touch()
            if not _wait_file(turn_dir / f"{name}.warmed", proc=procs[name][0]):
                failed(name)
        for i in range(len(names_specs[0][1]["prompts"])):
            for name in (names if i % 2 == 0 else names[::-1]):
                if quiet is not None:
                    quiet()
                time.sleep(pause_s)  # the other engine's threads gone idle
                (turn_dir / f"{name}.go{i}").touch()
                if not _wait_file(turn_dir / f"{name}.done{i}", proc=procs[name][0]):
                    failed(name)
        for name in names:
            (turn_dir / f"{name}.exit").touch()
        out = {}
        for name, (p, spec) in procs.items():
            if p.wait() != 0:
                failed(name)
            out[name] = json.loads(Path(spec["out"]).read_text())
        return out
    finally:
        for p, _ in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


def run_engine(tmp, name, spec):
    spec = dict(spec, out=str(Path(tmp) / f"{name}.json"))
    path = Path(tmp) / f"{name}.spec.json"
    path.write_text(json.dumps(spec))
    log = Path(tmp) / f"{name}.log"
    with open(log, "wb") as f:
        rc = subprocess.run([sys.executable, __file__, "--engine", str(path)], stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        sys.exit(f"engine {name} failed ({rc}):\n" + log.read_text(errors="replace")[-4000:])
    return json.loads(Path(spec["out"]).read_text())


def cli_stats(binary, sock):
    """``kachedb stats --json`` (it has the disk tier's counters)."""
    out = subprocess.run([binary, "stats", "--json", "--socket", sock], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def wait_written(binary, sock, blocks, timeout_s=300.0):
    """Waits until the disk tier reports ``blocks`` written and its queue empty; the count."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = cli_stats(binary, sock)
        if s["disk_writes"] >= blocks and s["disk_queue_blocks"] == 0:
            return s["disk_writes"]
        if time.monotonic() > deadline:
            sys.exit(f"the disk tier wrote {s['disk_writes']} of {blocks} blocks in {timeout_s} s")
        time.sleep(0.2)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--tokens", type=int, default=2048,
                    help="the prompt's tokens in whole blocks, which a hit serves (default 2048); the prompt is one "
                         "token longer, so that every hit computes exactly that one token")
    ap.add_argument("--reps", type=int, default=10,
                    help="prompts (default 10: even, so that each of the two engines taking turns goes first as often; "
                         "a prompt's cold TTFT varies by ~5 %% from turn to turn on a 2-core machine)")
    ap.add_argument("--settle-s", type=float, default=2.0,
                    help="seconds between a prompt's cold request and its in-engine hit, after the engine's stores are "
                         "committed (default 2)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--store-mode", default="batched", choices=["batched", "reserve"])
    ap.add_argument("--max-batched-tokens", type=int, default=None,
                    help="vLLM's max_num_batched_tokens (default: the model length, one prefill step per prompt)")
    ap.add_argument("--bin", default=str(ROOT / "target" / "release" / "kachedb"), help="the daemon binary")
    ap.add_argument("--disk-restart", action=argparse.BooleanOptionalAction, default=True,
                    help="also kill -9 the daemon after the writer stored, restart it on the same --disk DIR and time "
                         "a fresh engine's hit from the disk tier (default: on)")
    ap.add_argument("--engine", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.engine:
        return engine_main(a.engine)

    from transformers import LlamaConfig

    tmp = tempfile.mkdtemp(prefix="kachedb-vllm-bench-")
    model = os.path.join(tmp, "model")
    heads = a.hidden // 64
    LlamaConfig(vocab_size=8192, hidden_size=a.hidden, intermediate_size=int(a.hidden * 2.75), num_hidden_layers=a.layers,
                num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), max_position_embeddings=8192,
                architectures=["LlamaForCausalLM"]).save_pretrained(model)
    rng = random.Random(0)
    # One token past the last whole block: vLLM's own prefix cache never serves a
    # prompt's last token (it keeps num_tokens - 1, rounded down to whole blocks),
    # so on a block-aligned prompt its hit recomputes the whole last block while an
    # external hit (KacheDB) loads it and computes one token. With one token more,
    # both hits serve the same whole blocks and compute the same one token.
    prompts = [[rng.randrange(8192) for _ in range(a.tokens + 1)] for _ in range(a.reps)]
    max_len = max(4096, a.tokens + 64)
    sock = os.path.join(tmp, "kachedb.sock")
    disk_dir = os.path.join(tmp, "disk")
    extra = ["--disk", disk_dir, "--disk-size", "4GiB"] if a.disk_restart else []
    daemon = Daemon(sock, "2GiB", extra, binary=a.bin).start()
    disk = None
    try:
        common = dict(model=model, max_model_len=max_len, max_batched_tokens=a.max_batched_tokens or max_len, prompts=prompts, settle_s=a.settle_s,
                      options={"store_mode": a.store_mode, "store_thread": True})
        quiet = (lambda: wait_written(a.bin, sock, 0)) if a.disk_restart else None
        pair = run_in_turns(tmp, [("baseline", dict(common, socket=None, repeat=True)),
                                  ("writer", dict(common, socket=sock, repeat=True))], quiet=quiet)
        base, writer = pair["baseline"], pair["writer"]
        reader = run_engine(tmp, "reader", dict(common, socket=sock))
        if a.disk_restart:
            stored = writer["stats"]["stored_blocks"]
            written = wait_written(a.bin, sock, stored)
            daemon.kill()
            daemon = Daemon(sock, "2GiB", extra, binary=a.bin).start()
            disk_reader = run_engine(tmp, "disk_reader", dict(common, socket=sock))
            after = cli_stats(a.bin, sock)
            disk = {"blocks_written_before_kill": written, "disk_fills": after["disk_fills"],
                    "disk_recovered": after.get("disk_recovered"), "runs": disk_reader}
    finally:
        daemon.stop()

    med = lambda xs: statistics.median(xs)
    cold_plain = med([r["first"][0] for r in base["runs"]])
    cold = med([r["first"][0] for r in writer["runs"]])
    prefix_hit = med([r["second"][0] for r in base["runs"]])
    prefix_hit_conn = med([r["second"][0] for r in writer["runs"]])
    kdb_hit = med([r["first"][0] for r in reader["runs"]])
    paired = med([w["first"][0] / b["first"][0] for w, b in zip(writer["runs"], base["runs"])])
    same_tokens = all(r["first"][2] == w["first"][2] == b["first"][2]
                      for r, w, b in zip(reader["runs"], writer["runs"], base["runs"]))
    if disk is not None:
        same_tokens = same_tokens and all(d["first"][2] == b["first"][2]
                                          for d, b in zip(disk["runs"]["runs"], base["runs"]))
    ws, rs = writer["stats"], reader["stats"]
    blk_bytes = ws["namespaces"]["rank0"]["bytes_per_block"]
    out = {
        "prompt_tokens": a.tokens + 1,
        "reps": a.reps,
        "model": {"layers": a.layers, "hidden": a.hidden, "kv_bytes_per_block": blk_bytes, "block_tokens": 32,
                  "dtype": "float32"},
        "store_mode": a.store_mode,
        "ttft_cold_no_kachedb_s": cold_plain,
        "ttft_cold_s": cold,
        "ttft_prefix_cache_hit_s": prefix_hit,
        "ttft_prefix_cache_hit_kachedb_engine_s": prefix_hit_conn,
        "ttft_kachedb_hit_s": kdb_hit,
        "kachedb_hit_vs_prefix_hit": kdb_hit / prefix_hit,
        "cold_with_vs_without_kachedb": cold / cold_plain,
        # the same prompt's two cold TTFTs, taken in the same turn: drift between turns cancels
        "cold_with_vs_without_kachedb_paired_median": paired,
        "kachedb_hit_vs_cold": kdb_hit / cold_plain,
        "ttft_cold_per_prompt_s": {"no_kachedb": [r["first"][0] for r in base["runs"]],
                                   "kachedb": [r["first"][0] for r in writer["runs"]],
                                   "first_in_turn": ["no_kachedb" if i % 2 == 0 else "kachedb" for i in range(a.reps)],
                                   # per prompt: the engine process's CPU seconds, page faults, context switches
                                   "usage_no_kachedb": [r["first"][3] for r in base["runs"]],
                                   "usage_kachedb": [r["first"][3] for r in writer["runs"]]},
        "num_cached_tokens_kachedb_hit": [r["first"][1] for r in reader["runs"]],
        "num_cached_tokens_prefix_cache_hit": [r["second"][1] for r in base["runs"]],
        "usage_prefix_cache_hit": [r["second"][3] for r in base["runs"]],
        "usage_kachedb_hit": [r["first"][3] for r in reader["runs"]],
        "same_tokens_everywhere": same_tokens,
        "store_ms_per_block": 1e3 * ws["store_seconds"] / max(1, ws["stored_blocks"]),
        "store_ms_per_step": 1e3 * ws["store_seconds"] / max(1, ws["store_batches"]),
        "store_blocks_per_step": ws["stored_blocks"] / max(1, ws["store_batches"]),
        "store_GBps": ws["stored_blocks"] * blk_bytes / max(1e-9, ws["store_seconds"]) / 1e9,
        "load_ms_per_block": 1e3 * rs["load_seconds"] / max(1, rs["loaded_blocks"]),
        "load_ms_per_step": 1e3 * rs["load_seconds"] / max(1, rs["load_batches"]),
        "load_blocks_per_step": rs["loaded_blocks"] / max(1, rs["load_batches"]),
        "load_GBps": rs["loaded_blocks"] * blk_bytes / max(1e-9, rs["load_seconds"]) / 1e9,
        "startup_s": {"baseline": base["startup_s"], "writer": writer["startup_s"], "reader": reader["startup_s"]},
        "disk_restart": None if disk is None else {
            "ttft_disk_hit_s": med([r["first"][0] for r in disk["runs"]["runs"]]),
            "num_cached_tokens_disk_hit": [r["first"][1] for r in disk["runs"]["runs"]],
            "blocks_written_before_kill": disk["blocks_written_before_kill"],
            "disk_fills": disk["disk_fills"], "disk_recovered": disk["disk_recovered"],
        },
        "goals": {"kachedb_hit_within_1.5x_prefix_hit": kdb_hit <= 1.5 * prefix_hit,
                  "cold_with_kachedb_within_1.05x_without": cold <= 1.05 * cold_plain,
                  "kachedb_hit_at_most_10pct_cold": kdb_hit <= 0.10 * cold_plain},
    }
    if a.json:
        print(json.dumps(out, indent=1))
        return
    print(f"prompt {a.tokens + 1} tokens, {a.layers} layers x hidden {a.hidden} (float32), {a.reps} prompts, medians")
    print(f"  TTFT cold, no KacheDB        {cold_plain * 1e3:9.1f} ms")
    print(f"  TTFT cold, KacheDB storing   {cold * 1e3:9.1f} ms  = {cold / cold_plain:.2f}x cold without (goal <= 1.05); "
          f"median of the per-prompt ratios {paired:.2f}x")
    print("  cold per prompt, no KacheDB / KacheDB (ms): " + ", ".join(
        f"{b * 1e3:.0f} / {w * 1e3:.0f}" for b, w in zip(out["ttft_cold_per_prompt_s"]["no_kachedb"],
                                                       out["ttft_cold_per_prompt_s"]["kachedb"])))
    print(f"  TTFT vLLM prefix-cache hit   {prefix_hit * 1e3:9.1f} ms  (in the KacheDB engine: {prefix_hit_conn * 1e3:.1f} ms)")
    print(f"  TTFT KacheDB hit (fresh eng) {kdb_hit * 1e3:9.1f} ms  = {kdb_hit / prefix_hit:.2f}x prefix hit (goal <= 1.5), "
          f"{100 * kdb_hit / cold_plain:.1f} % of cold")
    print(f"  tokens served by the hit: KacheDB {sorted(set(out['num_cached_tokens_kachedb_hit']))}, "
          f"prefix cache {sorted(set(out['num_cached_tokens_prefix_cache_hit']))}")
    if disk is not None:
        dh = out["disk_restart"]["ttft_disk_hit_s"]
        print(f"  TTFT disk-tier hit after kill -9 and restart {dh * 1e3:9.1f} ms  = {dh / prefix_hit:.2f}x prefix hit, "
              f"{dh / kdb_hit:.2f}x KacheDB RAM hit, {100 * dh / cold_plain:.1f} % of cold "
              f"({disk['blocks_written_before_kill']} blocks on disk at the kill, {disk['disk_fills']} filled)")
    print(f"  store {out['store_ms_per_block']:.3f} ms/block, {out['store_ms_per_step']:.2f} ms/step "
          f"({out['store_blocks_per_step']:.0f} blocks of {blk_bytes / 2**20:.2f} MiB, {out['store_GBps']:.2f} GB/s)")
    print(f"  load  {out['load_ms_per_block']:.3f} ms/block, {out['load_ms_per_step']:.2f} ms/step "
          f"({out['load_blocks_per_step']:.0f} blocks, {out['load_GBps']:.2f} GB/s)")
    print(f"  same greedy tokens in all engines: {same_tokens}")


if __name__ == "__main__":
    main()
