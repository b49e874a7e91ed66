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


def test_a_vllm_engines_stored_prompt_arrives_with_the_engines_own_hashes_and_tokens(workdir, model_dir):
    """A real vLLM CPU engine stores a prompt through the connector, which
    attaches each block's metadata (manager._block_metas): every block of the
    prompt the engine's own KV events name (its ``BlockStored`` on its own
    publisher: hash, parent, tokens, block size) arrives on the daemon's
    stream with the same hash, parent, tokens and block size."""
    import random as _random

    from engine_support import Daemon as EngineDaemon
    from test_vllm_kv_events import Subscriber as EngineSubscriber
    from vllm_support import run_engine

    block = 32
    prompt = [_random.Random(31).randrange(2048) for _ in range(8 * block + 5)]
    pub_ep, replay_ep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    engine_ep = f"ipc://{workdir}/meta.events"
    stored: dict = {}

    def record(ev):
        if type(ev).__name__ == "BlockStored":
            for h in ev.block_hashes:
                stored[h] = ev

    d = EngineDaemon(str(workdir / "meta.sock"), size="256MiB", extra=["--events-endpoint", pub_ep,
                                                                     "--events-replay-endpoint", replay_ep]).start()
    sub = Subscriber(pub_ep, replay_ep, on_event=record).start()
    engine_sub = EngineSubscriber(engine_ep)
    try:
        kc = d.client()
        settle(kc, [sub], b"x" * 4096, 10**12, set())
        res = run_engine(workdir, "META", dict(model=model_dir, socket=d.socket, kv_events_endpoint=engine_ep,
                                         block_size=block, phases=[{"prompts": [prompt], "max_tokens": 1}]))
        engine_sub.close()
        # The engine's own events (medium GPU), one block at a time.
        engine_blocks = []
        for ev in engine_sub.events("BlockStored", "GPU"):
            parent = ev.parent_block_hash
            for i, h in enumerate(ev.block_hashes):
                toks = list(ev.token_ids[i * ev.block_size:(i + 1) * ev.block_size])
                engine_blocks.append((h, parent, toks, ev.block_size))
                parent = h
        whole = len(prompt) // block
        ours = engine_blocks[:whole]
        assert [b[2] for b in ours] == [prompt[i * block:(i + 1) * block] for i in range(whole)], engine_blocks
        for h, parent, toks, size in ours:
            assert isinstance(h, int), "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES is on by default"
            assert sub.saw(h, 60), f"the daemon did not publish the engine's block {h:#x}: {res['phases'][0].get('stats')}"
            ev = stored[h]
            assert (ev.block_hashes, ev.parent_block_hash, list(ev.token_ids), ev.block_size, ev.medium) == (
                [h], parent, toks, size, "CPU"), ev
        kc.close()
    finally:
        sub.close()
        d.stop()


def test_the_managers_store_spec_names_each_blocks_hash_parent_and_tokens(tmp_path):
    """Without an engine (seconds): ``prepare_store`` gives each block the
    metadata of the request the scheduler holds (its hash as vLLM's events
    name it, its parent's, its tokens); a block whose position or hash the
    request does not match gets none, and without ``request_of`` none do."""
    from types import SimpleNamespace

    from vllm.v1.kv_offload.base import ReqContext, make_offload_key

    from engine_support import Daemon as EngineDaemon
    from kachedb._meta import int_hash
    from test_vllm_kv_events import _spec

    block = 16
    hashes = [bytes([i + 1]) * 32 for i in range(4)]
    req = SimpleNamespace(block_hashes=hashes, all_token_ids=list(range(100, 100 + 4 * block + 3)), lora_request=None)
    keys = [make_offload_key(h, 0) for h in hashes]
    d = EngineDaemon(str(tmp_path / "m.sock"), size="64MiB").start()
    try:
        m = _spec(d.socket, {}).get_manager()
        ctx = ReqContext(req_id="r")
        for i, k in enumerate(keys):
            ctx.set_offload_key_position(k, (i + 1) * block)
        assert m.prepare_store(keys[:1], ctx).store_spec.metas is None  # no request_of
        m.request_of = {"r": req}.get
        stray = make_offload_key(b"\x77" * 32, 0)
        ctx.set_offload_key_position(stray, 3 * block)  # the request's block 3 has another hash
        spec = m.prepare_store(keys[1:] + [stray], ctx).store_spec
        assert spec.keys == keys[1:] + [stray]
        metas = spec.metas
        for i, meta in zip(range(1, 4), metas):
            assert meta.block_hash == int_hash(hashes[i]) == int.from_bytes(hashes[i][-8:], "big")
            assert meta.parent_hash == int_hash(hashes[i - 1])
            assert list(meta.token_ids) == req.all_token_ids[i * block:(i + 1) * block] and meta.block_size == block
        assert metas[3] is None
        m.shutdown()
    finally:
        d.stop()
