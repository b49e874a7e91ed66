"""What the folders under tests/ share: tests/ and the repository root on
``sys.path`` (``engine_support``, ``harness``), and the engine folders
(vllm/, sglang/, lmcache/) collected only where their engine is installed —
``make test-<engine>`` runs each in its own environment, where that folder is
on ``sys.path`` too, for its helper modules. In the project's main
environment, where no engine is installed, they collect nothing. dynamo/
(Dynamo's indexer, run from its own environment) is collected only where
``$KACHEDB_DYNAMO_PY`` names that environment's python (``make test-dynamo``)."""

import os
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
for _p in (TESTS.parent, TESTS):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from engine_support import ENGINES, engine_installed  # noqa: E402
# The `privileged` mark: a skip of a root- or tool-only test fails with
# KACHEDB_REQUIRE_PRIVILEGED_TESTS=1 (CI).
from harness.privileged import pytest_configure, pytest_runtest_makereport  # noqa: E402,F401

collect_ignore_glob = []
for _name in ENGINES:
    if engine_installed(_name):
        sys.path.insert(0, str(TESTS / _name))
    else:
        collect_ignore_glob.append(f"{_name}/test_*.py")
if os.environ.get("KACHEDB_DYNAMO_PY"):
    sys.path.insert(0, str(TESTS / "dynamo"))
else:
    collect_ignore_glob.append("dynamo/test_*.py")


@pytest.fixture(scope="session")
def workdir(tmp_path_factory):
    """A folder for the session's sockets, models and logs."""
    return tmp_path_factory.mktemp("kachedb-engine")
