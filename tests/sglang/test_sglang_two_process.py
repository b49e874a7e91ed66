"""KacheDB as SGLang's HiCache L3 storage across processes: process 1 stores
pages of its real host pool with ``batch_set_v1``; process 2 (fresh pools)
counts them with ``batch_exists`` and loads them with ``batch_get_v1`` into
other slots, byte-equal; both host-pool layouts; the real daemon binary."""

import pytest

from engine_support import Daemon
from sglang_support import run_pools

LAYOUTS = ["page_first", "layer_first"]
PAGES = 8

pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def runs(workdir):
    d = Daemon(str(workdir / "two-process.sock")).start()
    try:
        spec = {"socket": d.socket, "pages": PAGES, "layouts": LAYOUTS, "expected": str(workdir / "expected.pt")}
        before = d.stats()
        w = run_pools(workdir, "writer", dict(spec, role="write"))
        after_write = d.stats()
        r = run_pools(workdir, "reader", dict(spec, role="read"))
        after_read = d.stats()
        yield w, r, before, after_write, after_read
    finally:
        d.stop()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_writer_stores_every_page_once(runs, layout):
    w, _, before, after_write, _ = runs
    lw = w["layouts"][layout]
    assert lw["set_v1"] == [True] * PAGES
    assert lw["set_v1_again"] == [True] * PAGES
    assert lw["set_generic"] is True
    # the second batch_set_v1 found them all and stored nothing
    assert lw["stats"]["set_pages_stored"] == PAGES and lw["stats"]["set_pages_present"] == PAGES
    assert lw["stats"]["errors"] == 0 and not lw["stats"]["tier_off"]
    assert all(len(k) == 64 and int(k, 16) >= 0 for k in lw["keys"])  # SGLang's 64-hex page hashes
    # v1 and generic pages of both layouts: 4 * PAGES blocks in the daemon
    assert after_write["blocks"] - before["blocks"] == 2 * len(LAYOUTS) * PAGES
    assert w["tracebacks"] == 0, w["log"][-3000:]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_reader_counts_and_loads_byte_equal_into_other_slots(runs, layout):
    w, r, _, _, _ = runs
    lr = r["layouts"][layout]
    assert set(lr["host_indices"]).isdisjoint(w["layouts"][layout]["host_indices"])
    assert lr["zero_before"]
    assert lr["exists_all"] == PAGES
    assert lr["exists_with_tail"] == PAGES
    assert lr["exists_gap"] == 3  # a leading-prefix count
    assert lr["exists_one"] is True and lr["exists_unknown"] is False
    assert lr["get_v1"] == [True] * PAGES
    assert lr["equal"] == [True] * PAGES
    assert lr["pins_after_get"] == 0  # the views were dropped once copied


@pytest.mark.parametrize("layout", LAYOUTS)
def test_partial_prefix_loads_the_leading_pages_only(runs, layout):
    lr = runs[1]["layouts"][layout]
    assert lr["get_v1_gap"] == [True, True] + [False] * (PAGES - 2)
    assert lr["gap_equal_leading"] == [True, True]
    assert lr["gap_rest_untouched"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_other_namespaces_get_no_hits(runs, layout):
    lr = runs[1]["layouts"][layout]
    assert lr["exists_other_model"] == 0
    assert lr["exists_other_tp_rank"] == 0
    assert lr["exists_other_salt"] == 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_generic_interface_across_processes(runs, layout):
    lr = runs[1]["layouts"][layout]
    assert lr["generic_exists"] == PAGES
    assert lr["generic_equal"] == [True] * PAGES
    assert lr["generic_get_private"]
    assert lr["pins_after_generic"] == 0


def test_daemon_served_the_loads_and_no_pins_are_left(runs):
    _, r, _, after_write, after_read = runs
    assert r["tracebacks"] == 0, r["log"][-3000:]
    # the reader's hits came from the daemon: pages pinned by get_prefix / get_many
    loaded = len(LAYOUTS) * (PAGES + 2 + PAGES + 1)  # v1 all + v1 gap prefix + generic all + generic get
    assert after_read["get_hits"] - after_write["get_hits"] >= loaded
    assert after_read["pins"] == 0
    assert after_read["reserved"] == 0
    assert after_read["invariants_ok"]
