"""A process without SGLang's server arguments shares nothing: its namespace
could not tell servers apart that differ only in quantization, dtype or
KV-cache dtype, so its backend stores nothing and finds nothing (one warning
naming the cause and the fix; every lookup, load and store counted as
refused), unless its extra config says ``no_server_args: true`` (it then
shares with other such processes only). Real processes on one real daemon,
real host pools:

* process 1 publishes ``ServerArgs`` as SGLang's scheduler does and stores
  prompt P;
* process 2, without server arguments: finds none of P and stores Q (refused);
  then, with ``no_server_args: true``, stores R;
* process 3, without server arguments: finds neither P nor Q; with
  ``no_server_args: true`` it finds R (process 2's bytes) and not P; then,
  with the server arguments of process 1 published, it finds P (process 1's
  bytes) and neither Q nor R."""

import pytest

from engine_support import Daemon
from sglang_support import run_pools

pytestmark = pytest.mark.timeout(1800)
PAGES = 5

BASE = {"dtype": "bfloat16"}
OPT_IN = {"no_server_args": True}


@pytest.fixture(scope="module")
def runs(workdir):
    d = Daemon(str(workdir / "no-server-args.sock")).start()
    try:
        spec = {"socket": d.socket, "pages": PAGES, "expected": str(workdir / "no-server-args-expected")}
        p1 = run_pools(workdir, "nsa-with", dict(spec, configs=[
            {"name": "base", "args": BASE, "write": ["P"]},
        ]), script="identity_proc.py")
        p2 = run_pools(workdir, "nsa-without-1", dict(spec, configs=[
            {"name": "none", "args": None, "read": ["P"], "write": ["Q"]},
            {"name": "opt-in", "args": None, "extra": OPT_IN, "write": ["R"]},
        ]), script="identity_proc.py")
        p3 = run_pools(workdir, "nsa-without-2", dict(spec, configs=[
            {"name": "none", "args": None, "read": ["P", "Q"]},
            {"name": "opt-in", "args": None, "extra": OPT_IN, "read": ["R", "P"]},
            {"name": "base", "args": BASE, "read": ["P", "Q", "R"]},
        ]), script="identity_proc.py")
        yield p1, p2, p3, d.stats()
    finally:
        d.stop()


def _missed(r):
    return r["exists"] == 0 and r["get"] == [False] * PAGES and r["untouched"]


def test_without_server_args_nothing_is_found(runs):
    _, p2, p3, _ = runs
    assert p2["none"]["refused"] and p3["none"]["refused"]
    assert _missed(p2["none"]["P"])  # process 1 stored it
    assert _missed(p3["none"]["P"]) and _missed(p3["none"]["Q"])


def test_without_server_args_nothing_is_stored(runs):
    _, p2, p3, daemon = runs
    assert p2["none"]["Q"]["set"] == [False] * PAGES
    st = p2["none"]["stats"]
    assert st["set_pages_refused"] == PAGES and st["set_pages_stored"] == 0
    assert st["exists_pages_refused"] == PAGES and st["get_pages_refused"] == PAGES
    assert st["tier_off"]
    # Q is in no namespace: not even a server with arguments finds it
    assert _missed(p3["base"]["Q"])
    # the daemon holds P (process 1) and R (the opt-in) only
    assert daemon["blocks"] == 2 * PAGES
    assert daemon["pins"] == 0 and daemon["reserved"] == 0


def test_one_warning_names_the_cause_and_the_fix(runs):
    _, p2, _, _ = runs
    log = p2["log"]
    assert log.count("KacheDB HiCache is OFF") == 1, log[-3000:]
    line = next(ln for ln in log.splitlines() if "KacheDB HiCache is OFF" in ln)
    for words in ("no SGLang server arguments", "--quantization", "publish(server_args, role='scheduler')",
                  '"no_server_args": true'):
        assert words in line, line
    assert p2["tracebacks"] == 0


def test_no_server_args_on_purpose_shares_only_with_its_kind(runs):
    p1, p2, p3, _ = runs
    opt2, opt3 = p2["opt-in"], p3["opt-in"]
    assert opt2["refused"] is None and opt2["server"] is None
    assert opt2["R"]["set"] == [True] * PAGES and opt2["stats"]["set_pages_stored"] == PAGES
    assert opt3["R"]["exists"] == PAGES and opt3["R"]["get"] == [True] * PAGES and opt3["R"]["equal_to"] == ["opt-in"]
    assert _missed(opt3["P"])  # stored by a server with arguments
    base = p3["base"]
    assert base["server"]["dtype"] == "bfloat16" and base["namespace"] == p1["base"]["namespace"]
    assert base["P"]["exists"] == PAGES and base["P"]["equal_to"] == ["base"]
    assert _missed(base["R"])
    assert opt2["namespace"] != p1["base"]["namespace"]
