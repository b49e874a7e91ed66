"""Keys of LMCache chunks in KacheDB.

LMCache names a chunk by its ``CacheEngineKey``; ``to_string()`` spells out the
model name, world size, worker id, chunk hash (chained over the prompt's
tokens) and KV dtype. What it does not spell out is the byte layout of the
chunk: the memory format, the shapes of a full chunk (layers, tokens per chunk,
hidden size) and their dtypes. A KacheDB key is therefore
``namespace || CacheEngineKey.to_string()`` (hashed to 128 bits by the client),
where the namespace digests that layout, this module's layout version and an
optional user salt. Two LMCache engines share chunks exactly when both parts
are equal.

Nothing here imports LMCache or torch: the namespace is computed from plain
values, which the connector gathers from LMCache's metadata.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Dict, Iterable, Optional

#: Version of the byte layout of a stored chunk: one 1-D uint8 block holding the
#: ``MemoryObj``'s bytes (all KV groups, in LMCache's order), its length a whole
#: number of tokens. Bump when it changes: old chunks then simply stop matching.
LAYOUT_VERSION = 1

#: Prefix mixed into every namespace, so that the key of an LMCache chunk can
#: never equal a key some other user of the daemon (vLLM's connector, an
#: application) chose.
_DOMAIN = b"kachedb.lmcache.chunk/"


def namespace_fields(
    *,
    fmt: str,
    shapes: Iterable[Iterable[int]],
    dtypes: Iterable[Any],
    chunk_size: int,
    use_mla: bool,
    salt: Optional[str] = None,
) -> Dict[str, Any]:
    """The fields a namespace digests, as a plain dict."""
    return {
        "layout_version": LAYOUT_VERSION,
        "fmt": str(fmt),
        "shapes": [[int(d) for d in s] for s in shapes],
        "dtypes": [str(d).replace("torch.", "") for d in dtypes],
        "chunk_size": int(chunk_size),
        "use_mla": bool(use_mla),
        "salt": salt,
    }


def namespace_digest(fields: Dict[str, Any]) -> bytes:
    """16 bytes identifying ``fields`` (blake2b of their canonical JSON)."""
    blob = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.blake2b(_DOMAIN + blob, digest_size=16).digest()


def chunk_key(namespace: bytes, key_string: str) -> bytes:
    """The KacheDB key (``bytes``; the client hashes it to 128 bits) of the chunk
    whose ``CacheEngineKey.to_string()`` is ``key_string``."""
    return namespace + key_string.encode("utf-8")
