"""KacheDB inside real vLLM CPU engines with tensor_parallel_size=2 (one worker
process per rank, vLLM's "mp" executor) against the real daemon (issue 25, item 2):

* engine A (TP=2) stores a prompt: each rank its own blocks, under its own namespace;
* one rank's copy of a block is then evicted (deleted from the daemon);
* engine B (TP=2, fresh process) hits the blocks before the gap, recomputes and
  stores the rest again (the "already stored" decision looks at every rank's
  key, not rank 0's alone), so after a prefix-cache reset it hits every block;
  its greedy tokens equal a TP=2 engine's without KacheDB;
* engine C (TP=1, same model) gets none of the TP=2 blocks;
* in vLLM's canonical layout (``canonical_layout: true``, issue 43) a block holds
  every KV head, whatever the engine's TP degree: engine CA (TP=2) stores a prompt
  as one block per vLLM block, engine CB (TP=1) serves it from those blocks with
  the greedy tokens of C (TP=1, computing it all), then stores another prompt,
  which engine CC (TP=2) serves with the tokens of a TP=2 engine without KacheDB.

Engines are expensive (a TP=2 engine starts in ~1-2 min on 2 cores), so each runs once
in the module fixture.
"""

import json
import random

import pytest

import kachedb
from vllm_support import Daemon, run_engine

BLOCK = 32
N_BLOCKS = 20
GAP = 12  # the block whose rank-1 copy is evicted
MAX_TOKENS = 8
pytestmark = pytest.mark.timeout(1800)


def _prompt(seed, n):
    r = random.Random(seed)
    return [r.randrange(2048) for _ in range(n)]


PT, ST = _prompt(21, N_BLOCKS * BLOCK), _prompt(22, 24)
PT2 = _prompt(23, N_BLOCKS * BLOCK)
CANONICAL = {"canonical_layout": True}


def _stats(path):
    with open(path) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def tp(workdir, model_dir):
    ref = run_engine(workdir, "tp-ref", dict(model=model_dir, socket=None, tensor_parallel_size=2, prefix_caching=False,
                                             phases=[{"prompts": [PT + ST], "max_tokens": MAX_TOKENS},
                                                     {"prompts": [PT2 + ST], "max_tokens": MAX_TOKENS}]))
    d = Daemon(str(workdir / "tp.sock")).start()
    try:
        sa, sb = str(workdir / "tpA.stats.json"), str(workdir / "tpB.stats.json")
        a = run_engine(workdir, "tpA", dict(model=model_dir, socket=d.socket, tensor_parallel_size=2,
                                            options={"stats_file": sa},
                                            phases=[{"prompts": [PT], "max_tokens": 1}]))
        after_a = d.stats()
        a_ranks = [_stats(f"{sa}.rank{r}") for r in (0, 1)]
        # Evict rank 1's copy of one block (as the daemon's LRU might).
        with kachedb.connect(d.socket) as kc:
            evicted = kc.delete(bytes.fromhex(a_ranks[1]["stored_keys"][GAP]))
        b = run_engine(workdir, "tpB", dict(model=model_dir, socket=d.socket, tensor_parallel_size=2,
                                            options={"stats_file": sb}, phases=[
                                                {"prompts": [PT + ST], "max_tokens": MAX_TOKENS},
                                                {"before": [{"reset_prefix_cache": True}],
                                                 "prompts": [PT + ST], "max_tokens": MAX_TOKENS},
                                            ]))
        b_ranks = [_stats(f"{sb}.rank{r}") for r in (0, 1)]
        c = run_engine(workdir, "tpC", dict(model=model_dir, socket=d.socket, tensor_parallel_size=1,
                                            phases=[{"prompts": [PT + ST], "max_tokens": MAX_TOKENS}]))
        # The canonical layout: TP=2 stores, TP=1 serves and stores, TP=2 serves.
        before_ca = d.stats()
        sca = str(workdir / "tpCA.stats.json")
        ca = run_engine(workdir, "tpCA", dict(model=model_dir, socket=d.socket, tensor_parallel_size=2,
                                              options=dict(CANONICAL, stats_file=sca),
                                              phases=[{"prompts": [PT], "max_tokens": 1}]))
        after_ca = d.stats()
        cb = run_engine(workdir, "tpCB", dict(model=model_dir, socket=d.socket, tensor_parallel_size=1,
                                              options=CANONICAL, phases=[
                                                  {"prompts": [PT + ST], "max_tokens": MAX_TOKENS},
                                                  {"prompts": [PT2], "max_tokens": 1},
                                              ]))
        scc = str(workdir / "tpCC.stats.json")
        cc = run_engine(workdir, "tpCC", dict(model=model_dir, socket=d.socket, tensor_parallel_size=2,
                                              options=dict(CANONICAL, stats_file=scc),
                                              phases=[{"prompts": [PT2 + ST], "max_tokens": MAX_TOKENS}]))
        yield {"ref": ref["phases"][0]["outputs"][0]["tokens"], "ref2": ref["phases"][1]["outputs"][0]["tokens"],
               "A": a, "A_ranks": a_ranks, "after_a": after_a,
               "evicted": evicted, "B": b, "B_ranks": b_ranks, "C": c,
               "CA": ca, "CA_ranks": [_stats(f"{sca}.rank{r}") for r in (0, 1)], "before_ca": before_ca,
               "after_ca": after_ca, "CB": cb, "CC": cc, "CC_ranks": [_stats(f"{scc}.rank{r}") for r in (0, 1)],
               "end": d.stats()}
    finally:
        d.stop()


def test_tp2_each_rank_stores_its_own_blocks(tp):
    r0, r1 = tp["A_ranks"]
    assert r0["stored_blocks"] == N_BLOCKS and r1["stored_blocks"] == N_BLOCKS
    assert r0["namespaces"]["rank0"]["digest"] != r1["namespaces"]["rank1"]["digest"]
    assert r0["namespaces"]["rank0"]["kv_tp_replicas"] == 1  # a Llama's KV is split by head
    assert tp["after_a"]["blocks"] == 2 * N_BLOCKS
    assert tp["evicted"]


def test_tp2_block_lost_by_one_rank_is_stored_again_and_hit(tp):
    # Before: "already stored" looked at rank 0's key only, so the block rank 1 lost
    # was never stored again and every later lookup stopped there.
    first, second = tp["B"]["phases"]
    assert first["outputs"][0]["num_cached_tokens"] == GAP * BLOCK
    assert second["outputs"][0]["num_cached_tokens"] == N_BLOCKS * BLOCK
    for r in tp["B_ranks"]:
        assert r["stored_blocks"] == N_BLOCKS - GAP
        assert r["loaded_blocks"] == GAP + N_BLOCKS
        assert r.get("load_failed_blocks", 0) == 0


def test_tp2_greedy_tokens_equal_a_run_without_kachedb(tp):
    for ph in tp["B"]["phases"]:
        assert ph["outputs"][0]["tokens"] == tp["ref"]


def test_tp1_engine_gets_none_of_the_tp2_blocks(tp):
    c = tp["C"]["phases"][0]
    assert c["outputs"][0]["num_cached_tokens"] == 0
    assert c["stats"].get("lookup_hits", 0) == 0 and c["stats"].get("loaded_blocks", 0) == 0
    st = tp["end"]
    assert st["pins"] == 0 and st["reserved"] == 0


def test_canonical_tp2_stores_one_block_per_vllm_block_with_every_head(tp):
    r0, r1 = tp["CA_ranks"]
    ns0, ns1 = r0["namespaces"]["rank0"], r1["namespaces"]["rank1"]
    assert ns0["digest"] == ns1["digest"] and ns0["canonical_layout"] == "v1-hnd" and ns0["tp_size"] is None
    assert r0["store_canonical_blocks"] == N_BLOCKS and r1["store_canonical_blocks"] == N_BLOCKS
    # One block per vLLM block, holding both ranks' heads: the bytes of the
    # per-rank layout's two blocks (engine A's), in one.
    assert tp["after_ca"]["blocks"] - tp["before_ca"]["blocks"] == N_BLOCKS
    grown = tp["after_ca"]["bytes_used"] - tp["before_ca"]["bytes_used"]
    assert grown == tp["after_a"]["bytes_used"]
    assert tp["after_ca"]["reserved"] == 0


def test_canonical_tp1_engine_serves_what_a_tp2_engine_stored(tp):
    first = tp["CB"]["phases"][0]
    assert first["outputs"][0]["num_cached_tokens"] == N_BLOCKS * BLOCK
    assert first["stats"]["loaded_blocks"] == N_BLOCKS and first["stats"].get("load_failed_blocks", 0) == 0
    # C is a TP=1 engine that computed the whole prompt.
    assert first["outputs"][0]["tokens"] == tp["C"]["phases"][0]["outputs"][0]["tokens"]


def test_canonical_tp2_engine_serves_what_a_tp1_engine_stored(tp):
    out = tp["CC"]["phases"][0]["outputs"][0]
    assert out["num_cached_tokens"] == N_BLOCKS * BLOCK
    for r in tp["CC_ranks"]:  # each rank read its own head of the TP=1 blocks
        assert r["loaded_blocks"] == N_BLOCKS and r.get("load_failed_blocks", 0) == 0
    assert out["tokens"] == tp["ref2"]
    st = tp["end"]
    assert st["pins"] == 0 and st["reserved"] == 0
