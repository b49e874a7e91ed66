"""KacheDB: a node-local store for LLM KV-cache blocks, read back as zero-copy
``torch.Tensor`` / numpy views of shared memory.

This module only re-exports; the pieces live in ``_keys``, ``_errors``,
``_dtypes``, ``_views``, ``_device`` and the native ``_kachedb_rust``.
"""

from ._errors import (
    BadHandle,
    Denied,
    Disconnected,
    InvalidArgument,
    KacheDBError,
    NotDurable,
    NotFound,
    OutOfMemory,
    TimedOut,
    TooLarge,
)
from ._client import Client, Reservation, Reservations, connect, default_socket_path
from ._device import to_device
from ._kachedb_rust import __version__
from ._keys import KeyLike, key_of
from ._meta import BlockMeta

__all__ = [
    "connect",
    "Client",
    "Reservation",
    "Reservations",
    "BlockMeta",
    "default_socket_path",
    "to_device",
    "__version__",
    "key_of",
    "KeyLike",
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
