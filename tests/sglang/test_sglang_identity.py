"""Servers share pages exactly when their KV would be equal: the namespace
comes from SGLang's server arguments in the scheduler process, not only from
``HiCacheStorageConfig`` and the host pool. Two processes publish
``ServerArgs`` as SGLang's scheduler does and use real host pools of the same
geometry and dtype (bfloat16) on one daemon (test_sglang_server.py does the
same with real servers):

* ``base``: ``--dtype bfloat16``;
* ``fp8``: the same model path with ``--quantization fp8`` (on-the-fly FP8
  weights: other KV values, same pool);
* ``f32``: ``--dtype float32 --kv-cache-dtype bfloat16`` (computed in float32,
  cached as bfloat16: same pool);
* ``base-again``: the base server again (another process): finds everything.

The writer stores prompt P as ``base`` and P and Q as ``fp8`` (its own bytes);
the reader checks what each configuration finds and whose bytes it loads."""

import pytest

from engine_support import Daemon
from sglang_support import run_pools

pytestmark = pytest.mark.timeout(1800)
PAGES = 6

BASE = {"dtype": "bfloat16"}
FP8 = {"dtype": "bfloat16", "quantization": "fp8"}
F32 = {"dtype": "float32", "kv_cache_dtype": "bfloat16"}


@pytest.fixture(scope="module")
def runs(workdir):
    d = Daemon(str(workdir / "identity.sock")).start()
    try:
        spec = {"socket": d.socket, "pages": PAGES, "expected": str(workdir / "identity-expected")}
        w = run_pools(workdir, "identity-writer", dict(spec, configs=[
            {"name": "base", "args": BASE, "write": ["P"]},
            {"name": "fp8", "args": FP8, "write": ["P", "Q"]},
        ]), script="identity_proc.py")
        r = run_pools(workdir, "identity-reader", dict(spec, configs=[
            {"name": "base-again", "args": BASE, "read": ["P", "Q"]},
            {"name": "fp8", "args": FP8, "read": ["P", "Q"]},
            {"name": "f32", "args": F32, "read": ["P", "Q"]},
        ]), script="identity_proc.py")
        yield w, r, d.stats()
    finally:
        d.stop()


def test_namespace_carries_the_server_settings(runs):
    w, _, _ = runs
    base, fp8 = w["base"]["server"], w["fp8"]["server"]
    assert base["quantization"] is None and fp8["quantization"] == "fp8"
    assert base["dtype"] == fp8["dtype"] == "bfloat16"
    assert base["model_path"] == fp8["model_path"]
    # same model path, same pool: stored twice, once per server
    assert w["fp8"]["P"]["set"] == [True] * PAGES
    assert w["fp8"]["stats"]["set_pages_stored"] == 2 * PAGES and w["fp8"]["stats"]["set_pages_present"] == 0


def test_identical_servers_find_all_pages(runs):
    r = runs[1]["base-again"]
    assert r["P"]["exists"] == PAGES
    assert r["P"]["get"] == [True] * PAGES
    assert r["P"]["equal_to"] == ["base"]


def test_quantization_alone_separates_servers(runs):
    base, fp8 = runs[1]["base-again"], runs[1]["fp8"]
    assert base["Q"]["exists"] == 0 and base["Q"]["get"] == [False] * PAGES  # fp8's own prompt
    assert fp8["P"]["exists"] == PAGES and fp8["P"]["equal_to"] == ["fp8"]  # its own bytes, not base's
    assert fp8["Q"]["exists"] == PAGES and fp8["Q"]["equal_to"] == ["fp8"]


def test_dtype_alone_separates_servers(runs):
    f32 = runs[1]["f32"]
    assert f32["P"]["exists"] == 0 and f32["Q"]["exists"] == 0
    assert f32["P"]["get"] == [False] * PAGES and f32["P"]["untouched"]


def test_no_pins_left(runs):
    st = runs[2]
    assert st["pins"] == 0 and st["reserved"] == 0
