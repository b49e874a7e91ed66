import gc
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root: harness/
# The `privileged` mark: a skip of a root- or tool-only test fails with
# KACHEDB_REQUIRE_PRIVILEGED_TESTS=1 (CI).
from harness.privileged import pytest_configure, pytest_runtest_makereport  # noqa: E402,F401

# Daemons started by the tests run the store's full invariant check for every
# stats answer, so that `invariants_ok` means the full check.
os.environ.setdefault("KACHEDB_CHECK_INVARIANTS", "1")

from kachedb import _kachedb_rust as rust

try:
    from hypothesis import HealthCheck, settings

    # No deadlines nor "too slow" health checks: CI machines are shared, and a
    # loaded one must not turn slowness into failures.
    settings.register_profile("kachedb", deadline=None, max_examples=100, suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile("kachedb")
except ImportError:  # pragma: no cover - hypothesis is a test dependency
    pass


@pytest.fixture
def no_leak():
    """Fails the test if it leaves a test buffer alive."""
    before = live_buffers()
    yield
    assert live_buffers() == before, "a test buffer outlived every view of it"


# --- daemons ---------------------------------------------------------------------

from kdb_support import Daemon, assert_no_pins, live_buffers, poll_until  # noqa: E402,F401

#: Seconds any one test may run; a hang (e.g. inside native code, where a
#: signal cannot interrupt it) fails the run instead of blocking CI.
DEFAULT_TIMEOUT = 120


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(DEFAULT_TIMEOUT, method="thread"))


@pytest.fixture(scope="module")
def daemon(request):
    """A private daemon for the test module (``DAEMON_SIZE`` in the module sets
    its megaslab, default 64 MiB), stopped afterwards even if tests failed; the
    teardown fails if it left its socket behind or did not stop cleanly."""
    d = Daemon(getattr(request.module, "DAEMON_SIZE", "64MiB"))
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture
def make_daemon():
    """Starts fresh daemons for one test: ``make_daemon("8MiB")``; all stopped
    (and checked) at the end of the test."""
    started = []

    def make(size="64MiB", *extra):
        d = Daemon(size, *extra)
        started.append(d)
        return d

    yield make
    errors = []
    for d in started:
        try:
            d.stop()
        except AssertionError as e:
            errors.append(str(e))
    assert not errors, errors


@pytest.fixture
def kc(daemon):
    """A client of the module's daemon; the test fails if it leaves pins or
    reservations behind."""
    c = daemon.connect()
    yield c
    c.close()
    del c
    assert_no_pins(daemon)


@pytest.fixture(scope="module")
def module_kc(daemon):
    """One client for a whole module (for hypothesis tests, which cannot use
    function-scoped fixtures)."""
    c = daemon.connect()
    yield c
    c.close()
