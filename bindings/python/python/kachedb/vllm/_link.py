"""The vLLM integration's link to the daemon (``kachedb._link.DaemonLink``):
warnings on the ``kachedb.vllm`` logger, counters in ``_state.COUNTERS``, and
one warning per outage for the whole process (the scheduler's and the worker's
links see the same daemon)."""

from __future__ import annotations

import logging
from typing import Optional

from .._link import DaemonLink, WarnScope
from ._state import COUNTERS

_SCOPE = WarnScope()


def daemon_link(socket: Optional[str], role: str, retry_s: float = 5.0, tenant: Optional[str] = None) -> DaemonLink:
    """A link of this process's ``role`` (``"scheduler"``, ``"worker rank 0"``),
    connecting as ``tenant`` (``None``: the daemon's default tenant)."""
    return DaemonLink(
        socket,
        logger=logging.getLogger("kachedb.vllm"),
        label="vLLM",
        role=role,
        retry_s=retry_s,
        counters=COUNTERS,
        scope=_SCOPE,
        tenant=tenant,
    )
