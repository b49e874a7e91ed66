"""Blocks shared across tensor-parallel degrees (issue 43): in vLLM's canonical
layout (``canonical_layout: true``) a KacheDB block holds every KV head of its
layers, as a TP=1 engine's page does; the scheduler reserves it, each rank
writes its own heads into it in place through vLLM's ``CanonicalPageMapping``
(strided runs between its page and the canonical page), sets its
acknowledgement byte, and the scheduler commits the block once every rank's is
set. A TP=1 engine reads what a TP=2 engine stored and the reverse.

The real spec, manager and workers are built the way vLLM's
``OffloadingConnector`` builds them for each rank (as ``test_vllm_mla.py``
does), over per-layer KV caches of both layouts vLLM certifies (heads outside
tokens, ``LBHNC``, the CPU backend's; tokens outside heads, ``LBNHC``), with
the mappings vLLM's own ``derive_canonical_mappings`` gives each rank, against
the real daemon. A TP=2 rank's caches are the TP=1 caches' heads cut in two, as
tensor parallelism cuts them.
"""

import os
from types import SimpleNamespace

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import derive_canonical_mappings
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec
from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor, GPULoadStoreSpec
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)

from kachedb.vllm import spec as _spec
from kachedb.vllm._state import COUNTERS
from kachedb.vllm.manager import KacheDBLoadStoreSpec
from kachedb.vllm.worker import KacheDBOffloadingWorker
from test_vllm_device_branch import StandInCopies
from vllm_support import Daemon

HEADS, HEAD, TOKENS, LAYERS, BLOCKS = 4, 32, 16, 2, 32
N = 6
NAMES = tuple(f"model.layers.{i}.self_attn.attn" for i in range(LAYERS))


LATENT = 48  # MLA: one latent vector per token, the same on every rank


def kv_cache_config(tp, mla=False):
    if mla:  # what vLLM's MLA layer declares
        spec = MLAAttentionSpec(block_size=TOKENS, num_kv_heads=1, head_size=LATENT, dtype=torch.bfloat16,
                                max_tp_shards=1)
    else:
        spec = FullAttentionSpec(block_size=TOKENS, num_kv_heads=HEADS // tp, head_size=HEAD, dtype=torch.bfloat16)
    return KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(list(NAMES), spec)])


def page_bytes(tp, mla=False):
    return TOKENS * LATENT * 2 if mla else 2 * TOKENS * (HEADS // tp) * HEAD * 2


def vllm_config(tp, rank):
    """What ``derive_canonical_mappings`` reads of vLLM's config."""
    return SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, prefill_context_parallel_size=1, world_size=tp,
                                        decode_context_parallel_size=1, cp_kv_cache_interleave_size=1, rank=rank),
        model_config=SimpleNamespace(get_total_num_kv_heads=lambda: HEADS),
    )


def offloading_config(socket, tp, rank, model, salt, layout, canonical=True, mla=False):
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=TOKENS, layer_names=NAMES, group_id=0),),
        worker_kv_bytes_per_block=LAYERS * page_bytes(tp, mla),
        enable_kv_cache_events=False,
        extra_config={"socket": socket, "namespace": salt, "retry_seconds": 0.2, "canonical_layout": canonical},
        engine_id=f"canonical-tp{tp}",
        model=OffloadingModelConfig(name=model, dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=TOKENS, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=rank, world_size=tp, tp_size=tp, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                                          is_parallelism_agnostic=True),
        canonical_layout=canonical,
        kv_cache_layout=layout,
    )


def full_caches(seed, layout):
    """TP=1 per-layer caches, logical ``(blocks, heads, tokens, 2*head)`` (K and V
    of a token and head side by side), laid out as ``layout`` says."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(LAYERS):
        t = torch.randn((BLOCKS, HEADS, TOKENS, 2 * HEAD), generator=g).to(torch.bfloat16)
        out.append(_laid_out(t, layout))
    return out


def _laid_out(logical, layout):
    if layout == "LBHNC":
        return logical.contiguous()
    return logical.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)  # tokens outside heads


def rank_caches(full, tp, rank, layout):
    """Rank ``rank`` of TP=``tp``: its heads of ``full``, laid out the same way."""
    per = HEADS // tp
    return [_laid_out(t[:, rank * per:(rank + 1) * per].clone(), layout) for t in full]


def canonical_kv_caches(layers, tp, rank, mla=False):
    """The worker's view, as vLLM's connector makes it: each layer's blocks as
    ``(blocks, page)`` bytes with vLLM's mapping of this rank's page."""
    mappings = derive_canonical_mappings(vllm_config(tp, rank), kv_cache_config(tp, mla), dict(zip(NAMES, layers)))
    page = page_bytes(tp, mla)
    tensors = []
    for t in layers:
        storage = t.untyped_storage()
        raw = torch.empty(0, dtype=torch.int8).set_(storage, 0, (BLOCKS, page), (page, 1))
        tensors.append(CanonicalKVCacheTensor(raw, page))
    refs = [[CanonicalKVCacheRef(i, page, mapping=mappings[name]) for i, name in enumerate(NAMES)]]
    return CanonicalKVCaches(tensors, refs)


def build_spec(socket, tp, rank, model, salt, layout, canonical=True, mla=False):
    _spec._building.kv_cache_config = kv_cache_config(tp, mla)
    try:
        return _spec.KacheDBOffloadingSpec(offloading_config(socket, tp, rank, model, salt, layout, canonical, mla))
    finally:
        _spec._building.kv_cache_config = None


class Engine:
    """One engine's scheduler-side manager and its ranks' workers."""

    def __init__(self, socket, tp, model, salt, layout, full, canonical=True, mla=False, copies=None):
        self.tp = tp
        self.specs = [build_spec(socket, tp, r, model, salt, layout, canonical, mla) for r in range(tp)]
        # MLA: every rank holds the whole latent KV
        self.layers = [[t.clone() for t in full] if mla else rank_caches(full, tp, r, layout) for r in range(tp)]
        if copies is None:
            self.workers = [s.get_worker(canonical_kv_caches(l, tp, r, mla))
                            for r, (s, l) in enumerate(zip(self.specs, self.layers))]
        else:  # a device of the test's own (``copies(rank)``)
            self.workers = [KacheDBOffloadingWorker(s, canonical_kv_caches(l, tp, r, mla), copies=copies(r))
                            for r, (s, l) in enumerate(zip(self.specs, self.layers))]
        self.manager = self.specs[0].get_manager()
        self.job = 0

    def store(self, keys, src, ranks=None):
        out = self.manager.prepare_store(keys, None)
        self.job += 1
        moved = []
        for r, w in enumerate(self.workers):
            if ranks is not None and r not in ranks:
                continue  # a rank that never writes its part
            w.submit_store(self.job, GPULoadStoreSpec(src, [len(src)], [0]), out.store_spec)
            w.wait({self.job})
            moved += [f.transfer_size for f in w.get_finished()]
        self.manager.complete_store(out.keys_to_store, None)
        return out, moved

    def load(self, keys, dst):
        self.job += 1
        moved = []
        for w in self.workers:
            w.submit_load(self.job, KacheDBLoadStoreSpec(keys), GPULoadStoreSpec(dst, [len(dst)], [0]))
            moved += [f.transfer_size for f in w.get_finished()]
        return moved, [w.take_invalid_block_ids() for w in self.workers]

    def heads(self, l, blocks):
        """Layer ``l``'s blocks with every head, the ranks' heads put side by side."""
        return torch.cat([layers[l][blocks] for layers in self.layers], dim=1)

    def close(self):
        for w in self.workers:
            w.shutdown()
        self.manager.shutdown()


def keys(n, start):
    return [i.to_bytes(32, "big") + b"\0\0\0\0" for i in range(start, start + n)]


@pytest.fixture(scope="module")
def daemon(workdir):
    d = Daemon(str(workdir / "canonical.sock"), size="64MiB").start()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def model(workdir):
    from transformers import LlamaConfig

    path = str(workdir / "llama-tiny-4kv")
    LlamaConfig(vocab_size=256, hidden_size=HEADS * HEAD, intermediate_size=128, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, num_key_value_heads=HEADS, architectures=["LlamaForCausalLM"]
                ).save_pretrained(path)
    return path


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
def test_tp1_and_tp2_engines_read_each_others_blocks(daemon, model, layout):
    salt = os.urandom(4).hex()
    full = full_caches(1, layout)
    tp2 = Engine(daemon.socket, 2, model, salt, layout, full)
    tp1 = Engine(daemon.socket, 1, model, salt, layout, full_caches(2, layout))
    try:
        # One namespace for every rank of every degree, and not the per-rank one.
        names = {s.namespaces[s.rank] for e in (tp1, tp2) for s in e.specs}
        assert len(names) == 1
        per_rank = build_spec(daemon.socket, 2, 0, model, salt, layout, canonical=False)
        assert per_rank.canonical is None and per_rank.namespaces[0] not in names
        assert tp2.specs[0].canonical == ("v1-hnd" if layout == "LBHNC" else "v1-nhd")

        # TP=2 stores: one block per vLLM block (not one per rank), every head in it.
        k = keys(N, 1000 if layout == "LBHNC" else 2000)
        src = list(range(N))
        before = daemon.stats()["blocks"]
        out, moved2 = tp2.store(k, src)
        assert out.keys_to_store == k
        assert daemon.stats()["blocks"] - before == N
        assert daemon.stats()["reserved"] == 0  # the job's acknowledgements given back too
        page2 = LAYERS * 2 * TOKENS * (HEADS // 2) * HEAD * 2
        assert moved2 == [N * page2, N * page2]  # each rank moves its own heads only

        # TP=1 hits and reads it: its pages equal the TP=2 ranks' heads side by side.
        assert all(tp1.manager.lookup(key, None).name == "HIT" for key in k)
        dst = list(range(16, 16 + N))
        moved1, invalid = tp1.load(k, dst)
        assert invalid == [set()] and moved1 == [N * 2 * page2]
        for l in range(LAYERS):
            got, want = tp1.layers[0][l][dst], tp2.heads(l, src)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16))

        # TP=1 stores other blocks; the TP=2 ranks read their own heads of them.
        k1 = keys(N, 3000 if layout == "LBHNC" else 4000)
        tp1.store(k1, src)
        moved, invalid = tp2.load(k1, dst)
        assert invalid == [set(), set()] and moved == [N * page2, N * page2]
        for l in range(LAYERS):
            got, want = tp2.heads(l, dst), tp1.layers[0][l][src]
            assert torch.equal(got.view(torch.int16), want.view(torch.int16))
        assert daemon.stats()["pins"] == 0
    finally:
        tp1.close()
        tp2.close()


def mla_caches(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn((BLOCKS, TOKENS, LATENT), generator=g).to(torch.bfloat16) for _ in range(LAYERS)]


def test_mla_in_the_canonical_layout_is_stored_once_the_ranks_writing_in_turn(daemon, model):
    salt = os.urandom(4).hex()
    tp2 = Engine(daemon.socket, 2, model, salt, "LBHNC", mla_caches(5), mla=True)
    tp1 = Engine(daemon.socket, 1, model, salt, "LBHNC", mla_caches(6), mla=True)
    try:
        assert tp2.specs[0].namespaces[0] == tp2.specs[1].namespaces[1] == tp1.specs[0].namespaces[0]
        k, src, dst = keys(N, 6000), list(range(N)), list(range(16, 16 + N))
        before = daemon.stats()["blocks"]
        _, moved = tp2.store(k, src)
        assert daemon.stats()["blocks"] - before == N  # once, not once per rank
        # Ranks take turns block by block: rank 0 the even positions, rank 1 the odd.
        assert moved == [N // 2 * LAYERS * page_bytes(2, True)] * 2
        _, invalid = tp1.load(k, dst)
        assert invalid == [set()]
        for l in range(LAYERS):  # every block whole, whichever rank wrote it
            got, want = tp1.layers[0][l][dst], tp2.layers[0][l][src]
            assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    finally:
        tp1.close()
        tp2.close()


def test_a_block_a_rank_did_not_write_is_never_committed(daemon, model):
    salt = os.urandom(4).hex()
    tp2 = Engine(daemon.socket, 2, model, salt, "LBHNC", full_caches(3, "LBHNC"))
    try:
        k = keys(N, 5000)
        before = daemon.stats()["blocks"]
        unacked = COUNTERS["store_canonical_unacknowledged_blocks"]
        out, _ = tp2.store(k, list(range(N)), ranks={0})  # rank 1 never writes its heads
        assert out.keys_to_store == k
        assert daemon.stats()["blocks"] == before, "a block without rank 1's heads must not be committed"
        assert daemon.stats()["reserved"] == 0
        assert COUNTERS["store_canonical_unacknowledged_blocks"] - unacked == N
        assert all(tp2.manager.lookup(key, None).name == "MISS" for key in k)
        # The next store of the same blocks, by both ranks, commits them.
        tp2.store(k, list(range(N)))
        assert daemon.stats()["blocks"] == before + N
    finally:
        tp2.close()


def test_on_an_asynchronous_device_a_rank_acknowledges_only_once_its_copies_ran(daemon, model):
    # The CUDA branch, with the stand-in device of test_vllm_device_branch.py: a
    # rank's copies run after submit_store returns, so its acknowledgement must
    # wait for their event; a job completed before (which vLLM never does) is
    # aborted, not committed with heads not written yet.
    salt = os.urandom(4).hex()
    full = full_caches(7, "LBHNC")
    devices = [StandInCopies(), StandInCopies()]
    tp2 = Engine(daemon.socket, 2, model, salt, "LBHNC", full, copies=lambda r: devices[r])
    tp1 = Engine(daemon.socket, 1, model, salt, "LBHNC", full_caches(8, "LBHNC"))
    try:
        src, dst = list(range(N)), list(range(16, 16 + N))
        before = daemon.stats()["blocks"]
        for start, early in ((7000, True), (8000, False)):
            k = keys(N, start)
            out = tp2.manager.prepare_store(k, None)
            for r, w in enumerate(tp2.workers):
                w.submit_store(start, GPULoadStoreSpec(src, [N], [0]), out.store_spec)
                assert devices[r].log[-2] == ("begin",) and len(devices[r].events[-1].copies) > 0
                assert w.get_finished() == []  # the copies have not run
            if early:
                tp2.manager.complete_store(out.keys_to_store, None)
                assert daemon.stats()["blocks"] == before, "committed before the ranks' copies ran"
                for d in devices:
                    d.events[-1].complete()
                for w in tp2.workers:
                    assert [f.job_id for f in w.get_finished()] == [start]
                continue
            for d, w in zip(devices, tp2.workers):
                d.events[-1].complete()
                assert [f.job_id for f in w.get_finished()] == [start]
            tp2.manager.complete_store(out.keys_to_store, None)
            assert daemon.stats()["blocks"] == before + N
            tp1.load(k, dst)
            for l in range(LAYERS):
                got, want = tp1.layers[0][l][dst], tp2.heads(l, src)
                assert torch.equal(got.view(torch.int16), want.view(torch.int16))
        assert daemon.stats()["reserved"] == 0
    finally:
        tp1.close()
        tp2.close()


def test_a_layer_vllm_did_not_certify_refuses_the_canonical_layout(daemon, model):
    salt = os.urandom(4).hex()
    spec = build_spec(daemon.socket, 2, 0, model, salt, "LBHNC")
    layers = rank_caches(full_caches(4, "LBHNC"), 2, 0, "LBHNC")
    caches = canonical_kv_caches(layers, 2, 0)
    caches.group_data_refs[0][1].mapping = None  # as vLLM leaves a layer it cannot map
    with pytest.raises(RuntimeError, match="canonical mapping"):
        spec.get_worker(caches)
