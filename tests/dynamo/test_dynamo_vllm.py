"""A real vLLM CPU engine (``make vllm-env``; tests/vllm/engine.py) as the writer, Dynamo's
standalone indexer as the router's index: engine A stores a prompt through KacheDB and exits;
the indexer, subscribed to the node's KV events (not to any engine's), then scores the node with
all of the prompt's blocks — before any other engine looked the prompt up. The daemon then
evicts the chain from its tail, one block at a time (other blocks put into a small megaslab):
after each eviction the indexer's overlap drops to the blocks the daemon still holds (the delay
from the put that evicted to the indexer's answer is printed, p50/p99). What the daemon holds is
read from a subscriber of the same stream (``dynamo_support.evict_from_the_tail``)."""

from __future__ import annotations

import random

import pytest

from engine_support import engine_installed  # noqa: E402

if not engine_installed("vllm"):  # tests/vllm is a namespace package named vllm: not the engine
    pytest.skip("vLLM is not installed (make test-dynamo runs this in .venv-vllm)", allow_module_level=True)

from dynamo_support import Indexer, events_node, evict_from_the_tail, percentile, wait_subscribers  # noqa: E402
from kv_events_support import Subscriber  # noqa: E402

pytestmark = pytest.mark.timeout(900)

WORKER = 1
#: vLLM's block size on CPU in these tests (tests/vllm): the indexer is registered with it.
BLOCK = 32


def _prompt(seed: int, n: int) -> list:
    r = random.Random(seed)
    return [r.randrange(2048) for _ in range(n)]


class ChainSubscriber(Subscriber):
    """A subscriber of the node (``kv_events_support.Subscriber``) that also keeps, for each
    block published with tokens (an engine's record), its parent: ``chain``."""

    def __init__(self, pub: str, replay: str) -> None:
        self.chain: dict = {}
        super().__init__(pub, replay, on_event=self._note)

    def _note(self, ev) -> None:
        if type(ev).__name__ == "BlockStored" and ev.token_ids:
            self.chain[ev.block_hashes[0]] = ev.parent_block_hash


@pytest.fixture(scope="module")
def model_dir(workdir):
    from models import make_model

    return make_model(str(workdir / "llama-tiny"))


def test_an_engines_prompt_is_scored_on_the_node_and_the_score_follows_evictions(workdir, model_dir):
    from vllm_support import run_engine

    prompt = _prompt(42, 20 * BLOCK + 5)
    blocks = len(prompt) // BLOCK
    d, pub, rep, http = events_node(workdir / "dyn.sock", "32MiB")
    ix = Indexer(workdir / "indexer.log").start()
    sub = None
    try:
        ix.register(WORKER, pub, rep, BLOCK, model="tiny")
        sub = ChainSubscriber(pub, rep).start()
        wait_subscribers(http, 2, ix)
        assert ix.matched(prompt, WORKER, model="tiny")["longest_matched"] == 0

        a = run_engine(workdir, "A", dict(model=model_dir, socket=d.socket, block_size=BLOCK,
                                          phases=[{"prompts": [prompt], "max_tokens": 1}]))  # fmt: skip
        keys = [bytes.fromhex(h) for h in dict.fromkeys(a["stored_keys"])]
        kc = d.connect()
        held = kc.lookup(keys)
        assert held == blocks == len(keys), (held, blocks, len(keys))
        # No other engine looked the prompt up: the node's events alone tell the indexer.
        got, waited = ix.wait_matched(prompt, WORKER, blocks * BLOCK, model="tiny")
        assert got == blocks * BLOCK, (got, ix.query(prompt, model="tiny"), ix.log())
        m = ix.matched(prompt, WORKER, model="tiny")
        assert m["cpu"] == blocks * BLOCK and m["gpu"] == 0 and m["score"] == 0, m
        print(f"\nengine A stored {blocks} blocks; the indexer scored the node {got} tokens {waited * 1e3:.1f} ms after A exited")

        # The prompt's blocks as the node published them (the engine's hashes, parents first).
        with sub.changed:
            parents = dict(sub.chain)
        chain = [h for h, p in parents.items() if p is None or p not in parents]
        assert len(chain) == 1, parents
        children = {p: h for h, p in parents.items()}
        while chain[-1] in children:
            chain.append(children[chain[-1]])
        assert len(chain) == blocks, (len(chain), blocks)
        # Evict the chain from its tail with other blocks the size of one of A's.
        with kc.get(keys[0]) as t:
            nbytes = t.numel() * t.element_size()
        del t  # a live view keeps its block pinned
        delays, _ = evict_from_the_tail(kc, sub, ix, WORKER, prompt, chain, BLOCK, nbytes, 10**15, model="tiny")
        assert kc.lookup(keys) == 0
        print(
            f"eviction to the indexer's new overlap, {len(delays)} evictions: "
            f"p50 {percentile(delays, 0.5) * 1e3:.1f} ms, p99 {percentile(delays, 0.99) * 1e3:.1f} ms, "
            f"max {max(delays) * 1e3:.1f} ms"
        )
        kc.close()
    finally:
        if sub is not None:
            sub.close()
        ix.stop()
        d.stop()
