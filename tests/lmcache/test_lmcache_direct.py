"""The KacheDB connector's gets and in-place stores run on the engine's thread
(issue 30): LMCache's remote backend would run them as coroutines on its event
loop and hand the results back across threads, two wake-ups of a parked thread
per call (``kachedb.lmcache.direct``).

A real LMCache engine (``engine_proc.py`` scenario ``direct``, its own process,
one real daemon) stores a prompt and retrieves it with its local tier emptied,
the connector's calls recording their thread: with the chunks in the daemon's
region, the store (one COMMIT batch) and the get run on the thread that called
LMCache, and the prompt is in the daemon when ``engine.store`` returns; with
``max_pinned_bytes`` 0 (chunks in LMCache's own memory, copied by the put) the
store stays on LMCache's event loop, as LMCache runs remote puts, and the get
still runs on the caller's thread. Both retrieve byte-equal."""

import pytest

from test_lmcache_engine import assert_kachedb_serving, run_engine

pytestmark = pytest.mark.timeout(600)

PROMPT = (128, 31)
CHUNKS = 8



def _run(daemon, workdir, name, prompt, **spec):
    r = run_engine(workdir, name, dict({"scenario": "direct", "socket": daemon.socket, "prompt": prompt}, **spec))
    assert_kachedb_serving(r)
    assert r["chunks"] == CHUNKS and r["landed"]["present"] == CHUNKS
    assert r["retrieved_tokens"] == prompt[0] and r["byte_equal"]
    return r


def test_in_place_stores_and_gets_run_on_the_engines_thread(daemon, workdir):
    r = _run(daemon, workdir, "direct-in-place", PROMPT)
    assert r["stats"]["stored_in_place"] == CHUNKS
    assert r["calls"] == [["_store", "caller"], ["_load_prefix", "caller"]]
    assert r["present_when_store_returned"] == CHUNKS


def test_stores_that_copy_stay_on_lmcaches_event_loop(daemon, workdir):
    r = _run(daemon, workdir, "direct-copies", (128, 32), max_pinned_bytes=0)
    assert r["stats"].get("stored_in_place", 0) == 0
    assert r["calls"] == [["_store", "other"], ["_load_prefix", "caller"]]
