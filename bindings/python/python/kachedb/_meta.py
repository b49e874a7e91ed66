"""``BlockMeta``: what an engine knows of a block and the daemon does not — its
hash in the engine's terms, its parent's, its tokens, the block size, the LoRA
adapter — attached to a reservation before its commit
(``Reservation.attach_meta``, ``Reservations.attach_meta``) and published in
the daemon's KV events (docs/events.md, "Block metadata"). The record's
layout and bounds are the Rust side's (``kachedb_shm::block_meta``); this is
its Python face."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

from ._errors import InvalidArgument

#: Most token ids one record carries (``kachedb_shm::block_meta::MAX_META_TOKENS``).
MAX_META_TOKENS = 4096

_U64 = (1 << 64) - 1
_U32 = (1 << 32) - 1


@dataclass(frozen=True)
class BlockMeta:
    """One block as the engine names it. ``block_hash`` and ``parent_hash``:
    unsigned 64-bit ints (vLLM: its block hash's low 64 bits, as
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` publishes them, ``int_hash``);
    ``token_ids``: the block's tokens, at most ``block_size`` (which defaults
    to their count)."""

    block_hash: int
    token_ids: Sequence[int] = field(default_factory=tuple)
    block_size: Optional[int] = None
    parent_hash: Optional[int] = None
    lora_id: Optional[int] = None
    lora_name: Optional[str] = None

    def as_tuple(self) -> Tuple[int, Optional[int], int, List[int], Optional[int], Optional[str]]:
        """The native layer's form; ``InvalidArgument`` for a value out of range."""
        tokens = [int(t) for t in self.token_ids]
        size = len(tokens) if self.block_size is None else int(self.block_size)
        if not 0 <= int(self.block_hash) <= _U64:
            raise InvalidArgument(f"block_hash {self.block_hash} is not an unsigned 64-bit int")
        if self.parent_hash is not None and not 0 <= int(self.parent_hash) <= _U64:
            raise InvalidArgument(f"parent_hash {self.parent_hash} is not an unsigned 64-bit int")
        if not 1 <= size <= _U32:
            raise InvalidArgument(f"block_size {size}: give the engine's tokens per block (1 or more)")
        if len(tokens) > min(size, MAX_META_TOKENS):
            raise InvalidArgument(f"{len(tokens)} token ids for a block of {size} (at most {MAX_META_TOKENS})")
        if tokens and not (0 <= min(tokens) and max(tokens) <= _U32):
            raise InvalidArgument("token ids must be unsigned 32-bit ints")
        if self.lora_id is not None and not 0 <= int(self.lora_id) <= _U32:
            raise InvalidArgument(f"lora_id {self.lora_id} is not an unsigned 32-bit int")
        return (
            int(self.block_hash),
            None if self.parent_hash is None else int(self.parent_hash),
            size,
            tokens,
            None if self.lora_id is None else int(self.lora_id),
            self.lora_name,
        )


def int_hash(block_hash: bytes) -> int:
    """An engine's bytes block hash as the 64-bit int its KV events publish
    (vLLM's ``maybe_convert_block_hash``: the last 8 bytes, big-endian)."""
    return int.from_bytes(bytes(block_hash), "big") & _U64


def native_metas(metas: Sequence[Optional[BlockMeta]]) -> list:
    """``metas`` in the native layer's form (``None`` stays ``None``)."""
    out = []
    for m in metas:
        if m is not None and not isinstance(m, BlockMeta):
            raise InvalidArgument(f"block metadata must be a kachedb.BlockMeta or None, not {type(m).__name__}")
        out.append(None if m is None else m.as_tuple())
    return out
