"""``kachedb.vllm.kv_transfer_config()`` and ``python -m kachedb vllm-config``.
Imports neither vLLM nor torch."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Dict, Optional, Sequence

from .._daemon_bin import warn_if_no_daemon
from .._link import engine_tenant, resolve_socket

#: ``kv_connector_extra_config`` options this integration reads (others pass through to vLLM).
KNOWN_OPTIONS = (
    "namespace",
    "tenant",
    "store_mode",
    "retry_seconds",
    "stats_file",
    "kv_events_max_blocks",
    "self_describing_kv_events",
    "store_thread",
    "canonical_layout",
)


def parse_store_thread(value: Any) -> Any:
    """The ``store_thread`` option: ``"auto"``, ``True`` or ``False`` (also as
    ``1``/``0``, ``yes``/``no``, ``on``/``off`` strings); anything else is a ``ValueError``."""
    if value is None:
        return "auto"
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        v = value.strip().lower()
        if v == "auto":
            return "auto"
        if v in ("1", "true", "yes", "on"):
            return True
        if v in ("0", "false", "no", "off"):
            return False
    raise ValueError(f"store_thread must be 'auto', true or false, not {value!r}")


def kv_transfer_config(socket: Optional[str] = None, **options: Any) -> Dict[str, Any]:
    """The keyword arguments of ``vllm.config.KVTransferConfig`` that make a vLLM
    engine share its prefix KV blocks through the KacheDB daemon at ``socket``::

        from vllm import LLM
        from vllm.config import KVTransferConfig
        import kachedb.vllm
        llm = LLM(model=..., enable_prefix_caching=True,
                  kv_transfer_config=KVTransferConfig(**kachedb.vllm.kv_transfer_config()))

    ``options`` go to ``kv_connector_extra_config``: ``namespace`` (a salt: engines
    share blocks only with the same one), ``store_mode`` (``"batched"`` or
    ``"reserve"``), ``retry_seconds`` (how often a missing daemon is retried),
    ``stats_file`` (JSON counters written at engine shutdown), ``tenant`` (the
    daemon tenant the engine connects as; default: ``namespace``, else the
    daemon's ``default``), ``kv_events_max_blocks`` (see docs/vllm.md, "KV events"),
    ``store_thread`` (CPU: ``"auto"``, the default: stores off the engine's step
    wherever the engine keeps stepping until they are reported; ``True`` / ``False``:
    always / never; see docs/vllm.md), ``canonical_layout`` (vLLM's option: a
    block holds every KV head, so engines of any tensor-parallel degree share it;
    docs/vllm.md, "Sharing across tensor-parallel degrees"). A ``tenant`` that is not a valid tenant
    name, or a bad ``store_thread``, raises ``ValueError``.
    """
    extra: Dict[str, Any] = {
        "spec_name": "KacheDBOffloadingSpec",
        "spec_module_path": "kachedb.vllm.spec",
        "socket": resolve_socket(socket),
    }
    for k, v in options.items():
        if v is not None:
            extra[k] = v
    if extra.get("tenant") is not None:
        engine_tenant(extra["tenant"], None)  # a bad name fails here, not at engine start
    if "store_thread" in extra:
        parse_store_thread(extra["store_thread"])  # likewise
    return {
        "kv_connector": "KacheDBConnector",
        "kv_connector_module_path": "kachedb.vllm.connector",
        "kv_role": "kv_both",
        # A block that vanished between lookup and load is recomputed, never fails the request.
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def main(argv: Optional[Sequence[str]] = None, prog: str = "kachedb vllm-config") -> int:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Print the vLLM --kv-transfer-config JSON that makes an engine use the KacheDB daemon.",
        epilog="Example: vllm serve MODEL --enable-prefix-caching --kv-transfer-config \"$(python -m kachedb vllm-config)\"",
    )
    p.add_argument("--socket", help="the daemon's control socket (default: $KACHEDB_SOCKET, else the default path)")
    p.add_argument("--namespace", help="a salt mixed into every key: engines share blocks only with the same one")
    p.add_argument(
        "--tenant", help="the daemon tenant the engine connects as (default: the namespace, else the daemon's default)"
    )
    p.add_argument("--store-mode", choices=["batched", "reserve"], help="how blocks are written (default: batched)")
    p.add_argument("--retry-seconds", type=float, help="how often a missing daemon is retried (default: 5)")
    p.add_argument("--stats-file", help="a JSON file the engine's worker writes its KacheDB counters to at shutdown")
    p.add_argument(
        "--canonical-layout",
        action="store_true",
        default=None,
        help="blocks hold every KV head, shared by engines of any tensor-parallel degree (vLLM's canonical layout)",
    )
    p.add_argument("--indent", type=int, default=None, help="pretty-print with this indent")
    a = p.parse_args(list(argv) if argv is not None else None)
    try:
        cfg = kv_transfer_config(
            a.socket,
            namespace=a.namespace,
            tenant=a.tenant,
            store_mode=a.store_mode,
            retry_seconds=a.retry_seconds,
            stats_file=a.stats_file,
            canonical_layout=a.canonical_layout,
        )
    except ValueError as e:
        p.error(str(e))
    print(json.dumps(cfg, indent=a.indent))
    warn_if_no_daemon(cfg["kv_connector_extra_config"]["socket"], prog)
    return 0


if __name__ == "__main__":
    sys.exit(main())
