"""KacheDB's exceptions, defined here once. The native module imports each class
by its name (``pyo3::import_exception!`` in ``bindings/python/src/errors.rs``):
a class renamed here is renamed there.

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
    "TimedOut",
    "Denied",
    "NotDurable",
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


class TimedOut(KacheDBError, TimeoutError):
    """``wait_for``: no block was committed under the key before the timeout."""


class Denied(KacheDBError, PermissionError):
    """The block belongs to a tenant bound to another user or group
    (``kachedb serve --tenant-uid`` / ``--tenant-gid``): this client may read it,
    not replace or delete it. Nothing changed."""


class NotDurable(KacheDBError, OSError):
    """A ``delete`` (or a ``put`` that replaced a block) took effect in memory, but
    the disk tier could not confirm in time that the key's older copy is gone; it
    keeps retrying and serves no copy meanwhile, but after a crash the older copy
    may come back. Retry once the disk is healthy."""
