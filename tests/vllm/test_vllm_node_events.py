"""The daemon's KV events (docs/events.md) decoded by vLLM's own decoder,
``msgspec.msgpack.Decoder(vllm.distributed.kv_events.KVEventBatch)``: every
batch decodes into vLLM's classes, and the index they describe is the
daemon's. (The main suite's tests/test_kv_events.py runs the long scenario
with the same subscriber; here vLLM is installed, so it uses vLLM's class.)"""

from __future__ import annotations

import random

from harness.daemon import Daemon, built_binary
from kv_events_support import DECODER_SOURCE, Subscriber, free_port, settle


def test_vllms_decoder_reads_the_daemons_events_and_they_describe_its_index():
    assert DECODER_SOURCE == "vllm.distributed.kv_events.KVEventBatch", DECODER_SOURCE
    pub_ep, replay_ep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    extra = ["--events-endpoint", pub_ep, "--events-replay-endpoint", replay_ep]
    rng = random.Random(7)
    value = bytes(64 * 1024)
    with Daemon(size="16MiB", extra=extra, binary=built_binary()) as d:
        seen_types = set()
        sub = Subscriber(pub_ep, replay_ep, on_event=lambda ev: seen_types.add((type(ev).__module__, type(ev).__name__)))
        sub.start()
        try:
            kc = d.connect()
            keys: set = set()
            nxt = settle(kc, [sub], value, 10**12, keys)
            for _ in range(2000):
                key = rng.randrange(600)
                keys.add(key)
                if rng.random() < 0.7:
                    kc.put(key, value)
                else:
                    kc.delete(key)
            settle(kc, [sub], value, nxt, keys)
            held = {k for k in keys if kc.lookup([k]) == 1}
            assert kc.stats()["evictions"] > 0
            with sub.changed:
                assert sub.index == held
            assert {n for m, n in seen_types if m == "vllm.distributed.kv_events"} >= {
                "AllBlocksCleared",
                "BlockStored",
                "BlockRemoved",
            }, seen_types
            kc.close()
        finally:
            sub.close()
        d.stop(check=True)
