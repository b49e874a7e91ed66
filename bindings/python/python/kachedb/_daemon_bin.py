"""Where the ``kachedb`` executable is: the daemon and the CLI are one native
binary (``crates/kachedb-cli``), shipped inside this package as
``kachedb/bin/kachedb``; the extension module links only the client.

``$KACHEDB_BIN`` overrides the location (a binary built from a checkout,
another version). Only the standard library is used here."""

from __future__ import annotations

import os
import sys
from typing import Optional

#: The binary inside the installed package.
PACKAGED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin", "kachedb")


def daemon_binary() -> str:
    """The path of the ``kachedb`` executable to run; raises ``FileNotFoundError``
    naming what to do when there is none."""
    override = os.environ.get("KACHEDB_BIN")
    if override:
        if not os.access(override, os.X_OK):
            raise FileNotFoundError(f"KACHEDB_BIN={override} is not an executable file")
        return override
    if os.access(PACKAGED, os.X_OK):
        return PACKAGED
    raise FileNotFoundError(
        f"the kachedb executable is missing from this installation ({PACKAGED}): reinstall the package "
        "(pip install --force-reinstall kachedb-shm), or point KACHEDB_BIN at a `kachedb` binary built with "
        "`cargo build --release -p kachedb-cli`"
    )


def daemon_listening(path: str) -> Optional[str]:
    """``None`` if something accepts connections on the Unix socket ``path``,
    else why not (for a warning: the config commands print a config anyway)."""
    import socket  # here: `import kachedb` should not pay for it

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(2.0)
        s.connect(path)
        return None
    except OSError as e:
        return e.strerror or str(e)
    finally:
        s.close()


def warn_if_no_daemon(path: str, command: str) -> None:
    """The config commands' note on stderr when no daemon listens on ``path``
    (the config is printed anyway: the engine runs without the shared cache
    until a daemon starts there, and then connects)."""
    why = daemon_listening(path)
    if why is not None:
        print(
            f"{command}: warning: no KacheDB daemon listens on {path} ({why}); start one with "
            f"`kachedb serve --socket {path}` — until then the engine runs without the shared cache",
            file=sys.stderr,
        )
