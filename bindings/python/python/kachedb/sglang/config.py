"""``kachedb.sglang.hicache_config()`` and ``python -m kachedb sglang-config``.
Imports neither SGLang nor torch."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Dict, Optional, Sequence

from .._daemon_bin import warn_if_no_daemon
from .._link import engine_tenant, resolve_socket

#: ``--hicache-storage-backend-extra-config`` options the backend reads (SGLang's own
#: options, e.g. ``tp_lcm_size``, pass through to SGLang).
KNOWN_OPTIONS = ("socket", "namespace", "tenant", "retry_seconds", "no_server_args")


def hicache_config(socket: Optional[str] = None, **options: Any) -> Dict[str, Any]:
    """The ``--hicache-storage-backend-extra-config`` dict that makes SGLang's
    HiCache use the KacheDB daemon at ``socket`` as its L3 storage (with
    ``--hicache-storage-backend dynamic``)::

        python -m sglang.launch_server --model-path M --enable-hierarchical-cache \\
            --hicache-storage-backend dynamic \\
            --hicache-storage-backend-extra-config "$(python -m kachedb sglang-config)"

    ``socket``: the daemon's control socket (default: ``$KACHEDB_SOCKET``, else
    ``kachedb.default_socket_path()``). ``options``: ``namespace`` (a salt mixed
    into every key: servers share pages only with the same one), ``tenant``
    (the daemon tenant the backend connects as; default: ``namespace`` made a
    tenant name, else the daemon's ``default``; a bad name raises
    ``ValueError``), ``retry_seconds`` (how often a missing daemon is retried,
    default 5), ``no_server_args`` (``True``: a process without SGLang's server
    arguments shares pages, with other such processes only; without it the
    backend of such a process stores and finds nothing; an SGLang server's
    scheduler process always has them); other entries are passed through to
    SGLang.
    """
    cfg: Dict[str, Any] = {
        "backend_name": "kachedb",
        "module_path": "kachedb.sglang.storage",
        "class_name": "KacheDBStorage",
        # SGLang's zero-copy page interface (batch_get_v1 / batch_set_v1)
        "interface_v1": 1,
        "socket": resolve_socket(socket),
    }
    for k, v in options.items():
        if v is not None:
            cfg[k] = v
    if cfg.get("tenant") is not None:
        engine_tenant(cfg["tenant"], None)  # a bad name fails here, not at server start
    return cfg


def main(argv: Optional[Sequence[str]] = None, prog: str = "kachedb sglang-config") -> int:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Print the SGLang --hicache-storage-backend-extra-config JSON that makes HiCache "
        "use the KacheDB daemon as its L3 storage (with --hicache-storage-backend dynamic).",
        epilog="Example: python -m sglang.launch_server --model-path M --enable-hierarchical-cache "
        "--hicache-storage-backend dynamic "
        "--hicache-storage-backend-extra-config \"$(python -m kachedb sglang-config)\"",
    )
    p.add_argument("--socket", help="the daemon's control socket (default: $KACHEDB_SOCKET, else the default path)")
    p.add_argument("--namespace", help="a salt mixed into every key: servers share pages only with the same one")
    p.add_argument(
        "--tenant", help="the daemon tenant the backend connects as (default: the namespace, else the daemon's default)"
    )
    p.add_argument("--retry-seconds", type=float, help="how often a missing daemon is retried (default: 5)")
    p.add_argument("--indent", type=int, default=None, help="pretty-print with this indent")
    a = p.parse_args(list(argv) if argv is not None else None)
    try:
        cfg = hicache_config(a.socket, namespace=a.namespace, tenant=a.tenant, retry_seconds=a.retry_seconds)
    except ValueError as e:
        p.error(str(e))
    print(json.dumps(cfg, indent=a.indent))
    warn_if_no_daemon(cfg["socket"], prog)
    return 0


if __name__ == "__main__":
    sys.exit(main())
