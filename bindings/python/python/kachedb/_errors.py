"""KacheDB's exceptions. The native module raises these classes by name
(``bindings/python/src/errors.rs``); keep the names in sync with ``KINDS`` there.

Each also derives from the builtin exception a caller would naturally catch
(``KeyError`` for a missing key, ``MemoryError`` for a full store, …).
"""

from __future__ import annotations

__all__ = [
    "KacheDBError",
    "NotFound",
    "OutOfMemory",
    "Disconnected",
    "InvalidArgument",
    "BadHandle",
    "TooLarge",
]


class KacheDBError(Exception):
    """Base class of every error KacheDB raises."""

    def __str__(self) -> str:
        # One plain message, also for the KeyError subclass (whose default str()
        # would quote it).
        return Exception.__str__(self)


class NotFound(KacheDBError, KeyError):
    """No committed block has this key (never put, deleted, or evicted)."""


class OutOfMemory(KacheDBError, MemoryError):
    """The store is full of pinned blocks or reservations: release views or start
    the daemon with a larger ``--size``."""


class Disconnected(KacheDBError, ConnectionError):
    """The daemon is gone (or this client was closed, or inherited across fork)."""


class InvalidArgument(KacheDBError, ValueError):
    """The daemon rejected a request as malformed (dtype, shape, handle state)."""


class BadHandle(KacheDBError):
    """A reservation or pin handle is unknown to the daemon (already committed,
    aborted or released)."""


class TooLarge(KacheDBError, ValueError):
    """The block can never fit in the store, even empty."""
