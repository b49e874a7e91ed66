"""``python -m kachedb …`` and the ``kachedb`` console script.

``vllm-config``, ``lmcache-config`` and ``sglang-config`` are this package's
own (pure Python); every other command (``serve``, ``stats``, ``--help``) is
the native ``kachedb`` binary, which replaces this process (``execv``: the
daemon keeps this process's pid, and signals reach it directly)."""

from __future__ import annotations

import os
import sys
from typing import Callable, Dict, Optional, Sequence

from ._daemon_bin import daemon_binary


def _config_commands() -> Dict[str, Callable[[Sequence[str]], int]]:
    def vllm(argv: Sequence[str]) -> int:
        from .vllm.config import main

        return int(main(argv))

    def lmcache(argv: Sequence[str]) -> int:
        from .lmcache.config import main

        return int(main(argv))

    def sglang(argv: Sequence[str]) -> int:
        from .sglang.config import main

        return int(main(argv))

    return {"vllm-config": vllm, "lmcache-config": lmcache, "sglang-config": sglang}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the command in ``argv`` (default: ``sys.argv[1:]``). A config command
    returns its exit code; anything else execs the native binary and does not
    return (exit code 2 if there is none)."""
    args = list(sys.argv[1:] if argv is None else argv)
    config = _config_commands().get(args[0] if args else "")
    if config is not None:
        try:
            return config(args[1:])
        except ImportError as e:  # the engine integration's own message: what to install
            print(f"kachedb {args[0]}: {e}", file=sys.stderr)
            return 2
    try:
        binary = daemon_binary()
    except FileNotFoundError as e:
        print(f"kachedb: {e}", file=sys.stderr)
        return 2
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(binary, [binary, *args])
    raise AssertionError("unreachable: execv returns only by raising")


if __name__ == "__main__":
    sys.exit(main())
