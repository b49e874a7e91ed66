"""User keys -> the daemon's 128-bit keys (docs/PROTOCOL.md, "Keys").

Mirrors ``kachedb_client::Key`` byte for byte; both are tested on the same fixed
vectors (tests/test_keys.py and crates/kachedb-client/src/key.rs).
"""

from __future__ import annotations

import hashlib
import struct
from typing import Union

__all__ = ["KeyLike", "key_of", "key_parts", "KEY_PERSONALIZATION"]

#: BLAKE2b personalisation of key hashing, version 1 (16 bytes, BLAKE2b's maximum).
KEY_PERSONALIZATION = b"kachedb-key-v1\0\0"

_MOD = 1 << 128
_MASK64 = (1 << 64) - 1

#: What a key may be: bytes-like (hashed), str (UTF-8, hashed) or int (mod 2**128).
KeyLike = Union[bytes, bytearray, memoryview, str, int]


#: An empty keyed hasher: copying it is twice as fast as setting one up per key.
_HASHER = hashlib.blake2b(digest_size=16, person=KEY_PERSONALIZATION)
#: digest -> (key_lo, key_hi): two little-endian u64s.
_SPLIT = struct.Struct("<QQ").unpack


def _digest(data: bytes | bytearray | memoryview) -> bytes:
    h = _HASHER.copy()
    h.update(data)
    return h.digest()


def _hash_bytes(data: bytes | bytearray | memoryview) -> int:
    return int.from_bytes(_digest(data), "little")


def key_of(key: KeyLike) -> int:
    """The 128-bit key (an int in ``[0, 2**128)``) that ``key`` is stored under.

    * ``bytes``, ``bytearray``, ``memoryview`` (of any format, by its raw bytes):
      BLAKE2b with a 16-byte digest and personalisation ``b"kachedb-key-v1\\0\\0"``,
      the digest read as a little-endian integer.
    * ``str``: its UTF-8 bytes, as above.
    * ``int`` (``bool`` excluded): taken modulo 2**128, so negative values
      (Python's ``hash()``) are valid keys.

    Anything else raises ``TypeError``.
    """
    # bool is an int subclass, but True/False as a key is almost surely a bug.
    if isinstance(key, int) and not isinstance(key, bool):
        return key % _MOD
    if isinstance(key, str):
        try:
            return _hash_bytes(key.encode("utf-8"))
        except UnicodeEncodeError as e:
            raise ValueError(f"a str key must be encodable as UTF-8 (lone surrogates are not): {e}") from None
    if isinstance(key, (bytes, bytearray)):
        return _hash_bytes(key)
    if isinstance(key, memoryview):
        # hashlib reads a C-contiguous buffer's raw bytes whatever its format;
        # tobytes() gives the same bytes (in C order) for a non-contiguous view.
        return _hash_bytes(key if key.c_contiguous else key.tobytes())
    raise TypeError(
        f"a KacheDB key must be bytes, bytearray, memoryview, str or int, not {type(key).__name__}"
        " (hash other objects to bytes first)"
    )


def key_parts(key: KeyLike) -> tuple[int, int]:
    """``(key_lo, key_hi)``: the two 64-bit halves of ``key_of(key)``, as in a descriptor."""
    # Fast paths (every operation maps its key): the same values as key_of.
    t = type(key)
    if t is str:
        try:
            return _SPLIT(_digest(key.encode("utf-8")))
        except UnicodeEncodeError:
            pass  # key_of raises the documented error
    elif t is bytes:
        return _SPLIT(_digest(key))
    elif t is int:
        k = key % _MOD
        return k & _MASK64, k >> 64
    k = key_of(key)
    return k & _MASK64, k >> 64
