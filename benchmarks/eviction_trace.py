#!/usr/bin/env python3
"""``python benchmarks/eviction_trace.py [--json]``: replay a synthetic
multi-tenant prefix-cache trace against the real daemon under plain LRU and
chain-aware eviction (``kachedb serve --eviction lru|chain``), at 25 %, 50 % and
75 % of the trace's working set. See docs/eviction.md.

    python benchmarks/eviction_trace.py                 # table on stdout
    python benchmarks/eviction_trace.py --json          # one JSON object per run, then a summary; table on stderr
    python benchmarks/eviction_trace.py --requests 4000 --seed 7 --bin target/release/kachedb
    python benchmarks/eviction_trace.py --engines 0     # the daemon alone, head-first LOOKUPs
    python benchmarks/eviction_trace.py --routing random --store computed
    python benchmarks/eviction_trace.py --capacities 0.25 --policies chain --disk-sizes 1,4   # + a disk tier

The trace (seeded, the same for every run): a few shared system prompts
(Zipf popularity), many conversations growing turn by turn on top of one
(or of none), branches (a conversation forked at an earlier turn: a
regenerated answer, an edited message) and one-off long documents. Every block
is ``--block-tokens`` tokens; its key is a hash chain of its prefix, as in an
engine's prefix cache; its parent is the block before it, and the replay
names that parent when it stores the block where the modelled integration does.

Two replays (docs/eviction.md says what each models):

* ``--engines N`` (default 4): a fleet. N engines, each with its own small LRU
  prefix cache (``--local-cache``, a fraction of the working set), requests
  routed by user session (``--routing``), engines restarting cold now and then
  (``--restart-prob``). Each request's engine matches its local prefix, then
  talks to the daemon as ``kachedb.vllm`` under vLLM's OffloadingConnector
  does: one LOOKUP per key past the local prefix until the first miss, a
  ``get_prefix`` load of the hits, the manager's LOOKUP batch of the keys to
  store and a chained ``reserve_many`` of the rest (``FleetReplay`` spells out
  which keys). ``--store computed`` replaces the last step with a hypothetical
  integration that stores only what the engine computed, chained to the block
  before.
* ``--engines 0``: the daemon alone. Each request LOOKUPs its chain block by
  block from the head until the first miss (the leading hits are served from
  the cache), then stores the blocks from the first miss on, as one chain whose
  first block names the last hit as parent.

Blocks are one page (4 KiB); the daemon's megaslab is exactly the capacity in
blocks.

Measured per run:

* ``served_tokens`` / ``served_tokens_per_request``: prefix tokens served from
  the daemon (leading LOOKUP hits, or blocks loaded, x block tokens), and
  ``served_of_ideal``: their share of what an unbounded daemon would serve on
  the same trace (with engines: behind the same local caches, whose hits do not
  depend on the daemon); with engines also ``local_tokens``, ``total_tokens``
  (local + daemon) and ``total_of_ideal`` (against an unbounded cache), and
  ``stores_unlinked``: stores whose first block has a block before it in its
  chain but names no parent;
* ``unreachable_blocks``: blocks resident but unreachable (an ancestor of the
  block in its chain is not resident, so no LOOKUP of that chain reaches it),
  exactly, at 25/50/75/100 % of the trace (``samples``); the scan LOOKUPs every
  block ever stored in the order of its last use (tracked here, the benchmark
  being the daemon's only client), so it keeps the relative recency of
  resident blocks: it does not change what is evicted later;
* the daemon's ``evictions`` and ``links_cut_by_eviction`` (holes eviction made).

With ``--disk-sizes M,N`` every run is repeated with a disk tier behind the
megaslab (``kachedb serve --disk``) holding M (N) times the blocks the megaslab
holds, once per ``--disk-admits`` policy (``first``: every block written at its
commit; ``second``: only blocks requested again while in RAM, or committed
again; docs/disk.md). The served tokens then count the blocks the daemon served
from RAM or filled from disk (a LOOKUP that misses in RAM fills from disk);
``disk_fills``, ``disk_writes`` and ``disk_dropped_writes`` say how. The replay
waits for the write-behind queue to drain after each request, so the figures
do not depend on the disk's speed.

Not a timing benchmark: figures are counts, the same on any machine for one
seed. The lead's figures: ``python benchmarks/eviction_trace.py --json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: harness/
from harness.daemon import Daemon  # noqa: E402

BLOCK_BYTES = 4096  # one page: capacity in blocks is exact
DISK_BLOCK_BYTES = 8192  # a block file on disk: the 4 KiB header area + one page
DISK_ADMITS = ("first", "second")
POLICIES = ("lru", "chain")
CAPACITIES = (0.25, 0.50, 0.75)
SAMPLE_AT = (0.25, 0.50, 0.75, 1.0)


# --- the trace -----------------------------------------------------------------


@dataclass
class Trace:
    """Requests (each the key chain of its prompt, head first) and, for every
    block key, its parent key in its chain (``None`` for a chain's first block)."""

    requests: List[List[int]] = field(default_factory=list)
    parent: Dict[int, Optional[int]] = field(default_factory=dict)
    kinds: Dict[str, int] = field(default_factory=dict)
    # Per request: its user session (a conversation, its branches and its
    # resumptions share one; a document and the question after it share one).
    sessions: List[int] = field(default_factory=list)

    def extend(self, prefix: List[int], n_new: int, salt: str) -> List[int]:
        """``prefix`` plus ``n_new`` fresh blocks (new content: new keys)."""
        chain = list(prefix)
        for i in range(n_new):
            prev = chain[-1] if chain else None
            h = hashlib.blake2b(f"{prev}|{salt}|{i}".encode(), digest_size=16).digest()
            key = int.from_bytes(h, "little")
            self.parent[key] = prev
            chain.append(key)
        return chain

    def add(self, kind: str, chain: List[int], session: int) -> None:
        self.requests.append(chain)
        self.sessions.append(session)
        self.kinds[kind] = self.kinds.get(kind, 0) + 1


def make_trace(n_requests: int, seed: int) -> Trace:
    rng = random.Random(seed)
    t = Trace()
    systems = [t.extend([], rng.randint(8, 24), f"system-{i}") for i in range(5)]
    sys_weights = [1.0 / (i + 1) for i in range(len(systems))]  # Zipf
    # A conversation: its chain so far, the chain length at the end of each
    # turn (branch points), and the turns it has left.
    active: List[Dict[str, Any]] = []
    finished: List[Dict[str, Any]] = []
    n = 0

    def new_turn(conv: Dict[str, Any], kind: str) -> None:
        nonlocal n
        conv["chain"] = t.extend(conv["chain"], rng.randint(1, 4), f"turn-{n}")
        conv["turn_ends"].append(len(conv["chain"]))
        conv["left"] -= 1
        t.add(kind, conv["chain"], conv["session"])
        n += 1
        if conv["left"] <= 0:
            active.remove(conv)
            finished.append(conv)

    while n < n_requests:
        r = rng.random()
        if r < 0.15 or not active:
            base = rng.choices(systems, sys_weights)[0] if rng.random() < 0.8 else []
            conv = {"chain": list(base), "turn_ends": [], "left": rng.randint(1, 12), "session": n}
            active.append(conv)
            new_turn(conv, "new_conversation")
        elif r < 0.18:
            # A one-off long document (summarise this...), sometimes asked about once more.
            doc = t.extend([], rng.randint(24, 64), f"doc-{n}")
            t.add("document", doc, n)
            n += 1
            if rng.random() < 0.2:
                conv = {"chain": doc, "turn_ends": [len(doc)], "left": 1, "session": n - 1}
                active.append(conv)
        elif r < 0.24 and (finished or active):
            # A branch: fork a conversation at an earlier turn.
            src = rng.choice(finished + active)
            if not src["turn_ends"]:
                continue
            cut = rng.choice(src["turn_ends"])
            conv = {"chain": src["chain"][:cut], "turn_ends": [], "left": rng.randint(1, 4), "session": src["session"]}
            active.append(conv)
            new_turn(conv, "branch")
        elif r < 0.34 and finished:
            # A user comes back to a conversation that had gone quiet.
            conv = rng.choice(finished)
            finished.remove(conv)
            conv["left"] = rng.randint(1, 4)
            active.append(conv)
            new_turn(conv, "resumed")
        else:
            # Continue one of the open conversations (many users at once: any of them).
            new_turn(rng.choice(active), "next_turn")
    return t


def ideal_served(trace: Trace) -> List[int]:
    """Leading blocks an unbounded cache would serve, per request."""
    seen: set = set()
    out = []
    for chain in trace.requests:
        hit = 0
        while hit < len(chain) and chain[hit] in seen:
            hit += 1
        out.append(hit)
        seen.update(chain)
    return out


# --- the daemon ----------------------------------------------------------------


# --- one run -------------------------------------------------------------------


class Replay:
    """The engine's side of one run, and the recency of every stored block as
    the daemon sees it (commits and LOOKUP hits; this is its only client)."""

    def __init__(self, kc: Any, trace: Trace) -> None:
        self.kc = kc
        self.trace = trace
        self.last_use: Dict[int, int] = {}
        self.tick = 0

    def touch(self, key: int) -> None:
        self.tick += 1
        self.last_use[key] = self.tick

    def request(self, chain: List[int]) -> int:
        """LOOKUP until the first miss, store the rest as a chain; the hits."""
        kc = self.kc
        hit = 0
        while hit < len(chain) and kc.contains(chain[hit]):
            self.touch(chain[hit])
            hit += 1
        rest = chain[hit:]
        if rest:
            parent = chain[hit - 1] if hit else None
            import kachedb

            try:
                with kc.reserve_many(rest, (BLOCK_BYTES,), "u8", parent=parent, chain=True):
                    pass  # the KV bytes themselves do not matter here
                for k in rest:
                    self.touch(k)
            except kachedb.OutOfMemory:
                pass
        return hit

    def scan(self) -> Dict[str, int]:
        """Resident and unreachable blocks, LOOKUPs in last-use order (see the module docs)."""
        resident = set()
        for key in sorted(self.last_use, key=self.last_use.__getitem__):
            if self.kc.contains(key):
                resident.add(key)
                self.touch(key)
        reachable: Dict[int, bool] = {}

        def is_reachable(key: int) -> bool:
            path = []
            k: Optional[int] = key
            ok = True
            while k is not None:
                if k in reachable:
                    ok = reachable[k]
                    break
                path.append(k)
                if k not in resident:
                    ok = False
                    break
                k = self.trace.parent[k]
            for p in path:
                reachable[p] = ok and p in resident
                ok = reachable[p]
            return reachable[key]

        unreachable = sum(1 for k in resident if not is_reachable(k))
        return {"resident_blocks": len(resident), "unreachable_blocks": unreachable}


# --- a fleet of engines ---------------------------------------------------------


@dataclass
class Fleet:
    """Which engine serves each request, and which engine restarts (cold: its
    local cache emptied) just before it; drawn once from their own seed, the
    same for every run."""

    engines: int
    local_blocks: int
    routing: str
    store: str = "vllm"
    engine_of: List[int] = field(default_factory=list)
    restart_before: List[Optional[int]] = field(default_factory=list)


def make_fleet(trace: Trace, engines: int, local_blocks: int, routing: str, restart_prob: float,
               seed: int, store: str = "vllm") -> Fleet:
    rng = random.Random(f"fleet-{seed}")
    f = Fleet(engines, local_blocks, routing, store)
    by_session: Dict[int, int] = {}
    for i, session in enumerate(trace.sessions):
        if routing == "session":
            if session not in by_session:
                by_session[session] = rng.randrange(engines)
            f.engine_of.append(by_session[session])
        elif routing == "random":
            f.engine_of.append(rng.randrange(engines))
        else:  # round-robin
            f.engine_of.append(i % engines)
        f.restart_before.append(rng.randrange(engines) if rng.random() < restart_prob else None)
    return f


class LocalCache:
    """An engine's own prefix cache (vLLM's GPU block pool): LRU over blocks;
    a finished request's blocks are freed tail first (vLLM frees a request's
    blocks in reverse order so that a chain's tail is evicted before its
    head), so its head ends most recently used."""

    def __init__(self, capacity_blocks: int) -> None:
        from collections import OrderedDict

        self.capacity_blocks = capacity_blocks
        self.blocks: "OrderedDict[int, None]" = OrderedDict()

    def match(self, chain: List[int]) -> int:
        hit = 0
        while hit < len(chain) and chain[hit] in self.blocks:
            hit += 1
        return hit

    def finish(self, chain: List[int]) -> None:
        for key in reversed(chain):
            self.blocks[key] = None
            self.blocks.move_to_end(key)
        while len(self.blocks) > self.capacity_blocks:
            self.blocks.popitem(last=False)

    def clear(self) -> None:
        self.blocks.clear()


class FleetReplay(Replay):
    """Engines with their own prefix caches in front of one daemon, each request
    handled as vLLM's OffloadingConnector with ``kachedb.vllm`` handles it (one
    KV-cache group, world size 1, CPU copies):

    1. the engine's local prefix cache matches the leading ``L`` blocks;
    2. the scheduler's lookup (``get_num_new_matched_tokens``): one LOOKUP per
       key from block ``L`` on, until the first miss: ``h`` hits;
    3. ``h > 0``: the worker's load, ``get_prefix`` of those ``h`` keys (pinned,
       copied, released as the worker drops its views: its list is freed last
       to first, and the last view, still bound to the loop variable, at the
       end); the store then covers the blocks from ``L + h`` on;
       ``h == 0``: vLLM's scheduler stores the request from block 0 (the
       connector only skips blocks it loaded), locally cached ones included;
    4. the manager's ``prepare_store``: one LOOKUP batch of every key of the
       store (each present key is touched, past a miss too), skipping the
       leading present ones; the worker's ``reserve_many(chain=True)`` of the
       rest, the first block's parent being the last leading present key, else
       the request's chain tail (the last block it loaded: ``prepare_load``
       records it), else none;
       all or nothing: out of memory skips the store;
    5. the engine's local cache then holds the whole chain.

    With ``store="computed"`` (not what ``kachedb.vllm`` does today: an
    integration that offers the daemon only the blocks the engine computed, as
    SGLang's HiCache writes back only new pages), step 3 stores from block
    ``L + h`` in both cases, and the first stored block names the block before
    it as parent.

    ``last_use`` mirrors every daemon touch, in the daemon's order, for the scan.
    """

    def __init__(self, kc: Any, trace: Trace, fleet: Fleet) -> None:
        super().__init__(kc, trace)
        self.fleet = fleet
        self.local = [LocalCache(fleet.local_blocks) for _ in range(fleet.engines)]
        self.stored_ever: set = set()
        self.load_failed_blocks = 0
        self.stores_unlinked = 0  # stores whose first block has a parent in its chain but names none
        self.stores_skipped_full = 0
        self.restarts = 0
        self.requests_loading = 0  # requests that loaded blocks from the daemon

    def _lookup_one(self, key: int) -> bool:
        # A key never stored is not present: skip the round trip (a miss changes nothing).
        if key not in self.stored_ever or not self.kc.contains(key):
            return False
        self.touch(key)
        return True

    def _lookup_batch(self, keys: List[int]) -> int:
        """The manager's ``kc.lookup(keys)``: leading present count; every present
        key is touched. The present keys past the first miss are found by
        LOOKUPs of each in order: touching a suffix of the keys just touched, in
        their order, leaves the daemon's recency order as the one batch left it."""
        n = self.kc.lookup(keys)
        for k in keys[:n]:
            self.touch(k)
        for k in keys[n + 1:]:
            self._lookup_one(k)
        return n

    def serve(self, i: int, chain: List[int]) -> Tuple[int, int]:
        """Request ``i``: (blocks from the local cache, blocks loaded from the daemon)."""
        import kachedb

        restart = self.fleet.restart_before[i]
        if restart is not None:
            self.local[restart].clear()
            self.restarts += 1
        local = self.local[self.fleet.engine_of[i]]
        kc = self.kc
        n_local = local.match(chain)
        h = n_local
        while h < len(chain) and self._lookup_one(chain[h]):
            h += 1
        loaded = 0
        want: List[int] = []
        if h > n_local:
            want = chain[n_local:h]
            views = kc.get_prefix(want)
            loaded = len(views)
            self.requests_loading += loaded > 0
            self.load_failed_blocks += len(want) - loaded
            # The worker's release order (see the class docs): each view dropped
            # releases its pin, which touches its block.
            for j in list(range(loaded - 2, -1, -1)) + [loaded - 1] * (loaded > 0):
                views[j] = None
                self.touch(want[j])
            store = chain[n_local + loaded:]
        elif self.fleet.store == "computed":
            store = chain[n_local:]
        else:
            store = chain
        if store:
            present = self._lookup_batch(store)
            todo = store[present:]
            parent = store[present - 1] if present else (want[loaded - 1] if loaded else None)
            if self.fleet.store == "computed":
                parent = self.trace.parent[todo[0]] if todo else None
            if todo:
                if parent is None and self.trace.parent[todo[0]] is not None:
                    self.stores_unlinked += 1
                try:
                    with kc.reserve_many(todo, (BLOCK_BYTES,), "u8", parent=parent, chain=True):
                        pass
                    for k in todo:
                        self.touch(k)
                        self.stored_ever.add(k)
                except kachedb.OutOfMemory:
                    self.stores_skipped_full += 1
        local.finish(chain)
        return n_local, loaded


def drain_disk(kc: Any) -> None:
    """Waits until the disk tier's write-behind queue is empty."""
    while kc.stats().get("disk_queue_blocks", 0):
        time.sleep(0.001)


# --- reusability: the daemon's figures against the trace's ------------------------


class CountingClient:
    """The client, counting every key the replay asks the daemon about (each
    ``contains``, ``lookup`` and ``get_prefix`` key is one LOOKUP or GET frame,
    what the daemon's request window counts): the true distinct keys and
    requests that its HyperLogLog estimate and ceiling are checked against."""

    def __init__(self, kc: Any) -> None:
        self._kc = kc
        self.requests = 0
        self.distinct: set = set()

    def _asked(self, keys: Sequence[int]) -> None:
        self.requests += len(keys)
        self.distinct.update(keys)

    def contains(self, key: int) -> bool:
        self._asked([key])
        return self._kc.contains(key)

    def lookup(self, keys: List[int]) -> int:
        self._asked(keys)
        return self._kc.lookup(keys)

    def get_prefix(self, keys: List[int]) -> Any:
        self._asked(keys)
        return self._kc.get_prefix(keys)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kc, name)


def reusability(st: Dict[str, Any], scan: Dict[str, int], counted: CountingClient) -> Dict[str, Any]:
    """The daemon's reachable / orphaned bytes and ceiling estimate (``stats()``)
    next to the trace's true figures at one sample (``scan``: resident and
    unreachable blocks by the trace's own chains)."""
    true_orphaned = scan["unreachable_blocks"] * BLOCK_BYTES
    true_reachable = (scan["resident_blocks"] - scan["unreachable_blocks"]) * BLOCK_BYTES
    true_distinct, requests = len(counted.distinct), counted.requests
    true_ceiling = 1 - true_distinct / requests if requests else 0.0
    return {
        "reachable_bytes": st["reachable_bytes"], "true_reachable_bytes": true_reachable,
        "orphaned_bytes": st["orphaned_bytes"], "true_orphaned_bytes": true_orphaned,
        "distinct_keys_estimate": st["window_distinct_keys"], "true_distinct_keys": true_distinct,
        "distinct_keys_error": st["window_distinct_keys"] / max(1, true_distinct) - 1,
        "key_requests": st["window_key_requests"], "true_key_requests": requests,
        "hit_ratio_ceiling": st["hit_ratio_ceiling"], "true_hit_ratio_ceiling": true_ceiling,
    }


def reusability_table(results: Sequence[Dict[str, Any]]) -> str:
    """What an operator sees at the end of each run against the trace's truth."""
    head = ("| capacity | policy | reachable MiB (daemon / true) | orphaned KiB (daemon / true) "
            "| distinct keys (estimate / true, error) | hit-ratio ceiling (estimate / true) |")
    lines = [head, "|" + " --- |" * 6]
    for r in results:
        u = r["samples"][-1]
        lines.append(
            f"| {r['capacity_of_working_set']:.0%} | {r['policy']} "
            f"| {u['reachable_bytes'] / 2**20:.2f} / {u['true_reachable_bytes'] / 2**20:.2f} "
            f"| {u['orphaned_bytes'] / 1024:.0f} / {u['true_orphaned_bytes'] / 1024:.0f} "
            f"| {u['distinct_keys_estimate']} / {u['true_distinct_keys']}, {u['distinct_keys_error']:+.2%} "
            f"| {u['hit_ratio_ceiling']:.4f} / {u['true_hit_ratio_ceiling']:.4f} |")
    return "\n".join(lines)


def run_one(binary: str, trace: Trace, ideal: List[int], policy: str, capacity: float, working_set: int,
            block_tokens: int, fleet: Optional[Fleet] = None, disk_times: float = 0.0,
            disk_admit: str = "first") -> Dict[str, Any]:
    import kachedb

    blocks = max(1, round(capacity * working_set))
    # One request window over the whole run (the trace's truth counts from its start).
    extra = ["--eviction", policy, "--headroom", "0", "--request-window", "86400"]
    disk_dir = None
    if disk_times:
        disk_dir = tempfile.mkdtemp(prefix="kachedb-trace-disk-")
        disk_blocks = max(2, round(disk_times * blocks))
        extra += ["--disk", disk_dir, "--disk-size", str(disk_blocks * DISK_BLOCK_BYTES),
                  "--disk-queue-bytes", str(blocks * BLOCK_BYTES), "--disk-admit", disk_admit]
    d = Daemon(size=blocks * BLOCK_BYTES, extra=extra, binary=binary, ready_timeout_s=60).start()
    try:
        with kachedb.connect(d.socket) as kc:
            st = kc.stats()
            if st["bytes_total"] != blocks * BLOCK_BYTES or st["eviction_policy"] != policy:
                raise RuntimeError(f"daemon has {st['bytes_total']} bytes, policy {st['eviction_policy']}")
            counted = CountingClient(kc)
            rp = Replay(counted, trace) if fleet is None else FleetReplay(counted, trace, fleet)
            served = []
            local_served = []
            samples = []
            marks = {max(1, round(f * len(trace.requests))): f for f in SAMPLE_AT}
            t0 = time.monotonic()
            if disk_dir:
                while not kc.stats().get("disk_indexed"):
                    time.sleep(0.01)
            for i, chain in enumerate(trace.requests, 1):
                if isinstance(rp, FleetReplay):
                    n_local, loaded = rp.serve(i - 1, chain)
                    local_served.append(n_local)
                    served.append(loaded)
                else:
                    served.append(rp.request(chain))
                if disk_dir:
                    drain_disk(kc)
                if i in marks:
                    s = rp.scan()
                    s["at"] = marks[i]
                    s.update(reusability(kc.stats(), s, counted))
                    samples.append(s)
            st = kc.stats()
            wall_s = time.monotonic() - t0
    finally:
        d.stop()
        if disk_dir:
            shutil.rmtree(disk_dir, ignore_errors=True)
    n = len(trace.requests)
    served_blocks = sum(served)
    possible_blocks = sum(ideal)  # what an unbounded daemon would serve
    out: Dict[str, Any] = {}
    if isinstance(rp, FleetReplay):
        local_blocks = sum(local_served)
        total_blocks = local_blocks + served_blocks
        out = {
            "engines": fleet.engines,
            "local_cache_blocks": fleet.local_blocks,
            "routing": fleet.routing,
            "store": fleet.store,
            "local_tokens": local_blocks * block_tokens,
            "local_tokens_per_request": local_blocks * block_tokens / n,
            "kachedb_tokens": served_blocks * block_tokens,
            "kachedb_tokens_per_request": served_blocks * block_tokens / n,
            "total_tokens": total_blocks * block_tokens,
            "total_tokens_per_request": total_blocks * block_tokens / n,
            "total_of_ideal": total_blocks / max(1, sum(ideal)),
            "load_failed_blocks": rp.load_failed_blocks,
            "stores_unlinked": rp.stores_unlinked,
            "stores_skipped_full": rp.stores_skipped_full,
            "restarts": rp.restarts,
            "requests_loading": rp.requests_loading,
        }
        # Behind the same local caches (their hits do not depend on the daemon).
        possible_blocks -= local_blocks
    if disk_times:
        out.update({
            "disk_times_ram": disk_times,
            "disk_admit": disk_admit,
            "disk_capacity_blocks": disk_blocks,
            "disk_fills": st["disk_fills"],
            "disk_writes": st["disk_writes"],
            "disk_dropped_writes": st["disk_dropped_writes"],
            "disk_evictions": st["disk_evictions"],
            "disk_blocks_at_end": st["disk_blocks"],
        })
    return {
        "policy": policy,
        "capacity_of_working_set": capacity,
        "capacity_blocks": blocks,
        "requests": n,
        # Prefix tokens the daemon served (loaded from it).
        "served_tokens": served_blocks * block_tokens,
        "served_tokens_per_request": served_blocks * block_tokens / n,
        "ideal_tokens": sum(ideal) * block_tokens,
        "possible_tokens": possible_blocks * block_tokens,
        "served_of_ideal": served_blocks / max(1, possible_blocks),
        "requested_tokens": sum(len(c) for c in trace.requests) * block_tokens,
        "unreachable_blocks": samples[-1]["unreachable_blocks"],
        "resident_blocks": samples[-1]["resident_blocks"],
        "samples": samples,
        "evictions": st["evictions"],
        "links_cut_by_eviction": st["links_cut_by_eviction"],
        "chained_blocks": st["chained_blocks"],
        "parents_missing": st["parents_missing"],
        "links_cut": st["links_cut"],
        "wall_s": round(wall_s, 2),
        **out,
    }


# --- report --------------------------------------------------------------------


def fleet_table(results: Sequence[Dict[str, Any]]) -> str:
    head = ("| capacity | policy | from KacheDB: tokens / request | of possible | local tokens / request "
            "| total tokens / request | total of ideal | unreachable at end | unreachable (25/50/75/100 %) "
            "| evictions | holes made by eviction | stores naming no parent / parent not resident |")
    lines = [head, "| " + " | ".join("---" for _ in range(12)) + " |"]
    for r in sorted(results, key=lambda r: (r["capacity_of_working_set"], r["policy"])):
        samples = "/".join(str(s["unreachable_blocks"]) for s in r["samples"])
        lines.append(
            f"| {r['capacity_of_working_set']:.0%} ({r['capacity_blocks']} blocks) | {r['policy']} "
            f"| {r['served_tokens_per_request']:.1f} | {r['served_of_ideal']:.1%} "
            f"| {r['local_tokens_per_request']:.1f} | {r['total_tokens_per_request']:.1f} | {r['total_of_ideal']:.1%} "
            f"| {r['unreachable_blocks']} of {r['resident_blocks']} | {samples} | {r['evictions']} "
            f"| {r['links_cut_by_eviction']} | {r['stores_unlinked']} / {r['parents_missing']} |"
        )
    return "\n".join(lines)


def disk_table(results: Sequence[Dict[str, Any]]) -> str:
    """The runs with and without a disk tier, side by side."""
    head = ("| RAM | policy | disk | admit | from KacheDB: tokens / request | of possible "
            "| disk fills | disk writes | dropped writes | disk evictions |")
    lines = [head, "| " + " | ".join("---" for _ in range(10)) + " |"]
    key = lambda r: (r["capacity_of_working_set"], r["policy"], r.get("disk_times_ram", 0), r.get("disk_admit", ""))
    for r in sorted(results, key=key):
        disk = f"{r['disk_times_ram']:g}x RAM ({r['disk_capacity_blocks']} blocks)" if "disk_admit" in r else "none"
        lines.append(
            f"| {r['capacity_of_working_set']:.0%} ({r['capacity_blocks']} blocks) | {r['policy']} | {disk} "
            f"| {r.get('disk_admit', '-')} | {r['served_tokens_per_request']:.1f} | {r['served_of_ideal']:.1%} "
            f"| {r.get('disk_fills', 0)} | {r.get('disk_writes', 0)} | {r.get('disk_dropped_writes', 0)} "
            f"| {r.get('disk_evictions', 0)} |"
        )
    return "\n".join(lines)


def table(results: Sequence[Dict[str, Any]]) -> str:
    if any("disk_admit" in r for r in results):
        return disk_table(results)
    if results and "engines" in results[0]:
        return fleet_table(results)
    head = ("| capacity | policy | served tokens / request | of ideal | unreachable at end "
            "| unreachable (25/50/75/100 %) | evictions | holes made by eviction |")
    lines = [head, "| " + " | ".join("---" for _ in range(8)) + " |"]
    for r in sorted(results, key=lambda r: (r["capacity_of_working_set"], r["policy"])):
        samples = "/".join(str(s["unreachable_blocks"]) for s in r["samples"])
        lines.append(
            f"| {r['capacity_of_working_set']:.0%} ({r['capacity_blocks']} blocks) | {r['policy']} "
            f"| {r['served_tokens_per_request']:.1f} | {r['served_of_ideal']:.1%} "
            f"| {r['unreachable_blocks']} of {r['resident_blocks']} | {samples} | {r['evictions']} "
            f"| {r['links_cut_by_eviction']} |"
        )
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/eviction_trace.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="one JSON object per run and a summary on stdout; table on stderr")
    p.add_argument("--requests", type=int, default=1200, help="requests in the trace (default 1200)")
    p.add_argument("--seed", type=int, default=1, help="trace seed (default 1)")
    p.add_argument("--block-tokens", type=int, default=16, help="tokens per block, for the token counts (default 16)")
    p.add_argument("--capacities", default=",".join(str(c) for c in CAPACITIES),
                   help="fractions of the working set (default 0.25,0.5,0.75)")
    p.add_argument("--policies", default=",".join(POLICIES), help="default lru,chain")
    p.add_argument("--engines", type=int, default=4,
                   help="engines, each with its own prefix cache, in front of the daemon (default 4); "
                        "0: every request LOOKUPs its chain from the head in the daemon alone")
    p.add_argument("--local-cache", type=float, default=0.05,
                   help="each engine's own prefix cache, as a fraction of the working set (default 0.05)")
    p.add_argument("--routing", choices=("session", "random", "round-robin"), default="session",
                   help="session: a user session (conversation, its branches and resumptions) stays on "
                        "the engine drawn at its start; random: each request to a random engine; "
                        "round-robin: request i to engine i mod N (default session)")
    p.add_argument("--store", choices=("vllm", "computed"), default="vllm",
                   help="vllm: store as kachedb.vllm does under vLLM's OffloadingConnector (default); "
                        "computed: a hypothetical integration storing only the blocks the engine computed, "
                        "each chained to the block before it")
    p.add_argument("--restart-prob", type=float, default=0.005,
                   help="chance, before each request, that one random engine restarts cold (default 0.005)")
    p.add_argument("--disk-sizes", default="",
                   help="also run with a disk tier holding these multiples of the megaslab's blocks, "
                        "e.g. 1,4 (default: no disk tier)")
    p.add_argument("--disk-admits", default=",".join(DISK_ADMITS),
                   help="--disk-admit policies of the disk runs (default first,second)")
    here = os.path.dirname(os.path.abspath(__file__))
    p.add_argument("--bin", default=os.path.join(here, "..", "target", "release", "kachedb"),
                   help="the kachedb binary (default target/release/kachedb)")
    a = p.parse_args(argv)
    if not os.access(a.bin, os.X_OK):
        p.error(f"no kachedb binary at {a.bin}: cargo build --release -p kachedb-cli, or pass --bin")

    trace = make_trace(a.requests, a.seed)
    ideal = ideal_served(trace)
    working_set = len(trace.parent)
    info: Dict[str, Any] = {
        "trace": {"requests": len(trace.requests), "working_set_blocks": working_set, "kinds": trace.kinds,
                  "seed": a.seed, "block_tokens": a.block_tokens, "block_bytes": BLOCK_BYTES,
                  "mean_request_blocks": sum(len(c) for c in trace.requests) / len(trace.requests)}}
    fleet: Optional[Fleet] = None
    if a.engines < 0 or not 0 <= a.restart_prob <= 1 or not 0 < a.local_cache:
        p.error("--engines must be >= 0, --restart-prob in [0, 1], --local-cache > 0")
    if not a.engines and a.store != "vllm":
        p.error("--store computed models an engine integration: it needs --engines >= 1")
    if a.engines:
        local_blocks = max(1, round(a.local_cache * working_set))
        fleet = make_fleet(trace, a.engines, local_blocks, a.routing, a.restart_prob, a.seed, a.store)
        info["fleet"] = {"engines": a.engines, "local_cache_blocks": local_blocks, "routing": a.routing,
                         "store": a.store,
                         "restart_prob": a.restart_prob,
                         "restarts": sum(r is not None for r in fleet.restart_before)}
    out = sys.stdout
    if a.json:
        print(json.dumps(info), flush=True)
    else:
        print(f"trace: {json.dumps(info['trace'])}", flush=True)
        if fleet is not None:
            print(f"fleet: {json.dumps(info['fleet'])}", flush=True)
    results = []
    for capacity in (float(c) for c in a.capacities.split(",")):
        for policy in a.policies.split(","):
            r = run_one(a.bin, trace, ideal, policy, capacity, working_set, a.block_tokens, fleet)
            results.append(r)
            if a.json:
                print(json.dumps(r), flush=True)
            for times in (float(x) for x in a.disk_sizes.split(",") if x):
                for admit in a.disk_admits.split(","):
                    r = run_one(a.bin, trace, ideal, policy, capacity, working_set, a.block_tokens, fleet,
                                disk_times=times, disk_admit=admit)
                    results.append(r)
                    if a.json:
                        print(json.dumps(r), flush=True)
    summary: Dict[str, Any] = {"summary": True, "by_capacity": {}}
    for capacity in sorted({r["capacity_of_working_set"] for r in results}):
        row = {r["policy"]: r for r in results if r["capacity_of_working_set"] == capacity and "disk_admit" not in r}
        if {"lru", "chain"} <= row.keys():
            summary["by_capacity"][str(capacity)] = {
                "served_tokens_gain": row["chain"]["served_tokens"] / max(1, row["lru"]["served_tokens"]) - 1,
                "chain_more_served": row["chain"]["served_tokens"] > row["lru"]["served_tokens"],
                "chain_unreachable": row["chain"]["unreachable_blocks"],
                "lru_unreachable": row["lru"]["unreachable_blocks"],
            }
    t = table(results) + "\n\n" + reusability_table(results)
    if a.json:
        print(json.dumps(summary), flush=True)
        print(t, file=sys.stderr)
    else:
        print(t, file=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
