"""Fixtures of the SGLang HiCache integration tests: they run only where SGLang
is installed (``make test-sglang`` runs them in .venv-sglang); elsewhere this
folder is skipped."""

import pytest
from engine_support import Daemon


@pytest.fixture
def daemon(workdir, request):
    """A fresh daemon (the real binary) per test, stopped by its PID."""
    d = Daemon(str(workdir / f"{request.node.name[:40]}.sock")).start()
    yield d
    d.stop()
