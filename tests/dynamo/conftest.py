"""Fixtures of the Dynamo indexer tests: the real daemon publishing its KV events
(``--events-endpoint``, ``--events-replay-endpoint``) and Dynamo's standalone indexer
(``dynamo_support.Indexer``) subscribed to it as one worker. tests/conftest.py collects this
folder only where ``$KACHEDB_DYNAMO_PY`` is set (``make test-dynamo``)."""

from __future__ import annotations

import pytest

from dynamo_support import Indexer
from kv_events_support import free_port


@pytest.fixture
def endpoints():
    """The daemon's PUB and replay endpoints (free ports on the loopback)."""
    return f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"


@pytest.fixture
def indexer(tmp_path):
    ix = Indexer(tmp_path / "indexer.log").start()
    yield ix
    ix.stop()
