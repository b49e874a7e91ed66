"""Fixtures of the SGLang HiCache integration tests: they run only where SGLang
is installed (``make test-sglang`` runs them in .venv-sglang); elsewhere this
folder is skipped."""

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))  # tests/: engine_support

from engine_support import Daemon, engine_installed  # noqa: E402

if not engine_installed("sglang"):  # e.g. the project's main environment
    collect_ignore_glob = ["test_*.py"]
else:
    sys.path.insert(0, str(HERE))


@pytest.fixture(scope="session")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("kachedb-sglang")


@pytest.fixture
def daemon(workdir, request):
    """A fresh daemon (the real binary) per test, stopped by its PID."""
    d = Daemon(str(workdir / f"{request.node.name[:40]}.sock")).start()
    yield d
    d.stop()
