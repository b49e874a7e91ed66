"""``python -m kachedb …`` and the ``kachedb`` console script: the Rust CLI
(``kachedb serve | stats …``) run in-process. The package's CLI has no
benchmarks; for ``bench`` it says where they are."""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from . import _kachedb_rust

#: Said after the CLI rejects ``bench``: the benchmarks are not part of the package.
_BENCH_ELSEWHERE = (
    "kachedb: the benchmarks are not part of the Python package: run `python benchmarks/python_ops.py` "
    "from a KacheDB checkout for the Python figures, or the `kachedb` binary "
    "(`cargo build --release -p kachedb-cli`) for `kachedb bench ring|ops`"
)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the CLI with ``argv`` (default: ``sys.argv[1:]``); returns its exit code.

    The native ``cli_main`` receives the full argument vector, program name first
    (``["kachedb", *argv]``), as clap expects.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["vllm-config"]:  # the vLLM --kv-transfer-config JSON (kachedb.vllm, pure Python)
        from .vllm.config import main as vllm_config_main

        return int(vllm_config_main(args[1:]))
    if args[:1] == ["sglang-config"]:  # the SGLang HiCache extra-config JSON (kachedb.sglang, pure Python)
        from .sglang.config import main as sglang_config_main

        return int(sglang_config_main(args[1:]))
    if args[:1] == ["lmcache-config"]:  # the LMCache remote-storage plugin entries (kachedb.lmcache, pure Python)
        from .lmcache.config import main as lmcache_config_main

        return int(lmcache_config_main(args[1:]))
    cli_main = getattr(_kachedb_rust, "cli_main", None)
    if cli_main is None:
        print(
            "kachedb: this build of the Python package has no command-line interface "
            "(kachedb._kachedb_rust.cli_main is missing); run the `kachedb` binary built from "
            "crates/kachedb-cli (`cargo run --release -p kachedb-cli -- ...`) instead.",
            file=sys.stderr,
        )
        return 2
    # The Rust commands stop cleanly on SIGINT themselves (`serve`, `stats --watch`);
    # Python's own SIGINT handler, chained behind theirs, would then raise
    # KeyboardInterrupt (a traceback) as soon as they return.
    import signal
    import threading

    restore = None
    if threading.current_thread() is threading.main_thread():
        restore = signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        code = int(cli_main(["kachedb", *args]))
    finally:
        if restore is not None:
            signal.signal(signal.SIGINT, restore)
    if code == 2 and args[:1] == ["bench"]:  # 2: the CLI's usage error
        print(_BENCH_ELSEWHERE, file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
