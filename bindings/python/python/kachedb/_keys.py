"""User keys -> the daemon's 128-bit keys (docs/PROTOCOL.md, "Keys").

The mapping is native (``bindings/python/src/client.rs``, ``key_of``): the one
function every operation maps its keys with, byte for byte
``kachedb_client::Key``. ``tests/test_keys.py`` checks it against fixed vectors
(shared with ``crates/kachedb-client/src/key.rs``) and a hashlib reference.
"""

from __future__ import annotations

from typing import Union

from ._kachedb_rust import key_of

__all__ = ["KeyLike", "key_of"]

#: What a key may be: bytes-like (hashed), str (UTF-8, hashed) or int (mod 2**128).
KeyLike = Union[bytes, bytearray, memoryview, str, int]
