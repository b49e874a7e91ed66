"""The tokens and parent of an LMCache chunk, for the daemon's KV events.

A router matches a request against the blocks a node holds by their tokens
(docs/events.md, "Block metadata"). LMCache's storage interface hands a remote
connector a chunk's ``CacheEngineKey`` and its bytes, not its tokens; the tokens
are known where LMCache hashes them: its token database's ``_prefix_hash``,
which turns a prompt's token chunks into the chunks' prefix hashes, in order
(every store, lookup and retrieve of tokens goes through it).

``watch()`` puts a wrapper in front of that method, once per process, which
remembers each chunk's tokens and its parent's hash under the chunk's hash, the
last ``MAX_CHUNKS`` of them. The connector looks a stored chunk up by its
``CacheEngineKey.chunk_hash`` (``record``) and attaches what it finds to the
block before its commit; a chunk not found (an LMCache without that method, a
chunk hashed more than ``MAX_CHUNKS`` chunks ago) is published by key.

Chunks keyed by hashes LMCache was handed (``process_tokens(hashes=...)``: its
multi-process adapter passes the hashes vLLM computed, no tokens) have no
tokens to publish, but their order says their parents: ``watch()`` wraps
``process_tokens`` too and remembers each handed hash's parent (the hash before
it) without tokens. Such a chunk is published by key, and chained to the chunk
before it in the daemon all the same (``link``, ``chain_parents``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Iterable, Iterator, List, Optional, Sequence, Tuple

#: Chunks remembered (newest kept). A store follows its hashing by the time one
#: request's chunks are copied; 4096 chunks of 256 tokens keep 8 MiB of token
#: ids alive at most.
MAX_CHUNKS = 4096

_U64 = (1 << 64) - 1

_LOCK = threading.Lock()
#: chunk hash -> (the chunk's tokens or ``None`` (handed hashes), its parent's
#: hash or ``None``)
_SEEN: "OrderedDict[Any, Tuple[Any, Optional[Any]]]" = OrderedDict()

#: ``ChunkedTokenDatabase`` attribute naming LMCache's own method.
_ORIGINAL = "_kachedb_original_prefix_hash"


def event_hash(chunk_hash: Any) -> int:
    """A chunk hash as the KV events carry it, an unsigned 64-bit int: an int
    (Python's ``hash``, possibly negative) modulo 2**64; bytes (vLLM's hash
    functions) as vLLM publishes its own, the last 8 bytes big-endian."""
    if isinstance(chunk_hash, (bytes, bytearray, memoryview)):
        return int.from_bytes(bytes(chunk_hash)[-8:], "big")
    return int(chunk_hash) & _U64


def _remember(chunk_hash: Any, tokens: Any, parent: Optional[Any]) -> None:
    # A copy of the chunk's own tokens: a slice would keep the whole prompt's
    # tensor alive for as long as the chunk is remembered.
    if tokens is not None:
        tokens = tokens.clone() if hasattr(tokens, "clone") else tuple(tokens)
    with _LOCK:
        known = _SEEN.get(chunk_hash)
        if tokens is None and known is not None and known[0] is not None and known[1] == parent:
            tokens = known[0]  # handed again after its tokens were hashed: keep them
        _SEEN[chunk_hash] = (tokens, parent)
        _SEEN.move_to_end(chunk_hash)
        while len(_SEEN) > MAX_CHUNKS:
            _SEEN.popitem(last=False)


def parent_of(chunk_hash: Any) -> Optional[Any]:
    """The hash LMCache gave the chunk before this one in its prompt (as
    LMCache keys it: ``CacheEngineKey.chunk_hash``), or ``None`` (a prompt's
    first chunk, or a chunk this process has not hashed)."""
    try:
        with _LOCK:
            got = _SEEN.get(chunk_hash)
    except TypeError:  # an unhashable hash value: never remembered
        return None
    return None if got is None else got[1]


def record(chunk_hash: Any) -> Optional[Tuple[Tuple[int, ...], Optional[int]]]:
    """The chunk's token ids and its parent's event hash (``None`` for a
    prompt's first chunk), or ``None`` if this process has not hashed it."""
    try:
        with _LOCK:
            got = _SEEN.get(chunk_hash)
    except TypeError:  # an unhashable hash value: never remembered
        return None
    if got is None or got[0] is None:
        return None
    tokens, parent = got
    ids = tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)
    return tuple(int(t) for t in ids), None if parent is None else event_hash(parent)


class Link:
    """What chains a chunk without a record: its event hash and its parent's
    (``block_hash``, ``parent_hash``, as ``kachedb.BlockMeta`` names them)."""

    __slots__ = ("block_hash", "parent_hash")

    def __init__(self, block_hash: int, parent_hash: Optional[int]) -> None:
        self.block_hash = block_hash
        self.parent_hash = parent_hash


def link(chunk_hash: Any) -> Optional[Link]:
    """The chunk's event hash and its parent's, if this process remembers the
    chunk (hashed from tokens or handed); ``None`` otherwise."""
    try:
        with _LOCK:
            got = _SEEN.get(chunk_hash)
    except TypeError:  # an unhashable hash value: never remembered
        return None
    if got is None:
        return None
    parent = got[1]
    return Link(event_hash(chunk_hash), None if parent is None else event_hash(parent))


def watch() -> bool:
    """Wraps LMCache's ``ChunkedTokenDatabase._prefix_hash`` and
    ``process_tokens`` (once per process); whether they are wrapped (an
    LMCache without ``_prefix_hash``: chunks are published by key)."""
    try:
        from lmcache.v1.token_database import ChunkedTokenDatabase
    except Exception:  # no token database in this LMCache
        return False
    wrap_process_tokens(ChunkedTokenDatabase)
    return wrap_prefix_hash(ChunkedTokenDatabase)


def wrap_process_tokens(cls: Any) -> bool:
    """Puts a wrapper in front of ``cls.process_tokens`` that remembers the
    parent of each hash it is handed (``hashes=``, in a prompt's order, no
    tokens: the one before it; the first: none), once; whether ``cls`` has
    that method."""
    original = cls.__dict__.get("process_tokens")
    if original is None:
        return False
    if getattr(original, _ORIGINAL, None) is not None:
        return True

    def process_tokens(self: Any, tokens: Any = None, hashes: Any = None, *args: Any, **kwargs: Any) -> Any:
        if tokens is None and hashes is not None:
            hashes = list(hashes)
            parent = None
            for h in hashes:
                try:
                    _remember(h, None, parent)
                except TypeError:  # an unhashable hash value: not remembered
                    pass
                parent = h
        return original(self, tokens, hashes, *args, **kwargs)

    setattr(process_tokens, _ORIGINAL, original)
    process_tokens.__doc__ = original.__doc__
    cls.process_tokens = process_tokens
    return True


def wrap_prefix_hash(cls: Any) -> bool:
    """Puts the remembering wrapper in front of ``cls._prefix_hash`` (a
    generator method: token chunks in, their prefix hashes out, in order),
    once; whether ``cls`` has that method."""
    original = cls.__dict__.get("_prefix_hash")
    if original is None:
        return False
    if getattr(original, _ORIGINAL, None) is not None:
        return True

    def _prefix_hash(self: Any, token_chunks: Iterable[Any]) -> Iterator[Any]:
        chunks = list(token_chunks)
        parent = None
        for chunk, chunk_hash in zip(chunks, original(self, iter(chunks))):
            try:
                _remember(chunk_hash, chunk, parent)
            except TypeError:  # an unhashable hash value: not remembered
                pass
            parent = chunk_hash
            yield chunk_hash

    setattr(_prefix_hash, _ORIGINAL, original)
    _prefix_hash.__doc__ = original.__doc__
    cls._prefix_hash = _prefix_hash
    return True


def chain_parents(
    keys: Sequence[Any],
    metas: Sequence[Any],
    before: Optional[Tuple[Any, ...]] = None,
    first_parent: Optional[Any] = None,
) -> List[Optional[Any]]:
    """The daemon key of the chunk each chunk follows, or ``None``: a chunk
    names the one before it (in ``keys``, or ``before``, a stored item
    ``(key, _, _, meta)`` ahead of them) when its record's parent hash is that
    chunk's hash, so the daemon chains a prompt's chunks and its chain-aware
    eviction takes them from the prompt's end (docs/eviction.md). ``metas``:
    each chunk's ``kachedb.BlockMeta`` or ``Link`` (``link``), or ``None``
    (no link either way). The
    first chunk, if ``before`` does not precede it, names ``first_parent``
    (the daemon key of its record's parent, stored by an earlier batch) when
    its record has a parent."""
    prev_key = before[0] if before is not None else None
    prev_meta = before[3] if before is not None else None
    parents: List[Optional[Any]] = []
    for key, meta in zip(keys, metas):
        linked = meta is not None and prev_meta is not None and meta.parent_hash == prev_meta.block_hash
        if linked:
            parents.append(prev_key)
        elif not parents and meta is not None and meta.parent_hash is not None:
            parents.append(first_parent)
        else:
            parents.append(None)
        prev_key, prev_meta = key, meta
    return parents
