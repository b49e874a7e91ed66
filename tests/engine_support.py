"""What the engine integration test folders (tests/vllm, tests/sglang,
tests/lmcache) share: whether their engine is installed, and the real daemon
binary run as a process of the test (``harness.daemon``, shared with the
binding tests and the benchmarks).

tests/conftest.py puts tests/ on ``sys.path`` and imports this module; a
script a test runs in a fresh process does the same. Only the standard library
is imported here (``kachedb`` when a daemon is started), so the main
environment, where no engine is installed, can load the conftest and collect
nothing from those folders.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Optional, Sequence

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # harness/

from harness import daemon as harness_daemon  # noqa: E402
from harness.daemon import _die_with_parent, built_binary  # noqa: E402

__all__ = ["TESTS", "ROOT", "ENGINES", "engine_installed", "daemon_bin", "Daemon", "_die_with_parent"]

#: The engines with a test folder of their own (tests/NAME).
ENGINES = ("vllm", "sglang", "lmcache")


def engine_installed(name: str) -> bool:
    """Whether the engine package ``name`` (``"vllm"``, ``"sglang"``,
    ``"lmcache"``) can be imported. The test folder tests/NAME is itself a
    namespace package of that name when tests/ is on ``sys.path``: it is not the
    engine."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return False
    here = str(TESTS / name)
    return bool(spec and spec.origin and spec.origin.endswith("__init__.py") and not spec.origin.startswith(here))


def daemon_bin() -> str:
    """The daemon binary: ``$KACHEDB_BIN``, else target/release/kachedb."""
    return built_binary()


class Daemon(harness_daemon.Daemon):
    """The real daemon binary (``daemon_bin()``) serving ``socket`` (default:
    ``d.sock`` in a new private directory, removed by ``stop``) with a region of
    ``size`` (``harness.daemon.Daemon``): ``start()``, ``client()``,
    ``stats()``, ``kill()``, ``stop()``."""

    def __init__(self, socket: Optional[str] = None, size: str = "256MiB", extra: Sequence[str] = ()) -> None:
        super().__init__(socket, size, extra, binary=daemon_bin())
