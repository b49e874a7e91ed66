"""Chunks got from KacheDB are views of shared memory, not copies (issue 30).

A real LMCache engine (``engine_proc.py`` scenario ``views``, its own process,
one real daemon) stores prompts, empties its local CPU tier and retrieves them
from KacheDB. The chunks LMCache then holds (it writes them back into its local
tier) are memory of the daemon's region, each block pinned while LMCache holds
it and released when LMCache lets it go; the retrieved KV is byte-equal, from
KacheDB and then again from LMCache's local tier. With ``max_pinned_bytes`` of
three chunks, LMCache never holds more than three pinned chunks: the rest are
copied into its own memory, and the oldest view chunks are dropped from its
local tier to make room for the next retrieve's; with 0, every chunk is copied
(the path of engines whose KV cache is on a GPU)."""

import pytest

import lmcache_support as S
from test_lmcache_engine import assert_kachedb_serving, run_engine

pytestmark = pytest.mark.timeout(900)

#: Two prompts of 8 full chunks of 16 tokens each.
PROMPTS = [(128, 11), (128, 12)]
CHUNKS = 8
CHUNK_BYTES = 2 * S.NUM_LAYERS * S.CHUNK_TOKENS * S.NUM_HEADS * S.HEAD_SIZE * 2  # bfloat16



def _run(daemon, workdir, name, **spec):
    r = run_engine(workdir, name, dict({"scenario": "views", "socket": daemon.socket, "prompts": PROMPTS}, **spec))
    assert_kachedb_serving(r)
    return r


@pytest.fixture(scope="module")
def unbounded(daemon, workdir):
    return _run(daemon, workdir, "views-default")


@pytest.fixture(scope="module")
def bounded(daemon, workdir, unbounded):
    return _run(daemon, workdir, "views-3-chunks", max_pinned_bytes=3 * CHUNK_BYTES)


def test_retrieved_chunks_are_views_pinned_while_lmcache_holds_them(unbounded):
    assert unbounded["pins_before"] == 0
    for r in unbounded["retrieves"]:
        assert r["retrieved_tokens"] == PROMPTS[0][0]
        assert r["byte_equal"]
        # every chunk LMCache holds is the daemon's memory: no copy was made
        assert r["local"] == {"chunks": CHUNKS * (1 + unbounded["retrieves"].index(r)), "in_region": r["local"]["chunks"]}
        assert r["pins_held"] == r["local"]["in_region"]
        # a later hit in LMCache's local tier reads the view's bytes
        assert r["local_lookup"] == PROMPTS[0][0]
        assert r["local_hit_byte_equal"]
    assert unbounded["stats"]["loaded_views"] == 2 * CHUNKS
    assert unbounded["stats"].get("loaded_copies_over_budget", 0) == 0
    # LMCache let them go: so did the daemon
    assert unbounded["local_after_clear"] == {"chunks": 0, "in_region": 0}
    assert unbounded["pins_after_clear"] == 0


def test_pinned_chunks_stay_within_max_pinned_bytes(bounded):
    first, second = bounded["retrieves"]
    for r in (first, second):
        assert r["retrieved_tokens"] == PROMPTS[0][0]
        assert r["byte_equal"] and r["local_hit_byte_equal"]
        assert r["local"]["in_region"] == 3  # three views; the rest copied into LMCache's memory
        assert r["pins_held"] == 3
    # the first prompt's views were dropped from LMCache's local tier for the second's
    assert first["local"]["chunks"] == CHUNKS
    assert second["local"]["chunks"] == 2 * CHUNKS - 3
    assert bounded["stats"]["loaded_views"] == 6
    assert bounded["stats"]["loaded_copies_over_budget"] == 2 * (CHUNKS - 3)
    assert bounded["pins_after_clear"] == 0


def test_max_pinned_bytes_zero_copies_every_chunk(daemon, workdir, bounded):
    r = _run(daemon, workdir, "views-0", max_pinned_bytes=0)
    for got in r["retrieves"]:
        assert got["retrieved_tokens"] == PROMPTS[0][0]
        assert got["byte_equal"] and got["local_hit_byte_equal"]
        assert got["local"]["in_region"] == 0 and got["pins_held"] == 0
    assert r["stats"].get("loaded_views", 0) == 0
    assert r["stats"]["loaded_chunks"] == 2 * CHUNKS
