"""A stopped daemon must never hang the whole Python process (issue 12,
item 12): dropping a reservation (an ABORT round trip) or a view (a RELEASE
that may wait for ring room) must not block with the GIL held."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import threading
import time

import torch

from kachedb import _kachedb_rust as rust
from kachedb._dtypes import dtype_code
from kdb_support import Daemon


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (state T)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")


def test_dropping_a_reservation_of_a_stopped_daemon_keeps_the_gil_free():
    d = Daemon("16MiB")
    try:
        # The native object: `Reservation.__del__` aborts through `abort()`,
        # which releases the GIL itself; a native reservation dropped
        # uncommitted (e.g. freed by the cycle collector) aborts in its `Drop`.
        kc = rust.NativeClient.connect(d.socket)
        holder = {"r": kc.reserve(1, dtype_code(torch.uint8), [1024])}
        started, done = threading.Event(), threading.Event()

        def drop():
            started.set()
            holder.pop("r")  # the native reservation aborts on drop: a round trip
            done.set()
            gc.collect()

        os.kill(d.proc.pid, signal.SIGSTOP)
        # Resumes the daemon from outside in 10 s even if this process is
        # frozen (the bug: the GIL held while blocked), so the test fails,
        # not hangs.
        watchdog = subprocess.Popen(["sh", "-c", f"sleep 10; kill -CONT {d.proc.pid}"])
        try:
            t = threading.Thread(target=drop, daemon=True)
            t.start()
            started.wait()
            time.sleep(0.1)  # lets the drop start its round trip to the stopped daemon
            # This line runs Python: it can run before the drop is over only if
            # the dropping thread let go of the GIL while it waits.
            ran_while_blocked = _stopped(d.proc.pid) and not done.is_set()
        finally:
            os.kill(d.proc.pid, signal.SIGCONT)
        t.join(15)
        watchdog.kill()
        watchdog.wait(10)
        assert not t.is_alive()
        assert done.is_set()
        assert ran_while_blocked, "the main thread could not run Python while a reservation of a stopped daemon was dropped"
        kc.close()
    finally:
        d.stop(check=False)
