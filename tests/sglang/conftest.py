"""Fixtures of the SGLang HiCache integration tests: they run only where SGLang
is installed (``make test-sglang`` runs them in .venv-sglang); elsewhere this
folder is skipped."""

import importlib.util
import sys
from pathlib import Path

import pytest


def _have_sglang() -> bool:
    # (this folder is itself named "sglang": a namespace package of that name is not SGLang)
    try:
        spec = importlib.util.find_spec("sglang")
    except (ImportError, ValueError):
        return False
    here = str(Path(__file__).resolve().parent)
    return bool(spec and spec.origin and spec.origin.endswith("__init__.py") and not spec.origin.startswith(here))


if not _have_sglang():  # e.g. the project's main environment
    collect_ignore_glob = ["test_*.py"]
else:
    sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="session")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("kachedb-sglang")


@pytest.fixture
def daemon(workdir, request):
    """A fresh daemon (the real binary) per test, stopped by its PID."""
    from sglang_support import Daemon

    d = Daemon(str(workdir / f"{request.node.name[:40]}.sock")).start()
    yield d
    d.stop()
