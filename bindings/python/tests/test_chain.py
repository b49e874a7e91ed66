"""Chain-aware eviction against the real daemon (docs/eviction.md): blocks
name their parent (``put(parent=)``, ``put_many``/``reserve_many(chain=True)``),
and under memory pressure the daemon's default policy evicts leaves first, so a
chain's head survives where plain LRU (``--eviction lru``) evicts it and leaves
the tail cached but unreachable."""

import numpy as np
import pytest
import torch

import kachedb

BLOCK = 64 << 10  # bytes; a whole number of pages at page offset 0 (reserve)
CHAIN = [f"chain-{i}" for i in range(8)]


def put_block(kc, key, seed, parent=None):
    with kc.reserve(key, (BLOCK,), torch.uint8, parent=parent) as out:
        out.fill_(seed % 251)


def fill_until_evicted(d, kc, n_evictions):
    """Unrelated blocks (no parent), one at a time, until the daemon has evicted
    ``n_evictions`` blocks; returns how many were stored."""
    i = 0
    while d.stats()["evictions"] < n_evictions:
        put_block(kc, f"filler-{i}", i)
        i += 1
        assert i < 10_000, "the daemon never evicted"
    return i


@pytest.mark.parametrize("policy", ["chain", "lru"])
def test_chain_head_survives_pressure_only_under_chain_eviction(make_daemon, policy):
    d = make_daemon("4MiB", "--eviction", policy)
    with d.connect() as kc:
        with kc.reserve_many(CHAIN, (BLOCK,), torch.uint8, chain=True) as outs:
            for i, out in enumerate(outs):
                out.fill_(i)
        outs = out = None  # a reservation's tensors keep their blocks pinned while they live
        st = d.stats()
        assert (st["eviction_policy"], st["chained_blocks"], st["parents_missing"]) == (policy, 7, 0)
        fill_until_evicted(d, kc, 3)
        st = d.stats()
        assert st["invariants_ok"] and st["invariants_full"]
        # Which chain blocks are left, read without touching them first (GET
        # pins; whatever LOOKUP order follows no longer matters).
        views = kc.get_many(CHAIN)
        present = [v is not None for v in views]
        for i, v in enumerate(views):
            if v is not None:
                assert bool((v == i).all()), f"block {i} has the wrong bytes"
        del views
        served = kc.lookup(CHAIN)
        if policy == "chain":
            # Tail first: the head stays, what is left is a prefix, all of it served.
            assert present[0]
            assert present == sorted(present, reverse=True)
            assert served == sum(present) >= 5
            assert st["links_cut_by_eviction"] == 0
        else:
            # The head was the least recently used block: gone first, and with it
            # every later block of the chain became unreachable.
            assert not present[0]
            assert any(present[1:]), "LRU evicted the whole chain; the test needs a live tail"
            assert served == 0
            assert st["links_cut_by_eviction"] >= 1


def test_shared_prefix_head_outlives_conversations(make_daemon):
    # A system prompt of 2 blocks touched once, then conversations branching off it.
    d = make_daemon("4MiB")
    with d.connect() as kc:
        system = ["sys-0", "sys-1"]
        kc.put_many(system, [np.full(BLOCK, 7, dtype=np.uint8)] * 2, chain=True)
        for conv in range(40):
            keys = [f"conv-{conv}-{t}" for t in range(3)]
            kc.put_many(keys, [np.full(BLOCK, conv % 251, dtype=np.uint8)] * 3, parent=system[-1], chain=True)
            # The engine looks up this conversation's whole chain before each turn.
            assert kc.lookup(system + keys) == 5
        st = d.stats()
        assert st["evictions"] > 0 and st["links_cut_by_eviction"] == 0
        assert kc.lookup(system) == 2


def test_parent_rules_through_the_python_api(make_daemon):
    d = make_daemon("8MiB")
    with d.connect() as kc:
        kc.put("a", b"x" * 100)
        kc.put("b", b"y" * 100, parent="a")
        kc.put("c", np.zeros(10, dtype=np.float32), parent="absent")  # not stored: dropped
        kc.put("a2", b"z", parent="a2")  # its own key: dropped
        with kc.reserve("r", (4,), torch.float16, parent="b") as out:
            out.zero_()
        kc.put_many(["m0", "m1"], [b"0", b"1"], parent="a")  # siblings under a
        st = d.stats()
        assert (st["chained_blocks"], st["parents_missing"]) == (4, 2)
        # Deleting a middle block keeps its children, without a parent.
        assert kc.delete("b")
        st = d.stats()
        assert (st["chained_blocks"], st["links_cut"]) == (2, 1)
        assert kc.lookup(["b", "r"]) == 0 and "r" in kc
        # Re-putting a parent cuts its children's links; the new block links anew.
        kc.put("a", b"x" * 100, parent="r")
        st = d.stats()
        assert (st["chained_blocks"], st["links_cut"], st["replaced"]) == (1, 3, 1)
        assert st["invariants_ok"] and st["invariants_full"]
        # A chain of reserve_many whose first block names a parent.
        with kc.reserve_many(["t0", "t1", "t2"], (8,), "u8", parent="a", chain=True) as outs:
            for o in outs:
                o.zero_()
        assert d.stats()["chained_blocks"] == 4
        with pytest.raises(TypeError):
            kc.put("bad", b"v", parent=1.5)


def test_reserve_many_parents_name_each_blocks_own_parent(make_daemon):
    """``reserve_many(parents=...)``: each block names its own parent (a branch:
    two children of one block, one block without), linked at the batch's COMMITs
    in order; a parent committed in an earlier batch links too."""
    d = make_daemon("4MiB")
    with d.connect() as kc:
        with kc.reserve_many(["root", "left", "right", "alone"], (BLOCK,), torch.uint8,
                             parents=[None, "root", "root", None]) as outs:
            for i, out in enumerate(outs):
                out.fill_(i)
        outs = out = None
        st = d.stats()
        assert (st["chained_blocks"], st["parents_missing"]) == (2, 0), st
        with kc.reserve_many(["next"], (BLOCK,), torch.uint8, parents=["left"]) as outs:
            outs[0].fill_(9)
        outs = None
        st = d.stats()
        assert (st["chained_blocks"], st["parents_missing"]) == (3, 0), st
        with pytest.raises(kachedb.InvalidArgument):
            kc.reserve_many(["x", "y"], (BLOCK,), torch.uint8, parents=[None])
        with pytest.raises(kachedb.InvalidArgument):
            kc.reserve_many(["x"], (BLOCK,), torch.uint8, parents=[None], chain=True)
        assert d.stats()["reserved"] == 0
