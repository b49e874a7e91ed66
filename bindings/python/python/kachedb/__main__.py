"""``python -m kachedb …`` and the ``kachedb`` console script: the Rust CLI
(``kachedb serve | stats | demo | bench ring | bench ops …``) run in-process,
except the benchmarks written in Python: ``kachedb bench`` with no subcommand
(or ``bench py``) runs ``kachedb._bench``, and ``bench compare`` runs
``kachedb._compare`` when this package has it."""

from __future__ import annotations

import sys
from typing import List, Optional, Sequence

from . import _kachedb_rust

#: `kachedb bench …` arguments that go to the Python benchmark: none, options
#: only (`bench --json --quick`), or the `py` subcommand.
_PY_BENCH = "py"
#: Other `kachedb bench` subcommands implemented in Python: subcommand -> module
#: (with `main(argv, prog=...)`). Used only if the module is there.
_PY_SUBCOMMANDS = {"compare": "kachedb._compare"}


def _python_bench_args(args: List[str]) -> Optional[List[str]]:
    """The Python benchmark's arguments if ``args`` asks for it, else ``None``."""
    if not args or args[0] != "bench":
        return None
    rest = args[1:]
    if rest and rest[0] == _PY_BENCH:
        return rest[1:]
    if any(a in ("-h", "--help") for a in rest):
        return None  # the Rust help lists the subcommands; see _bench_help_note
    if all(a.startswith("-") or (i > 0 and rest[i - 1] == "--socket") for i, a in enumerate(rest)):
        return rest
    return None


def _bench_help_note(args: List[str]) -> bool:
    return len(args) >= 2 and args[0] == "bench" and all(a in ("-h", "--help") for a in args[1:])


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the CLI with ``argv`` (default: ``sys.argv[1:]``); returns its exit code.

    The native ``cli_main`` receives the full argument vector, program name first
    (``["kachedb", *argv]``), as clap expects.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) >= 2 and args[0] == "bench" and args[1] in _PY_SUBCOMMANDS:
        import importlib

        try:
            module = importlib.import_module(_PY_SUBCOMMANDS[args[1]])
        except ModuleNotFoundError:
            module = None  # not in this build: the Rust CLI says what it has
        if module is not None:
            return int(module.main(args[2:], prog=f"kachedb bench {args[1]}"))
    bench_args = _python_bench_args(args)
    if bench_args is not None:
        from ._bench import main as bench_main

        return bench_main(bench_args)
    cli_main = getattr(_kachedb_rust, "cli_main", None)
    if cli_main is None:
        print(
            "kachedb: this build of the Python package has no command-line interface yet "
            "(kachedb._kachedb_rust.cli_main is missing); run the `kachedb` binary built from "
            "crates/kachedb-cli (`cargo run --release -p kachedb-cli -- ...`) instead.",
            file=sys.stderr,
        )
        return 2
    code = int(cli_main(["kachedb", *args]))
    if code == 0 and _bench_help_note(args):
        print(
            "\nFrom Python, `kachedb bench [--json] [--quick] [--socket PATH]` (or `kachedb bench py …`) runs the "
            "Python-side benchmark: get round trip, get of big blocks as views, put vs torch copy, get_many."
        )
    return code


if __name__ == "__main__":
    sys.exit(main())
