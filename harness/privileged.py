"""Tests that need root or a system tool, for pytest (the conftests of
``tests/`` and ``bindings/python/tests`` import these hooks).

Mark such a test ``@pytest.mark.privileged``; where what it needs is missing it
skips, saying why (``pytest.skip(reason)`` or a ``skipif`` mark), and ``pytest
-rs`` lists the reason. With ``KACHEDB_REQUIRE_PRIVILEGED_TESTS=1`` (CI, which
runs as root with ``make system-deps`` done) a skip of a marked test is a
failure instead, so that no root-only test passes CI by not running. The Rust
tests read the same variable (``crates/kachedb-cli/build.rs``)."""

from __future__ import annotations

import os

import pytest

REQUIRE_VAR = "KACHEDB_REQUIRE_PRIVILEGED_TESTS"


def required() -> bool:
    """Whether a privileged test must run here (the CI switch is on)."""
    return os.environ.get(REQUIRE_VAR) == "1"


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "privileged: needs root or a system tool; skips (saying why) without it, "
        f"fails instead with {REQUIRE_VAR}=1 (CI)",
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and required() and item.get_closest_marker("privileged") is not None:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"{item.nodeid} skipped, but {REQUIRE_VAR}=1 requires it to run: {reason}"
