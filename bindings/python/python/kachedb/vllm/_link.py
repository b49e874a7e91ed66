"""A connection to the daemon that never takes the engine down.

The KacheDB tier is a cache: when the daemon is absent at engine start, or dies
mid-run, every operation becomes a miss / a skipped store, one warning is
logged, and the link tries to connect again at most every ``retry_s`` seconds
(a restarted daemon is picked up; its store starts empty).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Optional

from ._state import COUNTERS

logger = logging.getLogger("kachedb.vllm")

#: One warning per outage for the whole process (the scheduler's and the worker's
#: links see the same daemon). An epoch is a span of time between outages: it
#: advances when a link connects after a warned outage; a link whose client is
#: from an older epoch fails for an outage already warned about.
_glob = {"epoch": 0, "warned_epoch": -1}


class DaemonLink:
    def __init__(self, socket: Optional[str], role: str, retry_s: float = 5.0) -> None:
        self.socket = socket
        self.role = role
        self.retry_s = float(retry_s)
        self._kc: Any = None
        self._pid = os.getpid()
        self._next_try = 0.0
        self._epoch = -1
        self._lock = threading.Lock()

    def client(self) -> Any:
        """The client, or ``None`` while the tier is off."""
        kc = self._kc
        if kc is not None and self._pid == os.getpid():
            return kc
        now = time.monotonic()
        if now < self._next_try:
            return None
        with self._lock:
            if self._kc is not None and self._pid == os.getpid():
                return self._kc
            self._kc = None
            self._pid = os.getpid()
            import kachedb

            try:
                self._kc = kachedb.connect(self.socket)
            except Exception as e:  # Disconnected, or anything else: the tier is off
                self._next_try = now + self.retry_s
                self._off(f"no KacheDB daemon answers at {self.socket or kachedb.default_socket_path()} ({e})")
                return None
            if _glob["warned_epoch"] == _glob["epoch"]:
                _glob["epoch"] += 1
                COUNTERS["reconnects"] += 1
                logger.warning("KacheDB tier back on: connected to %s", self._kc.socket)
            self._epoch = _glob["epoch"]
            return self._kc

    def failed(self, exc: BaseException) -> None:
        """Called when an operation raised ``Disconnected``: the tier goes off."""
        with self._lock:
            kc, self._kc = self._kc, None
            self._next_try = time.monotonic() + self.retry_s
        epoch = self._epoch
        if kc is not None:
            try:
                kc.close()
            except Exception:
                pass
        self._off(f"the KacheDB daemon went away ({exc})", epoch)

    def _off(self, why: str, epoch: "Optional[int]" = None) -> None:
        COUNTERS["tier_off"] += 1
        if epoch is None or epoch < 0:
            epoch = _glob["epoch"]
        if _glob["warned_epoch"] < epoch:
            _glob["warned_epoch"] = epoch
            logger.warning(
                "KacheDB tier off (%s): %s; the engine keeps serving without it (misses, stores skipped) "
                "and retries every %g s",
                self.role,
                why,
                self.retry_s,
            )

    def close(self) -> None:
        with self._lock:
            kc, self._kc = self._kc, None
        if kc is not None:
            try:
                kc.close()
            except Exception:
                pass
