"""``kachedb.lmcache.config()`` and ``python -m kachedb lmcache-config``.
Imports neither LMCache nor torch."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Dict, Optional, Sequence

from .._daemon_bin import warn_if_no_daemon
from .._link import engine_tenant, resolve_socket

#: The plugin name ``config()`` registers. LMCache hands the adapter a URL
#: ``plugin://<name>``; the adapter claims names of type ``kachedb`` (``kachedb``
#: itself, or ``kachedb.<instance>`` for a second daemon).
PLUGIN_TYPE = "kachedb"

#: Options read from ``extra_config["remote_storage_plugin.<name>.<option>"]``.
KNOWN_OPTIONS = ("socket", "namespace", "tenant", "retry_seconds", "max_pinned_bytes")

MODULE_PATH = "kachedb.lmcache.connector"
ADAPTER_CLASS = "KacheDBConnectorAdapter"


def option_key(plugin_name: str, option: str) -> str:
    """The ``extra_config`` key of ``option`` for the plugin ``plugin_name``."""
    return f"remote_storage_plugin.{plugin_name}.{option}"


def config(
    socket: Optional[str] = None,
    *,
    name: str = PLUGIN_TYPE,
    namespace: Optional[str] = None,
    tenant: Optional[str] = None,
    retry_seconds: Optional[float] = None,
    max_pinned_bytes: Optional[int] = None,
) -> Dict[str, Any]:
    """The LMCache config entries that add the KacheDB daemon at ``socket``
    (default: ``$KACHEDB_SOCKET``, else the default path) as a remote storage
    tier behind LMCache's local CPU tier::

        from lmcache.v1.config import LMCacheEngineConfig
        import kachedb.lmcache
        cfg = LMCacheEngineConfig.from_defaults(chunk_size=256, local_cpu=True,
                                                max_local_cpu_size=5, **kachedb.lmcache.config())

    Returns ``{"remote_storage_plugins": [name], "extra_config": {...}}``; merge
    ``extra_config`` into yours if you have one. ``name`` is ``"kachedb"`` or
    ``"kachedb.<instance>"``. ``namespace``: a salt mixed into every key (engines
    share chunks only with the same one). ``tenant``: the daemon tenant the
    plugin connects as (default: ``namespace`` made a tenant name, else the
    daemon's ``default``; a bad name raises ``ValueError``). ``retry_seconds``:
    how often a daemon that went away is tried again (default 5). ``max_pinned_bytes``: how many
    bytes of chunks got from KacheDB LMCache may hold as views of shared memory
    (each keeps its block pinned; past it a got chunk is copied into LMCache's
    local CPU tier; 0: always copy; default: ``max_local_cpu_size``).
    """
    if name != PLUGIN_TYPE and not name.startswith(PLUGIN_TYPE + "."):
        raise ValueError(f"the plugin name must be {PLUGIN_TYPE!r} or {PLUGIN_TYPE!r}.<instance>, not {name!r}")
    extra: Dict[str, Any] = {
        option_key(name, "module_path"): MODULE_PATH,
        option_key(name, "class_name"): ADAPTER_CLASS,
        option_key(name, "socket"): resolve_socket(socket),
    }
    if namespace is not None:
        extra[option_key(name, "namespace")] = str(namespace)
    if tenant is not None:
        extra[option_key(name, "tenant")] = engine_tenant(str(tenant), None)
    if retry_seconds is not None:
        extra[option_key(name, "retry_seconds")] = float(retry_seconds)
    if max_pinned_bytes is not None:
        if int(max_pinned_bytes) < 0:
            raise ValueError(f"max_pinned_bytes must be >= 0, not {max_pinned_bytes}")
        extra[option_key(name, "max_pinned_bytes")] = int(max_pinned_bytes)
    return {"remote_storage_plugins": [name], "extra_config": extra}


def main(argv: Optional[Sequence[str]] = None, prog: str = "kachedb lmcache-config") -> int:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Print the LMCache config entries (JSON, also valid YAML) that add the KacheDB daemon "
        "as a remote storage tier.",
        epilog="Merge them into the file LMCACHE_CONFIG_FILE points to.",
    )
    p.add_argument("--socket", help="the daemon's control socket (default: $KACHEDB_SOCKET, else the default path)")
    p.add_argument("--name", default=PLUGIN_TYPE, help="the plugin name: kachedb or kachedb.<instance>")
    p.add_argument("--namespace", help="a salt mixed into every key: engines share chunks only with the same one")
    p.add_argument(
        "--tenant", help="the daemon tenant the plugin connects as (default: the namespace, else the daemon's default)"
    )
    p.add_argument("--retry-seconds", type=float, help="how often a daemon that went away is tried again (default: 5)")
    p.add_argument("--max-pinned-bytes", type=int,
                   help="bytes of got chunks LMCache may hold as views of shared memory, pinned (default: "
                   "max_local_cpu_size; 0: always copy)")
    p.add_argument("--indent", type=int, default=None, help="pretty-print with this indent")
    a = p.parse_args(list(argv) if argv is not None else None)
    try:
        cfg = config(a.socket, name=a.name, namespace=a.namespace, tenant=a.tenant, retry_seconds=a.retry_seconds,
                     max_pinned_bytes=a.max_pinned_bytes)
    except ValueError as e:
        p.error(str(e))
    print(json.dumps(cfg, indent=a.indent))
    warn_if_no_daemon(cfg["extra_config"][option_key(a.name, "socket")], prog)
    return 0


if __name__ == "__main__":
    sys.exit(main())
