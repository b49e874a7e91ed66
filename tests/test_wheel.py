"""The kachedb-shm wheel as a user gets it: installed into a new virtual
environment that has never seen the source tree, then used from there — the
console script, the daemon it ships, ``connect(start=True)``, a put in one
process and a zero-copy read in another, and the engine extras' error.

The wheel is the one ``make wheel`` (a step of ``make test``) leaves in
target/wheel; ``$KACHEDB_WHEEL`` names another.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _wheel() -> Path:
    named = os.environ.get("KACHEDB_WHEEL")
    if named:
        return Path(named)
    found = sorted((ROOT / "target" / "wheel").glob("kachedb_shm-*.whl"), key=lambda p: p.stat().st_mtime)
    if not found:
        pytest.fail("no kachedb-shm wheel in target/wheel: run `make wheel` (make test does)")
    return found[-1]


@pytest.fixture(scope="module")
def wheel() -> Path:
    return _wheel()


@pytest.fixture(scope="module")
def venv(wheel):
    """A fresh virtual environment (no system site-packages) with the wheel
    installed from its file; numpy, its one dependency, comes from the index."""
    d = Path(tempfile.mkdtemp(prefix="kdb-wheel-", dir="/tmp"))
    try:
        subprocess.run([sys.executable, "-m", "venv", str(d / "venv")], check=True, timeout=300)
        pip = subprocess.run([str(d / "venv" / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                              str(wheel)], capture_output=True, text=True, timeout=600)
        assert pip.returncode == 0, pip.stdout + pip.stderr
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def run(venv_dir: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``args`` run from the environment's bin/, in a folder outside the source
    tree, with none of the checkout's variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KACHEDB_", "PYTHON", "VIRTUAL_ENV"))}
    env["PATH"] = f"{venv_dir / 'venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    cmd = [str(venv_dir / "venv" / "bin" / args[0]), *args[1:]]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=venv_dir, env=env)


def test_wheel_contents(wheel):
    """Named for the distribution, abi3, with the extension and an executable daemon."""
    assert wheel.name.startswith("kachedb_shm-") and "-abi3-" in wheel.name, wheel.name
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        assert "kachedb/bin/kachedb" in names, sorted(names)
        mode = z.getinfo("kachedb/bin/kachedb").external_attr >> 16
        assert mode & stat.S_IXUSR, oct(mode)
        assert any(n.startswith("kachedb/_kachedb_rust") and n.endswith(".so") for n in names)
        meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    assert "Name: kachedb-shm" in text
    assert "Provides-Extra: vllm" in text


def test_console_script_and_the_shipped_daemon(venv):
    out = run(venv, "kachedb", "--help")
    assert out.returncode == 0, out.stderr
    for cmd in ("serve", "stats", "vllm-config", "lmcache-config", "sglang-config"):
        assert cmd in out.stdout
    out = run(venv, "kachedb", "serve", "--help")
    assert out.returncode == 0, out.stderr
    assert "--size" in out.stdout and "--takeover" in out.stdout
    out = run(venv, "python", "-m", "kachedb", "serve", "--help")
    assert out.returncode == 0 and "--size" in out.stdout, out.stderr
    # The shipped binary has no benchmarks, and says where they are.
    out = run(venv, "kachedb", "bench", "ops")
    assert out.returncode == 2 and "benchmarks/python_ops.py" in out.stderr, out.stderr


def test_start_put_and_zero_copy_get_from_another_process(venv):
    sock = str(venv / "run" / "d.sock")
    out = run(venv, "kachedb", "stats", "--socket", sock)
    assert out.returncode != 0 and "kachedb serve" in out.stderr, out.stderr
    writer = textwrap.dedent(
        f"""
        import os, subprocess, sys
        import numpy as np
        import kachedb
        assert "site-packages" in kachedb.__file__, kachedb.__file__
        kc = kachedb.connect({sock!r}, start=True, size="64MiB")
        assert kc.started_daemon
        data = np.arange(1 << 16, dtype=np.float32)
        kc.put(b"wheel-block", data)
        reader = subprocess.run([sys.executable, "reader.py"], capture_output=True, text=True, timeout=120)
        print(reader.stdout, reader.stderr)
        assert reader.returncode == 0
        stats = subprocess.run(["kachedb", "stats", "--socket", {sock!r}], capture_output=True, text=True, timeout=60)
        print(stats.stdout, stats.stderr)
        assert stats.returncode == 0 and "blocks            1" in stats.stdout
        kc.stop_daemon()
        print("writer ok")
        """
    )
    reader = textwrap.dedent(
        f"""
        import os
        import numpy as np
        import kachedb
        with kachedb.connect({sock!r}) as kc:
            a = kc.get_numpy(b"wheel-block")
            b = kc.get_numpy(b"wheel-block")
            assert np.array_equal(a, np.arange(1 << 16, dtype=np.float32))
            # zero copy: both reads are views of the same shared-memory bytes, read-only
            assert a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
            assert not a.flags.writeable and not a.flags.owndata
            print("reader pid", os.getpid(), "ok")
        """
    )
    (venv / "writer.py").write_text(writer)
    (venv / "reader.py").write_text(reader)
    out = run(venv, "python", "writer.py", timeout=240)
    assert out.returncode == 0 and "writer ok" in out.stdout, out.stdout + out.stderr
    assert "reader pid" in out.stdout


def test_engine_extra_error_names_the_extra(venv):
    out = run(venv, "python", "-c", "import kachedb.vllm")
    assert out.returncode != 0
    assert 'pip install "kachedb-shm[vllm]"' in out.stderr, out.stderr


def test_the_shipped_extension_has_no_test_hooks(venv):
    """The test hooks are in the `testing` build only (make python); the shipped
    extension has the key mapping and the client classes, nothing of the tests."""
    probe = (
        "import kachedb._kachedb_rust as r; "
        "print(sorted(n for n in dir(r) if n.startswith('_') and not n.startswith('__'))); "
        "print(r.key_of(b'') == 0x2CCE3AD782E0344A1613FDE51073C736)"
    )
    out = run(venv, "python", "-c", probe)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["[]", "True"], out.stdout


def test_manylinux_tag(wheel):
    """auditwheel finds the wheel consistent with a manylinux tag (glibc only:
    no library outside the manylinux policy is linked, by the extension or the binary)."""
    auditwheel = shutil.which("auditwheel") or str(Path(sys.executable).parent / "auditwheel")
    out = subprocess.run([auditwheel, "show", str(wheel)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    text = " ".join(out.stdout.split())
    print(text)
    assert 'consistent with the following platform tag: "manylinux_2_' in text, text
