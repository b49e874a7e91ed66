"""The LMCache integration tests run only where LMCache is installed (``make
test-lmcache`` runs them in .venv-lmcache); elsewhere this folder is skipped
(tests/conftest.py). Their other fixtures are tests/conftest.py's."""

import pytest

import lmcache_support as S


@pytest.fixture(scope="module")
def daemon(request):
    """One daemon for a module's tests, its megaslab the module's ``DAEMON_SIZE``
    (64 MiB if it has none); stopped after them, and it must exit cleanly."""
    d = S.Daemon(size=getattr(request.module, "DAEMON_SIZE", "64MiB")).start()
    try:
        yield d
    finally:
        assert d.stop() == 0
