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


def _progress_while(blocking) -> int:
    """Runs ``blocking`` in a thread; counts the main thread's Python steps
    over 0.5 s meanwhile (0 if the GIL is held throughout)."""
    t = threading.Thread(target=blocking, daemon=True)
    t.start()
    time.sleep(0.05)  # let it block
    steps = 0
    end = time.monotonic() + 0.5
    while time.monotonic() < end:
        steps += 1
    return steps, t


def test_dropping_a_reservation_of_a_stopped_daemon_keeps_the_gil_free():
    d = Daemon("16MiB")
    try:
        # The native object: `Reservation.__del__` aborts through `abort()`,
        # which releases the GIL itself; a native reservation dropped
        # uncommitted (e.g. freed by the cycle collector) aborts in its `Drop`.
        kc = rust.NativeClient.connect(d.socket)
        holder = {"r": kc.reserve(1, 0, dtype_code(torch.uint8), [1024])}
        os.kill(d.proc.pid, signal.SIGSTOP)
        # Resumes the daemon from outside in 2 s even if this process is frozen
        # (the bug: the GIL held while blocked), so the test fails, not hangs.
        watchdog = subprocess.Popen(["sh", "-c", f"sleep 2; kill -CONT {d.proc.pid}"])
        try:

            def drop():
                holder.pop("r")  # the native reservation aborts on drop: a round trip
                gc.collect()

            steps, t = _progress_while(drop)
        finally:
            os.kill(d.proc.pid, signal.SIGCONT)
        t.join(10)
        watchdog.wait(10)
        assert not t.is_alive()
        assert steps > 1000, f"the main thread made {steps} steps while a reservation was dropped"
        kc.close()
    finally:
        d.stop(check=False)
