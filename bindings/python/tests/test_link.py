"""kachedb._link.DaemonLink, the engine integrations' connection to the daemon:
an absent or lost daemon is ``None`` from ``client()`` (never an exception),
retried every ``retry_s``; one warning per outage in a warn scope; reconnects
counted; a closed link stays closed; a forked child connects its own client."""

import collections
import logging
import os
import time

import pytest

import kachedb
from kachedb._link import DaemonLink, WarnScope
from kdb_support import Daemon

LOGGER = "kachedb.test-link"
RETRY_S = 0.5  # long enough that two calls in a row on a loaded machine fall within one window


def make_link(socket, counters=None, scope=None, role=None):
    return DaemonLink(socket, logger=logging.getLogger(LOGGER), label="Engine", role=role, retry_s=RETRY_S,
                      counters=counters, scope=scope)


def offs(caplog):
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and "KacheDB tier off" in r.getMessage()]


def backs(caplog):
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and "KacheDB tier back on" in r.getMessage()]


def lose_daemon(links, daemon):
    """Stops ``daemon``; an operation of each link then raises ``Disconnected``,
    which the link is told about (as the integrations do)."""
    clients = [link.client() for link in links]
    daemon.stop()
    for link, kc in zip(links, clients):
        with pytest.raises(kachedb.Disconnected) as e:
            for _ in range(100):  # the client notices the daemon's exit at its next request
                kc.stats()
                time.sleep(0.02)
        link.failed(e.value)


def test_absent_daemon_is_none_retried_and_warned_once(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    counters = collections.defaultdict(float)
    link = make_link(str(tmp_path / "absent.sock"), counters, role="scheduler")
    assert link.client() is None
    assert link.client() is None  # within retry_s: not tried again
    assert link.outages == 1 and counters["tier_off"] == 1
    time.sleep(RETRY_S * 2)
    assert link.client() is None
    assert link.outages == 2 and counters["tier_off"] == 2
    assert not link.is_on
    msgs = offs(caplog)
    assert len(msgs) == 1, msgs
    assert "(Engine scheduler)" in msgs[0] and "absent.sock" in msgs[0] and "Engine keeps serving" in msgs[0]
    with pytest.raises(kachedb.Disconnected):
        link.connect()


@pytest.mark.parametrize("shared", [True, False])
def test_one_warning_per_outage_in_a_scope_and_reconnects(make_daemon, caplog, shared):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    counters = collections.defaultdict(float)
    scope = WarnScope() if shared else None
    d1 = Daemon()  # stopped by the test (make_daemon's would fail its teardown check)
    try:
        a = make_link(d1.socket, counters, scope, role="a")
        b = make_link(d1.socket, counters, scope, role="b")
        assert a.client() is not None and b.client() is not None
        assert offs(caplog) == [] and counters["reconnects"] == 0
        lose_daemon([a, b], d1)
    finally:
        d1.stop(check=False)
    assert a.client() is None and b.client() is None
    assert len(offs(caplog)) == (1 if shared else 2), offs(caplog)

    d2 = make_daemon()  # the daemon is back (at the address the links now use)
    a.socket = b.socket = d2.socket
    time.sleep(RETRY_S * 2)
    kc = a.client()
    assert kc is not None and b.client() is not None
    assert kc.stats()["blocks"] == 0
    assert len(backs(caplog)) == (1 if shared else 2), backs(caplog)
    assert (a.reconnects, b.reconnects) == ((1, 0) if shared else (1, 1))
    assert counters["reconnects"] == (1 if shared else 2)
    a.close()
    b.close()


def test_closed_link_stays_closed(daemon):
    link = make_link(daemon.socket)
    kc = link.connect()
    assert link.client() is kc and link.is_on
    link.close()
    time.sleep(RETRY_S * 2)
    assert link.client() is None and not link.is_on
    assert link.outages == 0


def test_forked_child_connects_its_own_client(daemon):
    link = make_link(daemon.socket)
    parent_kc = link.client()
    assert parent_kc is not None
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            kc = link.client()
            if kc is not None and kc is not parent_kc and kc.stats()["blocks"] >= 0:
                code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert link.client() is parent_kc
    link.close()


def test_link_connects_as_its_tenant_after_a_reconnect_too(make_daemon):
    d = make_daemon()
    link = DaemonLink(d.socket, logger=logging.getLogger(LOGGER), label="Engine", retry_s=RETRY_S, tenant="team-q")
    kc = link.client()
    assert kc.lookup([b"k"]) == 0
    rows = {t["name"]: t for t in kc.stats()["tenants"]}
    assert rows["team-q"]["clients"] == 1 and rows["team-q"]["lookup_misses"] == 1, rows
    link.failed(kachedb.Disconnected("test"))  # dropped: the next client() connects again, as the same tenant
    time.sleep(2 * RETRY_S)
    kc = link.client()
    assert {t["name"]: t for t in kc.stats()["tenants"]}["team-q"]["clients"] == 1
    link.close()


@pytest.mark.parametrize("tenant, namespace, expected", [
    ("team-a", None, "team-a"),
    ("team-a", "ns", "team-a"),  # the explicit tenant wins
    (None, "ns-1.b", "ns-1.b"),  # the namespace label as it is
    (None, "org/team z", "org_team_z"),  # characters a name cannot hold become _
    (None, "_x", "x"),  # a name starts with a letter or digit
    (None, "a" * 80, "a" * 64),
    (None, "//", None),
    (None, None, None),  # the daemon's default
    ("", None, None),
])
def test_engine_tenant(tenant, namespace, expected):
    from kachedb._link import engine_tenant

    assert engine_tenant(tenant, namespace) == expected


@pytest.mark.parametrize("bad", ["no spaces", "_other", "a" * 65, "é"])
def test_engine_tenant_refuses_a_bad_explicit_name(bad):
    from kachedb._link import engine_tenant

    with pytest.raises(ValueError, match="my_option .* is not a tenant name: 1 to 64"):
        engine_tenant(bad, None, "my_option")
