"""Chunks stored through KacheDB are written once: LMCache's chunk memory is
the daemon's region, committed in place (issue 30).

A real LMCache engine (``engine_proc.py`` scenario ``store_in_place``, its own
process, one real daemon) stores prompts. The chunks LMCache allocates are
reservations in the daemon's shared memory (``kachedb.lmcache.region``); when
LMCache puts them, the plugin commits each under its key (COMMIT_PIN naming
the key, docs/PROTOCOL.md "COMMIT and the key") with no copy. The daemon's
blocks hold exactly the bytes a copy-path engine lays out, each pinned while
LMCache's local tier holds the chunk and released when LMCache lets it go; the
engine retrieves them byte-equal from KacheDB once its tier is emptied. A chunk
LMCache allocates and drops unstored gives its reservation back. With
``max_pinned_bytes`` of three chunks at most three are in the region at once:
the rest go to LMCache's own memory and are copied as before, and the next
prompt's store drops the previous prompt's committed chunks from LMCache's
tier to make room. Once a store is committed, the next store's full chunks
are reserved ahead (one store's worth); nothing is left pinned or reserved once
the engine is gone."""

import pytest

import lmcache_support as S
from test_lmcache_engine import assert_kachedb_serving, run_engine

pytestmark = pytest.mark.timeout(900)

#: Two prompts of 8 full chunks of 16 tokens each (and two others for the
#: bounded engine, so that none of its chunks is in the daemon already).
PROMPTS = [(128, 21), (128, 22)]
OTHER_PROMPTS = [(128, 23), (128, 24)]
CHUNKS = 8
CHUNK_BYTES = 2 * S.NUM_LAYERS * S.CHUNK_TOKENS * S.NUM_HEADS * S.HEAD_SIZE * 2  # bfloat16



def _run(daemon, workdir, name, **spec):
    r = run_engine(workdir, name, dict({"scenario": "store_in_place", "socket": daemon.socket, "prompts": PROMPTS}, **spec))
    assert_kachedb_serving(r)
    return r


@pytest.fixture(scope="module")
def unbounded(daemon, workdir):
    return _run(daemon, workdir, "in-place-default")


@pytest.fixture(scope="module")
def bounded(daemon, workdir, unbounded):
    return _run(daemon, workdir, "in-place-3-chunks", max_pinned_bytes=3 * CHUNK_BYTES, prompts=OTHER_PROMPTS)


def test_stored_chunks_are_committed_in_place_byte_equal(unbounded):
    r = unbounded
    assert r["allocator"] == "RegionAllocator"
    assert r["held_before"] == {"pins": 0, "reserved": 0}
    for i, s in enumerate(r["stores"]):
        assert s["landed"]["present"] == CHUNKS
        # every chunk LMCache holds is the daemon's memory, committed: pinned; what is
        # reserved is the next store's chunks, reserved ahead (one store's worth) by the
        # store itself: ready when engine.store returns
        assert s["local"] == {"chunks": CHUNKS * (i + 1), "in_region": CHUNKS * (i + 1)}
        assert s["pooled"] == CHUNKS
        assert s["held"] == {"pins": CHUNKS * (i + 1), "reserved": CHUNKS}
        assert s["daemon_bytes_equal"]
    st = r["stats_after_store"]
    assert st["stored_in_place"] == st["stored_chunks"] == 2 * CHUNKS
    assert st.get("store_skipped_present", 0) == 0


def test_lmcache_letting_go_releases_every_pin_and_the_chunks_stay(unbounded):
    r = unbounded
    assert r["held_after_clear"] == {"pins": 0, "reserved": r["pooled_after_clear"]}
    assert r["present_after_clear"] == 2 * CHUNKS
    for got in r["retrieves"]:
        assert got["retrieved_tokens"] == PROMPTS[0][0]
        assert got["byte_equal"]
    assert r["held_after_destroy"] == {"pins": 0, "reserved": 0}


def test_a_chunk_dropped_unstored_gives_its_reservation_back(unbounded):
    d = unbounded["dropped"]
    assert d["held_before"] == {"pins": 0, "reserved": 0}
    assert d["in_region"]
    assert d["held_while_allocated"] == {"pins": 0, "reserved": 1}
    assert d["held_after_free"] == {"pins": 0, "reserved": 0}


def test_region_chunks_stay_within_max_pinned_bytes(bounded):
    r = bounded
    first, second = r["stores"]
    for s in (first, second):
        assert s["landed"]["present"] == CHUNKS
        assert s["daemon_bytes_equal"]
        # the budget is spent: nothing reserved ahead
        assert s["local"]["in_region"] == 3 and s["pooled"] == 0 and s["held"] == {"pins": 3, "reserved": 0}
    # the first prompt's committed chunks were dropped from LMCache's tier for the second's
    assert first["local"]["chunks"] == CHUNKS
    assert second["local"]["chunks"] == 2 * CHUNKS - 3
    st = r["stats_after_store"]
    assert st["stored_in_place"] == 6
    assert st["stored_chunks"] == 2 * CHUNKS  # the other ten copied into the daemon
    for got in r["retrieves"]:
        assert got["retrieved_tokens"] == PROMPTS[0][0] and got["byte_equal"]
    assert r["held_after_clear"] == {"pins": 0, "reserved": r["pooled_after_clear"]}
    assert r["held_after_destroy"] == {"pins": 0, "reserved": 0}
