"""``python -m kachedb …`` and the ``kachedb`` console script: the Rust CLI
(``kachedb serve | stats | bench …``) run in-process."""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from . import _kachedb_rust


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the CLI with ``argv`` (default: ``sys.argv[1:]``); returns its exit code.

    The native ``cli_main`` receives the full argument vector, program name first
    (``["kachedb", *argv]``), as clap expects.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    cli_main = getattr(_kachedb_rust, "cli_main", None)
    if cli_main is None:
        print(
            "kachedb: this build of the Python package has no command-line interface yet "
            "(kachedb._kachedb_rust.cli_main is missing); run the `kachedb` binary built from "
            "crates/kachedb-cli (`cargo run --release -p kachedb-cli -- ...`) instead.",
            file=sys.stderr,
        )
        return 2
    return int(cli_main(["kachedb", *args]))


if __name__ == "__main__":
    sys.exit(main())
