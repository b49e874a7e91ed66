"""``kachedb.lmcache.records``: an LMCache chunk's tokens and parent, remembered
where LMCache hashes them, for the KV events (the end-to-end test with a real
LMCache engine is tests/lmcache/test_lmcache_kv_events.py). A stand-in token
database here: the wrapper's contract is LMCache's ``_prefix_hash`` signature."""

import torch

from kachedb.lmcache import records


class _TokenDatabase:
    """LMCache's ``ChunkedTokenDatabase._prefix_hash`` in miniature: each
    chunk's hash chains over the one before."""

    def _prefix_hash(self, token_chunks):
        h = 0
        for chunk in token_chunks:
            h = hash((h, tuple(int(t) for t in chunk)))
            yield h


def test_chunks_hashed_are_remembered_with_their_tokens_and_parents():
    assert records.wrap_prefix_hash(_TokenDatabase)
    assert records.wrap_prefix_hash(_TokenDatabase)  # once: not wrapped twice
    tokens = torch.arange(1000, 1040)
    chunks = [tokens[i : i + 16] for i in range(0, 40, 16)]  # 16 + 16 + 8
    hashes = list(_TokenDatabase()._prefix_hash(iter(chunks)))
    assert len(hashes) == 3
    for i, h in enumerate(hashes):
        got = records.record(h)
        assert got is not None
        ids, parent = got
        assert list(ids) == chunks[i].tolist()
        assert parent == (records.event_hash(hashes[i - 1]) if i else None)
    # a chunk's own tokens are kept, not the prompt's whole tensor its slice views
    kept = records._SEEN[hashes[0]][0]
    assert kept.untyped_storage().nbytes() == 16 * tokens.element_size()
    assert records.record(12345) is None
    assert records.record([1, 2]) is None  # unhashable: never remembered, not an error


def test_only_the_newest_chunks_are_kept():
    db = _TokenDatabase()
    first = list(db._prefix_hash(iter([[7, 7, 7]])))[0]
    many = [[i, i + 1] for i in range(records.MAX_CHUNKS)]
    list(db._prefix_hash(iter(many)))
    assert records.record(first) is None


def test_event_hashes_are_unsigned_64_bit():
    assert records.event_hash(-1) == (1 << 64) - 1
    assert records.event_hash(5) == 5
    assert records.event_hash((1 << 70) + 3) == 3
    assert records.event_hash(bytes(range(32))) == int.from_bytes(bytes(range(24, 32)), "big")


def test_a_chunk_names_the_chunk_before_it_only_when_its_record_says_so():
    from types import SimpleNamespace as M

    a, b, c, d = (M(block_hash=h, parent_hash=p) for h, p in [(1, None), (2, 1), (3, 2), (9, 7)])
    # In a batch: b follows a, c follows b; d's parent is not the chunk before it.
    assert records.chain_parents(["ka", "kb", "kc", "kd"], [a, b, c, d]) == [None, "ka", "kb", None]
    # A chunk without a record neither names nor is named.
    assert records.chain_parents(["ka", "kb", "kc"], [a, None, c]) == [None, None, None]
    # The first of a batch names the stored item ahead of it: (key, _, _, record).
    assert records.chain_parents(["kb", "kc"], [b, c], before=("ka", None, None, a)) == ["ka", "kb"]
    # Else it names the parent an earlier batch stored, if its record has one.
    assert records.chain_parents(["kb", "kc"], [b, c], first_parent="ka") == ["ka", "kb"]
    assert records.chain_parents(["ka", "kb"], [a, b], first_parent="k?") == [None, "ka"]
    assert records.chain_parents(["kb"], [None], first_parent="ka") == [None]


def test_the_parent_of_a_hashed_chunk_is_its_predecessors_own_hash():
    assert records.wrap_prefix_hash(_TokenDatabase)
    chunks = [torch.arange(i, i + 16) for i in range(0, 48, 16)]
    hashes = list(_TokenDatabase()._prefix_hash(iter(chunks)))
    assert [records.parent_of(h) for h in hashes] == [None, hashes[0], hashes[1]]
    assert records.parent_of(object()) is None and records.parent_of([1]) is None


class _HandedDatabase(_TokenDatabase):
    """LMCache's ``process_tokens`` in miniature: keys from tokens (through
    ``_prefix_hash``) or from the hashes it is handed, in order."""

    def process_tokens(self, tokens=None, hashes=None, offsets=None, mask=None, make_key=True):
        if tokens is not None:
            yield from ((0, 0, h) for h in self._prefix_hash(iter([tokens])))
        else:
            yield from ((0, o, h) for h, o in zip(hashes, offsets))


def test_handed_hashes_are_chained_without_tokens():
    """Chunks keyed by hashes LMCache was handed (its multi-process adapter's
    ``process_tokens(hashes=...)``): no tokens to publish (``record`` is
    ``None``), but each hash's parent is the one handed before it
    (``link``), so ``chain_parents`` chains them."""
    assert records.wrap_process_tokens(_HandedDatabase)
    assert records.wrap_process_tokens(_HandedDatabase)  # once
    handed = [9001, 9002, 9003]
    keys = [k for _, _, k in _HandedDatabase().process_tokens(hashes=iter(handed), offsets=[16, 16, 4])]
    assert keys == handed, "the wrapper changed what LMCache yields"
    assert [records.record(h) for h in handed] == [None, None, None]
    links = [records.link(h) for h in handed]
    assert [(x.block_hash, x.parent_hash) for x in links] == [(9001, None), (9002, 9001), (9003, 9002)]
    assert records.chain_parents(["k1", "k2", "k3"], links) == [None, "k1", "k2"]
    assert records.link(424242) is None
    # A hash hashed from tokens earlier keeps its tokens when it is handed again.
    assert records.wrap_prefix_hash(_TokenDatabase)
    (h,) = [k for _, _, k in _HandedDatabase().process_tokens(tokens=torch.arange(5, 21))]
    list(_HandedDatabase().process_tokens(hashes=[h], offsets=[16]))
    assert records.record(h) is not None and list(records.record(h)[0]) == list(range(5, 21))
