"""LMCache's remote backend calling the KacheDB connector on the caller's thread.

LMCache's ``RemoteBackend`` runs every get and put of a remote connector as a
coroutine on its event-loop thread (``asyncio.run_coroutine_threadsafe``) and,
for a get, blocks the engine's thread on the future: two thread hand-offs per
call, each a wake-up of a parked thread (0.1–0.3 ms on a busy 2-core machine,
more than the daemon's round trip itself). The KacheDB connector's calls do
not wait on a network: a get is one ``get_prefix`` round trip and the views'
wrapping; a store of chunks that are reservations in the daemon's region is
one COMMIT batch. Neither needs another thread.

``install()`` puts a wrapper in front of two ``RemoteBackend`` methods, once per
process; each serves a backend whose connection is a ``KacheDBConnector`` (in
LMCache's ``InstrumentedRemoteConnector``, as LMCache's connector factory always
wraps it) on the calling thread, with what LMCache's own path does around the
call (serde, reference counts, the instrumented connector's and the backend's
statistics, the put callbacks), and hands every other call to LMCache's method
unchanged:

* ``batched_get_blocking``: the connector's ``load_now`` (its ``batched_get``)
  called directly;
* ``batched_submit_put_task``: when every chunk is an open reservation of the
  connector's ``RegionAllocator`` (a store in place: one COMMIT batch, no
  copy), the connector's ``store_now`` called directly; a batch with a chunk to
  copy (LMCache's own memory: milliseconds of copying) still goes to the event
  loop, off the engine's thread, as before.

Any other connector in between (LMCache's audit connector, configured by the
user) sends the calls LMCache's way. Errors are handled as in LMCache's path: a
get that raises is a miss for the whole batch (logged), a put that raises is
logged and dropped.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import Any, Callable, List, Optional, Sequence

from lmcache.v1.storage_backend.connector.instrumented_connector import InstrumentedRemoteConnector
from lmcache.v1.storage_backend.remote_backend import RemoteBackend

logger = logging.getLogger("kachedb.lmcache")

#: ``RemoteBackend`` attribute naming LMCache's own method a wrapper stands in front of.
_ORIGINAL = "_kachedb_original"


def _direct_connector(backend: Any) -> Any:
    """The ``KacheDBConnector`` ``backend`` calls through LMCache's instrumented
    connector, or ``None`` when its calls must go LMCache's way (no
    connection, another connector, MLA's worker-0 key rewrite). A connector
    serves these calls when its class says so (``SERVES_DIRECT_CALLS``: the
    connector imports this module, never the other way round)."""
    conn = getattr(backend, "connection", None)
    if type(conn) is not InstrumentedRemoteConnector or getattr(backend, "_mla_worker_id_as0_mode", False):
        return None
    inner = getattr(conn, "_connector", None)
    return inner if getattr(type(inner), "SERVES_DIRECT_CALLS", False) is True else None


def _batched_get_blocking(self: Any, keys: List[Any]) -> List[Optional[Any]]:
    conn = _direct_connector(self)
    if conn is None or self.local_cpu_backend is None:
        return getattr(_batched_get_blocking, _ORIGINAL)(self, keys)
    monitor = self.stats_monitor
    t1 = time.perf_counter()
    try:
        got: List[Optional[Any]] = list(conn.load_now(keys))
    except Exception as e:  # LMCache's path: the batch is a miss
        logger.warning("KacheDB batched get failed (%s): a miss", e)
        got = []
    t2 = time.perf_counter()
    duration = t2 - t1
    # what LMCache's instrumented connector and its backend record
    monitor.update_interval_remote_time_to_get(duration * 1000)
    monitor.update_interval_remote_time_to_get_sync(duration * 1000)
    total = sum(o.get_size() for o in got)
    if total > 0:
        monitor.update_interval_remote_read_metrics(total)
    out = [self.deserializer.deserialize(o) for o in got]
    if len(out) < len(keys):
        self._get_blocking_failed_count += 1
        out += [None] * (len(keys) - len(out))
    return out


def _batched_submit_put_task(
    self: Any,
    keys: Sequence[Any],
    memory_objs: List[Any],
    transfer_spec: Any = None,
    on_complete_callback: Optional[Callable[[Any], None]] = None,
) -> None:
    conn = _direct_connector(self)
    region = None if conn is None else conn.region
    if region is None or not memory_objs or not all(region.owns_open(o) for o in memory_objs):
        return getattr(_batched_submit_put_task, _ORIGINAL)(
            self, keys, memory_objs, transfer_spec, on_complete_callback
        )
    # LMCache's serde (``naive``: the object itself, one reference more),
    # dropped when the store returns, as its instrumented connector does.
    objs = []
    begin = time.perf_counter()
    try:
        for o in memory_objs:
            objs.append(self.serializer.serialize(o))
        try:
            conn.store_now(keys, objs)
        except Exception as e:  # LMCache's path: logged, the put dropped
            logger.warning("KacheDB batched put failed (%s)", e)
    finally:
        for o in objs:
            o.ref_count_down()
    monitor = self.stats_monitor
    monitor.update_interval_remote_time_to_put((time.perf_counter() - begin) * 1000)
    monitor.update_interval_remote_write_metrics(sum(o.get_size() for o in objs))
    done: Future = Future()
    done.set_result(None)
    self.batched_put_callback(done, list(keys))
    if on_complete_callback is not None:
        for key in keys:
            try:
                on_complete_callback(key)
            except Exception as e:
                logger.warning("on_complete_callback failed for key %s: %s", key, e)


def install() -> None:
    """Puts the wrappers in front of ``RemoteBackend``'s methods (once per process)."""
    for name, wrapper in (
        ("batched_get_blocking", _batched_get_blocking),
        ("batched_submit_put_task", _batched_submit_put_task),
    ):
        current = getattr(RemoteBackend, name)
        if current is wrapper:
            continue
        setattr(wrapper, _ORIGINAL, current)
        setattr(RemoteBackend, name, wrapper)


def installed() -> bool:
    """Whether ``install`` has run in this process."""
    return RemoteBackend.batched_get_blocking is _batched_get_blocking
