"""Who ``connect`` trusts (issue 12, item 1): a squatter socket that never
answers, a directory others can write, and ``connect(start=True)``'s log
through a planted symlink."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import threading
import time

import pytest

import kachedb


@pytest.fixture
def private_dir():
    d = tempfile.mkdtemp(prefix="kdbpy-t-", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _mute_squatter(path: str) -> socket.socket:
    """Accepts and never answers (the accepted sockets are kept open)."""
    s = socket.socket(socket.AF_UNIX)
    s.bind(path)
    s.listen(16)
    held = []

    def run():
        while True:
            try:
                c, _ = s.accept()
            except OSError:
                return
            held.append(c)

    threading.Thread(target=run, daemon=True).start()
    return s


def test_squatter_that_never_answers_does_not_hang_connect(private_dir):
    sock = os.path.join(private_dir, "s.sock")
    s = _mute_squatter(sock)
    try:
        t = time.monotonic()
        with pytest.raises(kachedb.KacheDBError, match="did not answer hello"):
            kachedb.connect(sock)
        assert time.monotonic() - t < 20
    finally:
        s.close()


def test_socket_in_a_directory_others_can_write_is_refused(private_dir):
    sock = os.path.join(private_dir, "s.sock")
    s = _mute_squatter(sock)
    try:
        os.chmod(private_dir, 0o777)
        with pytest.raises(kachedb.KacheDBError, match="lets everyone write to it"):
            kachedb.connect(sock)
        # trust_uid is accepted (our own uid changes nothing about the directory rule)
        with pytest.raises(kachedb.KacheDBError, match="lets everyone write to it"):
            kachedb.connect(sock, trust_uid=os.geteuid())
    finally:
        s.close()


def test_start_refuses_a_log_symlink(private_dir):
    victim = os.path.join(private_dir, "victim")
    with open(victim, "w") as f:
        f.write("keep")
    sock = os.path.join(private_dir, "d.sock")
    os.symlink(victim, os.path.join(private_dir, "kachedb_0.log"))
    with pytest.raises(kachedb.KacheDBError, match="symlink"):
        kachedb.connect(sock, start=True, size="8MiB", timeout=30)
    with open(victim) as f:
        assert f.read() == "keep"
    assert not os.path.exists(sock), "a daemon was started despite the refused log"
