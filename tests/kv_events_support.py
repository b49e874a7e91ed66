"""A subscriber of the daemon's KV events (``kachedb serve --events-endpoint``,
docs/events.md) as a router would run it: a ZMQ SUB socket, vLLM's msgspec
decoder, the sequence numbers checked, a gap or a late join repaired through
the replay socket, and the index (the set of block hashes) kept by applying
``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` in order.

The decoder is vLLM's own ``KVEventBatch`` where vLLM is installed; elsewhere
the same schema as vLLM 0.32.0 declares it (``vllm/distributed/kv_events.py``),
written out here.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any, Callable, List, Optional, Set, Tuple, Union

import msgspec
import zmq

try:  # pragma: no cover - depends on the environment
    from vllm.distributed.kv_events import KVEventBatch as _VllmBatch

    DECODER_SOURCE = "vllm.distributed.kv_events.KVEventBatch"
except Exception:  # vLLM absent (the main environment) or broken
    _VllmBatch = None
    DECODER_SOURCE = "the vLLM 0.32.0 schema written out in tests/kv_events_support.py"

ExternalBlockHash = Union[bytes, int]


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: List[Any]
    data_parallel_rank: Optional[int] = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: List[ExternalBlockHash]
    parent_block_hash: Optional[ExternalBlockHash]
    token_ids: List[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[List[Optional[Tuple[Any, ...]]]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None
    session_id: Optional[str] = None


class BlockRemoved(KVCacheEvent):
    block_hashes: List[ExternalBlockHash]
    medium: Optional[str]
    group_idx: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: List[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


BATCH_TYPE = _VllmBatch if _VllmBatch is not None else KVEventBatch

END_SEQ = -1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Subscriber:
    """Subscribes to ``pub`` (and replays from ``replay``) on a thread of its
    own once ``start()`` is called. ``index`` is the set of block hashes held
    in the megaslab (medium ``CPU``) as of sequence number ``last_seq``,
    ``disk`` those the disk tier holds (medium ``DISK``). ``paused`` (an Event): while set, the
    thread does not read (a slow subscriber; its socket's buffers fill).
    ``on_event``: called with each decoded event, in order."""

    def __init__(
        self,
        pub: str,
        replay: str,
        *,
        rcvhwm: Optional[int] = None,
        rcvbuf: Optional[int] = None,
        on_event: Optional[Callable[[Any], None]] = None,
    ) -> None:
        self.pub, self.replay_ep = pub, replay
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        if rcvhwm is not None:
            self.sub.setsockopt(zmq.RCVHWM, rcvhwm)
        if rcvbuf is not None:
            self.sub.setsockopt(zmq.RCVBUF, rcvbuf)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(pub)
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.connect(replay)
        self.decoder = msgspec.msgpack.Decoder(BATCH_TYPE)
        self.on_event = on_event
        self.index: Set[int] = set()
        self.disk: Set[int] = set()
        self.last_seq: Optional[int] = None
        self.batches = 0
        self.gaps = 0
        self.replays = 0
        self.snapshots = 0
        self.paused = threading.Event()
        self.stop = threading.Event()
        self.error: Optional[BaseException] = None
        self.changed = threading.Condition()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "Subscriber":
        self.thread.start()
        return self

    def close(self) -> None:
        self.stop.set()
        self.paused.clear()
        if self.thread.is_alive():
            self.thread.join(10)
        self.sub.close(0)
        self.dealer.close(0)
        self.ctx.term()

    def _apply(self, payload: bytes) -> None:
        batch = self.decoder.decode(payload)
        for ev in batch.events:
            if self.on_event is not None:
                self.on_event(ev)
            name = type(ev).__name__
            if name == "AllBlocksCleared":
                self.index.clear()
                self.disk.clear()
            elif name == "BlockStored":
                self._medium(ev).update(ev.block_hashes)
            elif name == "BlockRemoved":
                self._medium(ev).difference_update(ev.block_hashes)
            else:  # pragma: no cover
                raise AssertionError(f"unknown event {ev!r}")
        self.batches += 1

    def _medium(self, ev: Any) -> Set[int]:
        assert ev.medium in ("CPU", "DISK"), ev
        return self.index if ev.medium == "CPU" else self.disk

    def _replay(self, start: int) -> None:
        """Asks for every batch from ``start`` on; applies the answer in order
        (buffered batches, or a snapshot whose batches all carry the sequence
        number it is as of)."""
        self.replays += 1
        self.dealer.send_multipart([b"", start.to_bytes(8, "big")])
        first = True
        while True:
            if not self.dealer.poll(10_000):
                raise AssertionError(f"no replay answer from {self.replay_ep} within 10 s")
            _, seq_b, payload = self.dealer.recv_multipart()
            seq = int.from_bytes(seq_b, "big", signed=True)
            if seq == END_SEQ:
                return
            if first and seq != start:  # a buffered answer starts at `start`
                self.snapshots += 1
            first = False
            self._apply(payload)
            self.last_seq = seq if self.last_seq is None else max(self.last_seq, seq)

    def _run(self) -> None:
        try:
            while not self.stop.is_set():
                if self.paused.is_set():
                    time.sleep(0.01)
                    continue
                if not self.sub.poll(50):
                    continue
                _topic, seq_b, payload = self.sub.recv_multipart()
                seq = int.from_bytes(seq_b, "big")
                with self.changed:
                    if self.last_seq is None:
                        # A late joiner: the whole state first.
                        self._replay(0)
                    elif seq > self.last_seq + 1:
                        self.gaps += 1
                        self._replay(self.last_seq + 1)
                    if self.last_seq is not None and seq <= self.last_seq:
                        continue  # already had it through the replay
                    self._apply(payload)
                    self.last_seq = seq
                    self.changed.notify_all()
        except BaseException as e:  # surfaced by wait_for
            self.error = e
            with self.changed:
                self.changed.notify_all()

    def saw(self, block_hash: int, timeout_s: float) -> bool:
        """Whether ``block_hash`` is in the index within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self.changed:
            while block_hash not in self.index:
                if self.error is not None:
                    raise self.error
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.changed.wait(min(left, 0.5))
        return True


def settle(kc: Any, subs: List[Subscriber], value: bytes, first_key: int, keys: Set[int], tries: int = 120) -> int:
    """Stores new keys ``first_key``, ``first_key + 1``, … until every
    subscriber's index holds the last one (a SUB socket's connection is made
    in the background, and a subscriber sees a gap only when a later batch
    comes); each key stored is added to ``keys``. Returns the next free key.
    A liveness bound (``tries`` keys, a second each), not a timing assertion."""
    for key in range(first_key, first_key + tries):
        keys.add(key)
        kc.put(key, value)
        if all(s.saw(key, 1.0) for s in subs):
            return key + 1
    states = [(s.last_seq, s.batches, s.error) for s in subs]
    raise AssertionError(f"the subscribers never all saw a block stored: (last seq, batches, error) = {states}")
