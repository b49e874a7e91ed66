"""kachedb.vllm's configuration and key namespace (no engine: seconds)."""

import json
import os
import subprocess
import sys

import pytest

import kachedb
import kachedb.vllm
from kachedb.vllm import keys


def test_kv_transfer_config_is_accepted_by_vllm(tmp_path):
    from vllm.config import KVTransferConfig

    cfg = kachedb.vllm.kv_transfer_config(str(tmp_path / "d.sock"), namespace="tenant-a")
    ktc = KVTransferConfig(**cfg)
    assert ktc.kv_connector == "KacheDBConnector"
    assert ktc.kv_connector_module_path == "kachedb.vllm.connector"
    assert ktc.kv_load_failure_policy == "recompute"
    extra = ktc.kv_connector_extra_config
    assert extra["spec_name"] == "KacheDBOffloadingSpec" and extra["spec_module_path"] == "kachedb.vllm.spec"
    assert extra["socket"] == str(tmp_path / "d.sock") and extra["namespace"] == "tenant-a"
    # the classes it names import and are what vLLM expects
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
    from vllm.v1.kv_offload.base import OffloadingSpec

    from kachedb.vllm.connector import KacheDBConnector
    from kachedb.vllm.spec import KacheDBOffloadingSpec

    assert issubclass(KacheDBConnector, OffloadingConnector) and issubclass(KacheDBOffloadingSpec, OffloadingSpec)


@pytest.mark.parametrize("value, parsed", [
    (None, "auto"), ("auto", "auto"), (" Auto ", "auto"), (True, True), ("on", True), (1, True),
    (False, False), ("no", False), (0, False),
])
def test_store_thread_option(value, parsed):
    from kachedb.vllm.config import parse_store_thread

    assert parse_store_thread(value) == parsed


def test_a_bad_store_thread_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="store_thread must be 'auto', true or false"):
        kachedb.vllm.kv_transfer_config(str(tmp_path / "x.sock"), store_thread="sometimes")
    with pytest.raises(ValueError, match="store_thread"):
        kachedb.vllm.kv_transfer_config(str(tmp_path / "x.sock"), store_thread=2)


def test_socket_defaults_like_connect(monkeypatch):
    monkeypatch.setenv("KACHEDB_SOCKET", "/tmp/somewhere/k.sock")
    assert kachedb.vllm.kv_transfer_config()["kv_connector_extra_config"]["socket"] == "/tmp/somewhere/k.sock"
    monkeypatch.delenv("KACHEDB_SOCKET")
    assert kachedb.vllm.kv_transfer_config()["kv_connector_extra_config"]["socket"] == kachedb.default_socket_path()


def test_cli_prints_the_same_json(tmp_path):
    sock = str(tmp_path / "x.sock")
    out = subprocess.run([sys.executable, "-m", "kachedb", "vllm-config", "--socket", sock],
                         check=True, capture_output=True, text=True).stdout
    assert json.loads(out) == kachedb.vllm.kv_transfer_config(sock)
    env = dict(os.environ, KACHEDB_SOCKET=sock)
    out = subprocess.run([sys.executable, "-m", "kachedb", "vllm-config"], check=True, capture_output=True, text=True,
                         env=env).stdout
    assert json.loads(out)["kv_connector_extra_config"]["socket"] == sock


def test_cli_canonical_layout_option(tmp_path):
    sock = str(tmp_path / "x.sock")
    out = subprocess.run([sys.executable, "-m", "kachedb", "vllm-config", "--socket", sock, "--canonical-layout"],
                         check=True, capture_output=True, text=True).stdout
    assert json.loads(out) == kachedb.vllm.kv_transfer_config(sock, canonical_layout=True)
    assert json.loads(out)["kv_connector_extra_config"]["canonical_layout"] is True


BASE = dict(model="/m", hf_config={"hidden_size": 8}, dtype="float16", kv_cache_dtype="float16", tokens_per_block=[32],
            bytes_per_block=4096, num_layers=2, tp_rank=0, tp_size=1, kv_layout="LBHNC", hash_algo="sha256")


@pytest.mark.parametrize("change", [
    {"model": "/other"}, {"hf_config": {"hidden_size": 8, "rope_theta": 1.0}}, {"config_file_sha256": "ab"},
    {"dtype": "bfloat16"}, {"kv_cache_dtype": "fp8"}, {"tokens_per_block": [64]}, {"bytes_per_block": 8192},
    {"tp_rank": 1}, {"tp_size": 2}, {"kv_layout": "BLHNC"}, {"hash_algo": "sha256_cbor"}, {"salt": "x"},
    {"num_layers": 3}, {"load_format": "dummy", "seed": 0}, {"kv_tp_replicas": 2}, {"quantization": "fp8"},
])
def test_every_field_changes_the_namespace(change):
    a = keys.namespace_digest(keys.namespace_fields(**BASE))
    b = keys.namespace_digest(keys.namespace_fields(**dict(BASE, **change)))
    assert a != b and len(a) == 16
    assert keys.namespace_digest(keys.namespace_fields(**BASE)) == a  # stable
    assert keys.block_key(a, b"h" * 36) != keys.block_key(b, b"h" * 36)


def test_the_canonical_layout_names_no_rank_or_degree():
    canon = dict(BASE, canonical="v1-hnd")
    one = keys.namespace_digest(keys.namespace_fields(**dict(canon, tp_rank=0, tp_size=1)))
    assert one == keys.namespace_digest(keys.namespace_fields(**dict(canon, tp_rank=1, tp_size=2, world_size=2)))
    assert one == keys.namespace_digest(keys.namespace_fields(**dict(canon, tp_rank=3, tp_size=4, world_size=4)))
    # ... but another canonical format, or the per-rank layout, is another namespace
    assert one != keys.namespace_digest(keys.namespace_fields(**dict(canon, canonical="v1-nhd")))
    assert one != keys.namespace_digest(keys.namespace_fields(**BASE))
    # each degree's group layout, made canonical, is one layout
    spec = {"type": "FullAttentionSpec", "num_kv_heads": 1, "head_size": 64, "page_size_padded": None}
    tp2 = keys.canonical_group_layout({"group_id": 0, "layers": ["a"], "spec": spec}, 2, [32768])
    tp1 = keys.canonical_group_layout({"group_id": 0, "layers": ["a"], "spec": dict(spec, num_kv_heads=2)}, 2, [32768])
    assert tp1 == tp2 and tp1["page_size_bytes"] == 32768


def test_ranks_holding_the_same_kv_share_a_namespace():
    # MLA: kv_tp_replicas == tp_size, so every rank is one shard
    mla = dict(BASE, tp_size=2, kv_tp_replicas=2)
    assert keys.namespace_digest(keys.namespace_fields(**dict(mla, tp_rank=0))) == \
        keys.namespace_digest(keys.namespace_fields(**dict(mla, tp_rank=1)))
    # ... but not with a head-split engine's, nor with TP=1's
    split = dict(BASE, tp_size=2)
    assert keys.namespace_digest(keys.namespace_fields(**dict(mla, tp_rank=0))) != \
        keys.namespace_digest(keys.namespace_fields(**dict(split, tp_rank=0)))
    assert keys.namespace_digest(keys.namespace_fields(**dict(split, tp_rank=0))) != \
        keys.namespace_digest(keys.namespace_fields(**dict(split, tp_rank=1)))


def test_kv_tp_replicas_only_for_a_tp_only_world():
    from types import SimpleNamespace as NS

    from kachedb.vllm.spec import kv_tp_replicas

    vc = NS(parallel_config=NS(decode_context_parallel_size=1, prefill_context_parallel_size=1),
            model_config=NS(use_mla=True))
    assert kv_tp_replicas(vc, NS(kv_tp_replicas=4), 4, 1, 4) == 4
    assert kv_tp_replicas(vc, NS(kv_tp_replicas=2), 4, 1, 4) == 2
    assert kv_tp_replicas(vc, None, 4, 1, 4) == 4  # no KV-cache config: MLA is replicated
    assert kv_tp_replicas(vc, NS(kv_tp_replicas=4), 4, 2, 8) == 1  # pipeline parallel: per rank
    assert kv_tp_replicas(vc, NS(kv_tp_replicas=3), 4, 1, 4) == 1  # not a divisor: per rank
    assert kv_tp_replicas(vc, NS(kv_tp_replicas=4), 1, 1, 1) == 1
    dcp = NS(parallel_config=NS(decode_context_parallel_size=2, prefill_context_parallel_size=1),
             model_config=NS(use_mla=True))
    assert kv_tp_replicas(dcp, NS(kv_tp_replicas=2), 4, 1, 4) == 1


# -- each KV-cache group's layout -----------------------------------------------

def _mamba(state_dtype, **kw):
    """A Mamba2 group's spec as vLLM declares it, its page padded to an attention
    page of 1 MiB (so two state dtypes of one size give equal page sizes)."""
    import torch
    from vllm.v1.kv_cache_interface import MambaSpec

    args = dict(block_size=32, shapes=((3, 512), (8, 64, 32)), dtypes=(torch.bfloat16, state_dtype),
                page_size_padded=1 << 20)
    args.update(kw)
    return MambaSpec(**args)


def _attention(**kw):
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    args = dict(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    args.update(kw)
    return FullAttentionSpec(**args)


def _hybrid_fields(state_spec, attention_spec=None):
    groups = [keys.group_layout(0, ["model.layers.0.mixer"], state_spec),
              keys.group_layout(1, ["model.layers.1.mixer"], attention_spec or _attention())]
    return keys.namespace_fields(**dict(BASE, group_layouts=groups))


def test_hybrid_state_dtypes_of_one_size_get_different_namespaces():
    """The review's case: two Nemotron-H engines differing only in
    mamba_ssm_cache_dtype (float16 vs bfloat16, both padded to the attention
    page) had equal tokens and bytes per block, hence one namespace."""
    import torch

    f16, bf16 = _mamba(torch.float16), _mamba(torch.bfloat16)
    assert f16.page_size_bytes == bf16.page_size_bytes  # what the old namespace saw: equal
    a, b = keys.namespace_digest(_hybrid_fields(f16)), keys.namespace_digest(_hybrid_fields(bf16))
    assert a != b
    assert keys.namespace_digest(_hybrid_fields(_mamba(torch.float16))) == a  # equal specs: one namespace


@pytest.mark.parametrize("change", [
    {"shapes": ((3, 512), (8, 64, 16))}, {"mamba_cache_mode": "align"}, {"page_size_padded": 2 << 20},
    {"block_size": 96}, {"num_speculative_blocks": 1},
])
def test_every_state_spec_field_changes_the_namespace(change):
    import torch

    base = keys.namespace_digest(_hybrid_fields(_mamba(torch.float32)))
    assert keys.namespace_digest(_hybrid_fields(_mamba(torch.float32, **change))) != base


def test_window_kind_and_unpadded_page_change_the_namespace():
    import torch
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    def window(w, **kw):
        return SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=w,
                                 **kw)

    state = _mamba(torch.float32)
    full = keys.namespace_digest(_hybrid_fields(state, _attention()))
    w512 = keys.namespace_digest(_hybrid_fields(state, window(512)))
    w1024 = keys.namespace_digest(_hybrid_fields(state, window(1024)))
    assert len({full, w512, w1024}) == 3
    # the same padded page, another unpadded one (head size): another namespace
    padded = keys.group_layout(1, ["l"], _attention(page_size_padded=1 << 20))
    other = keys.group_layout(1, ["l"], _attention(head_size=32, page_size_padded=1 << 20))
    assert padded["page_size_bytes"] == other["page_size_bytes"] and padded != other
    assert padded["real_page_size_bytes"] != other["real_page_size_bytes"]
    # which layers a group holds is part of it
    assert keys.group_layout(1, ["a"], _attention()) != keys.group_layout(1, ["b"], _attention())


def test_a_group_layout_is_equal_in_every_process():
    """No address, no per-process repr: two processes computing one spec's
    layout get the same namespace (else engines would silently never share)."""
    code = ("import torch, json; from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec;"
            "from kachedb.vllm import keys;"
            "g=[keys.group_layout(0,['m'],MambaSpec(block_size=32,shapes=((3,512),(8,64,32)),"
            "dtypes=(torch.bfloat16,torch.float16),page_size_padded=1<<20)),"
            "keys.group_layout(1,['a'],SlidingWindowSpec(block_size=32,num_kv_heads=2,head_size=64,"
            "dtype=torch.bfloat16,sliding_window=512))];"
            "print(json.dumps(g,sort_keys=True))")
    outs = {subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
            for _ in range(2)}
    assert len(outs) == 1, outs
    text = outs.pop()
    assert " at 0x" not in text and "MambaSpec" in text and "float16" in text


def test_plain_never_lets_an_address_in():
    class Opaque:
        pass

    assert keys.plain(Opaque()) == "Opaque"
    assert keys.plain({"b": (1, 2), "a": {3}}) == {"a": [3], "b": [1, 2]}


def test_a_spec_without_a_kv_cache_config_refuses_to_start():
    from types import SimpleNamespace as NS

    from kachedb.vllm.spec import group_layouts

    with pytest.raises(RuntimeError, match="no KV-cache config"):
        group_layouts(None, [NS(group_id=0, layer_names=("l",))])
    with pytest.raises(RuntimeError, match="not in vLLM's KV-cache config"):
        group_layouts(NS(kv_cache_groups=[]), [NS(group_id=0, layer_names=("l",))])
