"""The checks `make install-check` runs inside an installed environment (a
virtual environment that has the kachedb-shm distribution and numpy, nothing
of the source tree): the `kachedb` executable runs (`--version`, `serve`,
`stats`), `connect(start=True)` starts a daemon, a put, and a zero-copy numpy
get from another process. Run as ``<env>/bin/python install_check.py <dir>``;
exits non-zero, saying what failed, if a check fails. Standard library, numpy
and kachedb only (it runs in a Debian 11 root's Python 3.9 too)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

BIN = os.path.dirname(sys.executable)
KACHEDB = os.path.join(BIN, "kachedb")

READER = textwrap.dedent(
    """
    import os, sys
    import numpy as np
    import kachedb
    with kachedb.connect(sys.argv[1]) as kc:
        a = kc.get_numpy(b"install-check")
        b = kc.get_numpy(b"install-check")
        assert np.array_equal(a, np.arange(1 << 16, dtype=np.float32))
        # zero copy: both reads are read-only views of the same shared-memory bytes
        assert a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
        assert not a.flags.writeable and not a.flags.owndata
        print(f"  reader pid {os.getpid()}: zero-copy get ok ({a.nbytes} bytes at 0x{a.__array_interface__['data'][0]:x})")
    """
)


def run(*args: str, timeout: float = 60) -> str:
    out = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        sys.exit(f"FAILED: {' '.join(args)} -> {out.returncode}\n{out.stdout}{out.stderr}")
    return out.stdout


def main() -> None:
    work = sys.argv[1]
    os.makedirs(work, exist_ok=True)
    import kachedb
    import numpy as np

    assert "site-packages" in kachedb.__file__, f"kachedb imported from {kachedb.__file__}, not the installation"
    print(f"  kachedb from {os.path.dirname(kachedb.__file__)}")
    print(f"  {run(KACHEDB, '--version').strip()}")

    # `kachedb serve` as a user runs it, then `kachedb stats` against it.
    sock = os.path.join(work, "serve.sock")
    daemon = subprocess.Popen([KACHEDB, "serve", "--socket", sock, "--size", "64MiB"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(sock):
            if daemon.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"FAILED: kachedb serve did not listen on {sock}:\n{daemon.communicate()[0]}")
            time.sleep(0.05)
        stats = run(KACHEDB, "stats", "--socket", sock)
        print(f"  kachedb serve (pid {daemon.pid}) answers kachedb stats ({len(stats.splitlines())} lines)")
    finally:
        daemon.terminate()
        daemon.wait(timeout=30)

    # connect(start=True), a put here, a zero-copy get in another process.
    sock = os.path.join(work, "start.sock")
    kc = kachedb.connect(sock, start=True, size="64MiB")
    try:
        assert kc.started_daemon, "connect(start=True) did not start a daemon"
        print("  connect(start=True) started a daemon")
        kc.put(b"install-check", np.arange(1 << 16, dtype=np.float32))
        reader = os.path.join(work, "reader.py")
        with open(reader, "w") as f:
            f.write(READER)
        print(run(sys.executable, reader, sock, timeout=120), end="")
    finally:
        kc.stop_daemon()
    print("  install check ok")


if __name__ == "__main__":
    main()
