"""Fixtures of the LMCache integration tests: they run only where LMCache is
installed (``make test-lmcache`` runs them in .venv-lmcache); elsewhere this
folder is skipped."""

import importlib.util
import sys
from pathlib import Path

import pytest


def _have_lmcache() -> bool:
    # (this folder is itself named "lmcache": a namespace package of that name is not LMCache)
    try:
        spec = importlib.util.find_spec("lmcache")
    except (ImportError, ValueError):
        return False
    here = str(Path(__file__).resolve().parent)
    return bool(spec and spec.origin and spec.origin.endswith("__init__.py") and not spec.origin.startswith(here))


if not _have_lmcache():  # e.g. the project's main environment
    collect_ignore_glob = ["test_*.py"]
else:
    sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="session")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("kachedb-lmcache")
