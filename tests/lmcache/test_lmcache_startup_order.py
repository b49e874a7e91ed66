"""The namespace follows the chunk layout LMCache settles on (issue 25, item 4).

vLLM's LMCache connector builds the engine's metadata from the model config
(one KV group, the first layer's head size), post-initialises the engine when
vLLM registers its KV caches (LMCache then builds its remote backends: the
KacheDB connector), and LMCache's GPU connector registers the KV caches' real
layer groups on the metadata at its first transfer. The connector used to fix
its namespace and chunk sizes at construction, from the model-config guess;
now every operation takes them from the metadata as it is, so chunks are stored
and found under the layout they are in. Each engine runs in its own process
(``engine_proc.py`` scenario ``vllm_order``), on one real daemon; the model has
two layer groups (head sizes 16 and 32), which the model-config guess misses."""

import pytest

import lmcache_support as S
from test_lmcache_engine import run_engine

pytestmark = pytest.mark.timeout(900)
PROMPT = (96, 5)  # 6 chunks of 16


@pytest.fixture(scope="module")
def runs(workdir):
    d = S.Daemon(size="64MiB").start()
    try:
        base = {"scenario": "vllm_order", "socket": d.socket, "prompt": PROMPT}
        store = run_engine(workdir, "order-store", dict(base, role="store"))
        load = run_engine(workdir, "order-load", dict(base, role="load"))
        # An engine whose real layout is the model-config guess (one group of 4 layers)
        plain = run_engine(workdir, "order-plain", {"scenario": "lookup", "socket": d.socket, "prompt": PROMPT})
        yield store, load, plain, d.stats()
    finally:
        assert d.stop() == 0


def test_namespace_is_computed_from_the_registered_layer_groups(runs):
    store = runs[0]
    guess = [[2, S.NUM_LAYERS, S.CHUNK_TOKENS, S.NUM_HEADS * S.HEAD_SIZE]]
    final = [[2, 2, S.CHUNK_TOKENS, S.NUM_HEADS * hs] for hs in S.GROUP_HEAD_SIZES]
    assert store["fields_at_post_init"]["shapes"] == guess
    assert store["metadata_shapes"] == final
    assert store["fields"]["shapes"] == final
    assert store["landed"]["present"] == store["landed"]["expected"] == PROMPT[0] // S.CHUNK_TOKENS


def test_same_startup_order_finds_and_retrieves_byte_equal(runs):
    load = runs[1]
    assert load["remote_lookup"] == PROMPT[0]
    assert load["retrieved_tokens"] == PROMPT[0]
    assert load["byte_equal"]


def test_engine_laid_out_as_the_guess_finds_nothing(runs):
    # Same model name, dtype and chunk keys; another byte layout.
    plain = runs[2]
    assert plain["connector"].startswith("<KacheDBConnector kachedb")
    assert plain["remote_lookup"] == 0
    st = runs[3]
    assert st["pins"] == 0 and st["reserved"] == 0
