"""The CI switch of the privileged tests (harness/privileged.py): a test marked
``privileged`` that skips is listed as skipped, with its reason, unless
``KACHEDB_REQUIRE_PRIVILEGED_TESTS=1``, where it fails; other skips stay skips.
Run in a child pytest on a scratch suite."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

SUITE = '''
import pytest

@pytest.mark.privileged
def test_needs_a_tool():
    pytest.skip("frobnicate not found: apt-get install frobnicate")

@pytest.mark.privileged
@pytest.mark.skipif(True, reason="needs root to frobnicate")
def test_needs_root():
    pass

def test_optional_import():
    pytest.skip("no optional module here")

def test_runs():
    assert True
'''


def run_suite(tmp_path: Path, require: str | None) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text(
        f"import sys\nsys.path.insert(0, {str(REPO)!r})\n"
        "from harness.privileged import pytest_configure, pytest_runtest_makereport  # noqa: F401\n")
    (tmp_path / "test_suite.py").write_text(SUITE)
    env = {k: v for k, v in os.environ.items() if k != "KACHEDB_REQUIRE_PRIVILEGED_TESTS"}
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # the scratch suite needs none
    if require is not None:
        env["KACHEDB_REQUIRE_PRIVILEGED_TESTS"] = require
    return subprocess.run([sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider",
                           str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_privileged_skips_say_why_without_the_switch(tmp_path):
    out = run_suite(tmp_path, None)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 passed, 3 skipped" in out.stdout, out.stdout
    assert "frobnicate not found: apt-get install frobnicate" in out.stdout, out.stdout
    assert "needs root to frobnicate" in out.stdout, out.stdout


def test_privileged_skips_fail_with_the_switch(tmp_path):
    out = run_suite(tmp_path, "1")
    assert out.returncode == 1, out.stdout + out.stderr
    # Both privileged tests fail, naming the switch and the reason; the other skip stays a skip.
    assert "FAILED test_suite.py::test_needs_a_tool" in out.stdout, out.stdout
    assert "test_needs_root" in out.stdout and "needs root to frobnicate" in out.stdout, out.stdout
    assert "KACHEDB_REQUIRE_PRIVILEGED_TESTS=1 requires it to run" in out.stdout, out.stdout
    assert "SKIPPED [1] test_suite.py" in out.stdout and "no optional module here" in out.stdout, out.stdout
    assert "1 passed" in out.stdout and "1 skipped" in out.stdout, out.stdout


def test_switch_set_to_anything_but_1_is_off(tmp_path):
    out = run_suite(tmp_path, "0")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 passed, 3 skipped" in out.stdout, out.stdout
