"""A connection to the daemon that never takes an engine down.

The engine integrations (``kachedb.vllm``, ``kachedb.sglang``,
``kachedb.lmcache``) treat the KacheDB tier as a cache: when the daemon is
absent at engine start, or dies mid-run, every operation becomes a miss / a
skipped store, one warning is logged per outage, and the link tries to connect
again at most every ``retry_s`` seconds (a restarted daemon is picked up; its
store starts empty). A client inherited over ``fork`` is never used: the child
connects its own.

This module needs no engine and no torch.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from typing import Any, MutableMapping, Optional, Tuple

from ._client import connect, default_socket_path


def resolve_socket(socket: Optional[str] = None) -> str:
    """``socket``, else the default path: ``$KACHEDB_SOCKET``, else the native
    default (as ``kachedb.connect``)."""
    return os.fspath(socket) if socket else default_socket_path()


#: What the daemon accepts as a tenant name (``kachedb.connect(tenant=...)``).
_TENANT_RULE = "1 to 64 ASCII letters, digits, '_', '-', '.', starting with a letter or digit"
_TENANT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def engine_tenant(tenant: Optional[str], namespace: Optional[str], option: str = "tenant") -> Optional[str]:
    """The tenant an engine integration connects as: ``tenant`` when given (it
    must be a valid name: ``ValueError`` naming ``option`` and the rule
    otherwise), else the integration's ``namespace`` label made a valid name
    (characters outside the rule become ``_``, leading ones that cannot start a
    name are dropped, at most 64 kept), else ``None``: the daemon's ``default``
    tenant."""
    if tenant is not None and tenant != "":
        name = str(tenant)
        if not _TENANT_RE.fullmatch(name):
            raise ValueError(f"{option} {name!r} is not a tenant name: {_TENANT_RULE}")
        return name
    if not namespace:
        return None
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", str(namespace)).lstrip("_.-")[:64]
    return name or None


class WarnScope:
    """The outages warned about by the links that share this scope: one warning
    per outage across all of them (e.g. a vLLM scheduler's and worker's links in
    one process see the same daemon).

    An epoch is a span of time between outages: it advances when a link
    connects after a warned outage; a link whose client is from an older epoch
    fails for an outage already warned about."""

    def __init__(self) -> None:
        self._epoch = 0
        self._warned_epoch = -1
        self._lock = threading.Lock()

    def should_warn(self, epoch: int) -> bool:
        """Whether an outage seen by a link connected in ``epoch`` (``-1``: never
        connected) is the first warned about; it counts as warned from now on."""
        with self._lock:
            if epoch < 0:
                epoch = self._epoch
            if self._warned_epoch < epoch:
                self._warned_epoch = epoch
                return True
            return False

    def connected(self) -> Tuple[int, bool]:
        """A link connected: the epoch its client belongs to, and whether the
        connection ends a warned outage (the tier is back on)."""
        with self._lock:
            back = self._warned_epoch == self._epoch
            if back:
                self._epoch += 1
            return self._epoch, back


class DaemonLink:
    """The client of one integration object, or ``None`` from ``client()`` while
    the tier is off.

    ``logger`` and ``label`` (the engine's name, e.g. ``"vLLM"``) and ``role``
    (e.g. ``"scheduler"``) name the warnings; ``counters`` (a mapping of the
    integration's process-wide counters) gets ``"tier_off"`` bumped on each
    failed connect or lost daemon and ``"reconnects"`` on each reconnect after a
    warned outage; ``scope`` is where warnings are counted (default: this link
    alone). ``outages`` and ``reconnects`` count the same events for this link.
    """

    def __init__(
        self,
        socket: Optional[str],
        *,
        logger: logging.Logger,
        label: str,
        role: Optional[str] = None,
        retry_s: float = 5.0,
        counters: Optional[MutableMapping[str, Any]] = None,
        scope: Optional[WarnScope] = None,
        tenant: Optional[str] = None,
    ) -> None:
        self.socket = socket
        self.tenant = tenant
        self.retry_s = float(retry_s)
        self.logger = logger
        self.label = label
        self.where = f"{label} {role}" if role else label
        self.counters = counters
        self.scope = scope if scope is not None else WarnScope()
        self.outages = 0
        self.reconnects = 0
        self._kc: Any = None
        self._pid = os.getpid()
        self._next_try_s = 0.0
        self._epoch = -1
        self._closed = False
        self._lock = threading.Lock()

    @property
    def is_on(self) -> bool:
        """Whether this link holds a client (of this process)."""
        return self._kc is not None and self._pid == os.getpid()

    def connect(self) -> Any:
        """Connects now and returns the client; raises (``Disconnected`` or
        another ``KacheDBError``) if the daemon does not answer."""
        with self._lock:
            self._drop_inherited()
            if self._kc is None:
                self._kc = connect(self.socket, tenant=self.tenant)
                self._connected()
            return self._kc

    def client(self) -> Any:
        """The client, or ``None`` while the tier is off (it is tried again at
        most every ``retry_s`` seconds)."""
        kc = self._kc
        if kc is not None and self._pid == os.getpid():
            return kc
        now = time.monotonic()
        if now < self._next_try_s:
            return None
        with self._lock:
            self._drop_inherited()
            if self._kc is not None:
                return self._kc
            if self._closed:
                return None
            try:
                self._kc = connect(self.socket, tenant=self.tenant)
            except Exception as e:  # Disconnected, an untrusted socket…: the tier is off
                self._next_try_s = now + self.retry_s
                why = f"no KacheDB daemon answers at {self.socket or default_socket_path()} ({e})"
            else:
                self._connected()
                return self._kc
        self._off(why, -1)  # an outage seen now: the scope's current epoch
        return None

    def current(self) -> Any:
        """The client if connected now, else ``None``, never trying to connect
        (for a caller on an engine's critical path)."""
        kc = self._kc
        return kc if kc is not None and self._pid == os.getpid() else None

    def failed(self, exc: BaseException) -> None:
        """An operation raised ``Disconnected``: the tier goes off until the next
        try, ``retry_s`` from now."""
        with self._lock:
            kc, self._kc = self._kc, None
            self._next_try_s = time.monotonic() + self.retry_s
            epoch = self._epoch
        if kc is not None:
            _close_quietly(kc)
        self._off(f"the KacheDB daemon went away ({exc})", epoch)

    def close(self) -> None:
        """Closes the client; the link stays off (no more tries)."""
        with self._lock:
            kc, self._kc = self._kc, None
            self._closed = True
            self._next_try_s = float("inf")
        if kc is not None:
            _close_quietly(kc)

    # -- helpers (called with the lock held, except _off) ------------------
    def _drop_inherited(self) -> None:
        if self._pid != os.getpid():
            # the parent's client: its rings and mappings are the parent's
            self._kc = None
            self._pid = os.getpid()

    def _connected(self) -> None:
        self._epoch, back = self.scope.connected()
        if back:
            self.reconnects += 1
            if self.counters is not None:
                self.counters["reconnects"] += 1
            self.logger.warning("KacheDB tier back on (%s): connected to %s", self.where, self._kc.socket)

    def _off(self, why: str, epoch: int) -> None:
        self.outages += 1
        if self.counters is not None:
            self.counters["tier_off"] += 1
        if self.scope.should_warn(epoch):
            self.logger.warning(
                "KacheDB tier off (%s): %s; %s keeps serving without it (misses, stores skipped) "
                "and retries every %g s",
                self.where,
                why,
                self.label,
                self.retry_s,
            )


def _close_quietly(kc: Any) -> None:
    try:
        kc.close()
    except Exception:
        pass
