import gc

import pytest

from kachedb import _kachedb_rust as rust

try:
    from hypothesis import settings

    settings.register_profile("kachedb", deadline=None, max_examples=100)
    settings.load_profile("kachedb")
except ImportError:  # pragma: no cover - hypothesis is a test dependency
    pass


def live_buffers() -> int:
    """Test buffers whose memory is still allocated, after a full collection."""
    gc.collect()
    return rust._live_test_buffers()


@pytest.fixture
def no_leak():
    """Fails the test if it leaves a test buffer alive."""
    before = live_buffers()
    yield
    assert live_buffers() == before, "a test buffer outlived every view of it"
